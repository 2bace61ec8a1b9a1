"""Exact trace recording and replay (docs/method.md section 7).

``record_trace(engine, prompts)`` decodes greedily and keeps, for every position of the output, the
candidate tree with the target's argmax and routing per node; ``replay_trace(trace, selector, cache,
cost_model, predictor)`` then runs any selector, cache policy and cost model over it without the
target's forward passes. ``load_trace`` / ``Trace.save`` read and write the on-disk format.
(``record_trace`` and ``replay_trace`` are :func:`specfit.trace.record.record` and
:func:`specfit.trace.replay.replay`, imported on first use: they need torch, the format does not.)
"""

from specfit.trace.format import Trace, TraceError, TraceMeta, TracePosition, TraceSequence, load_trace

__all__ = ["Trace", "TraceError", "TraceMeta", "TracePosition", "TraceSequence", "load_trace", "record_trace",
           "replay_trace"]


def __getattr__(name: str):  # noqa: ANN202
    if name == "record_trace":
        from specfit.trace.record import record

        return record
    if name == "replay_trace":
        from specfit.trace.replay import replay

        return replay
    raise AttributeError(f"module 'specfit.trace' has no attribute {name!r}")
