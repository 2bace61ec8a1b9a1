"""``specfit fit-acceptance trace.path=DIR``: fit the learned acceptance model offline, and score
every estimator on held-out traces.

The model is fitted on the trace's trees (every outcome the recorded argmaxes settle, see
:mod:`specfit.types.acceptance`) and written to ``out_dir/learned.json``; use it with
``acceptance=learned acceptance.state_file=out_dir/learned.json`` (live or in ``specfit replay``).
Each estimator is then scored on the held-out traces (``held_out=[DIR, ...]``, or else the last
``held_out_fraction`` of the trace's own sequences): Brier score, log loss and reliability of its
forecasts, each made before it learns from that tree. One row per estimator is appended to
``out_dir/results.jsonl``; ``specfit report out_dir`` plots the reliability.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specfit.types.acceptance import AcceptanceScore, score
from specfit.trace.settled import trace_trees
from specfit.errors import ConfigError
from specfit.validation import number


@dataclass
class FitTraceConfig:
    path: str | None = None  # the trace to fit on (`specfit record` writes one)


@dataclass
class FitAcceptanceConfig:
    trace: FitTraceConfig = field(default_factory=FitTraceConfig)
    held_out: list[str] = field(default_factory=list)  # traces to score on; empty: a part of trace.path
    held_out_fraction: float = 0.3  # of the trace's sequences (the last ones), when held_out is empty
    out_dir: str = "acceptance"  # learned.json (the model) and results.jsonl (the scores)
    prior_strength: float = 20.0  # the learned model's settings (acceptance.* of acceptance=learned)
    recent_decay: float = 0.9

    def __post_init__(self) -> None:
        if not self.trace.path:
            raise ConfigError("set trace.path=DIR: a trace written by `specfit record`")
        number("held_out_fraction", self.held_out_fraction, minimum=0.0, maximum=0.9)
        number("prior_strength", self.prior_strength, minimum=1e-9)
        number("recent_decay", self.recent_decay, minimum=0.0, maximum=1.0)


def fit_acceptance(cfg: FitAcceptanceConfig) -> Path:
    """Fit, score, write; returns the model file."""
    from specfit.messages import note_once
    from specfit.files import append_jsonl_lines, check_results_file, check_writable, write_atomic
    from specfit.plugins.acceptance.calibrated import CalibratedAcceptance
    from specfit.plugins.acceptance.learned import LearnedAcceptance
    from specfit.plugins.acceptance.path_prob import PathProbAcceptance
    from specfit.trace.format import load_trace

    out = check_writable(cfg.out_dir, "out_dir", directory=True)
    check_results_file(out / "results.jsonl", "out_dir")
    for path in cfg.held_out:  # scoring on the trace the model was fitted on would flatter it
        if Path(path).expanduser().resolve() == Path(cfg.trace.path).expanduser().resolve():
            raise ConfigError(f"held_out: {path} is the training trace (trace.path={cfg.trace.path}); hold out "
                              f"another trace, or leave held_out empty to hold out the last held_out_fraction of it")
    trace = load_trace(cfg.trace.path)
    trees = list(trace_trees(trace))
    held_traces = [load_trace(path, key="held_out") for path in cfg.held_out]
    model = _model_of(trace)
    for path, held_model in zip(cfg.held_out, map(_model_of, held_traces)):
        if held_model != model:
            note_once(f"held_out trace {path} was recorded with another model ({held_model[0]}) than "
                      f"trace.path={cfg.trace.path} ({model[0]}): its scores measure how the fit transfers")
    for note in dict.fromkeys(n for t in (trace, *held_traces) for n in t.notes):  # each once
        print(f"note: {note}")
    if cfg.held_out:
        train, held = trees, [t for h in held_traces for t in trace_trees(h)]
    else:
        per_sequence = [len(s) for s in trace.sequences]
        cut_sequences = len(per_sequence) - int(round(len(per_sequence) * cfg.held_out_fraction))
        if cfg.held_out_fraction > 0 and (cut_sequences < 1 or cut_sequences == len(per_sequence)):
            raise ConfigError(f"trace.path={cfg.trace.path}: {len(per_sequence)} sequences cannot be split "
                              f"{1 - cfg.held_out_fraction:.0%}/{cfg.held_out_fraction:.0%}; give held_out=[DIR]")
        cut = sum(per_sequence[:cut_sequences])
        train, held = trees[:cut], trees[cut:]
    settings = {"prior_strength": cfg.prior_strength, "recent_decay": cfg.recent_decay}
    fitted = LearnedAcceptance(**settings)
    samples = fitted.fit_trees(train)
    if samples == 0:
        raise ConfigError(f"trace.path={cfg.trace.path}: no settled outcomes to learn from (no drafted trees)")

    if held and not any(len(t.tree) for t in held):  # plain decoding: nothing drafted to score
        where = (f"held_out={list(cfg.held_out)}" if cfg.held_out
                 else f"the last {cfg.held_out_fraction:.0%} of trace.path")
        raise ConfigError(f"{where}: no drafted trees to score the estimators on (recorded with drafter=none?)")
    scores: list[tuple[str, AcceptanceScore]] = []
    if held:
        import copy

        for label, estimator in (("path_prob", PathProbAcceptance()), ("calibrated", CalibratedAcceptance()),
                                 ("learned", LearnedAcceptance(**settings)),
                                 ("learned (fitted)", copy.deepcopy(fitted))):
            result = score(estimator, held)
            result.estimator = label
            scores.append((label, result))
    model = {"state": fitted.state(), "settings": settings, "trace": str(cfg.trace.path), "samples": samples,
             # the target and head it is about (traces before 2026-12-07 do not say): an engine of
             # another setup that loads it notes the difference
             **({"setup": trace.meta.info["acceptance_setup"]} if "acceptance_setup" in trace.meta.info else {}),
             "scores": {label: {k: v for k, v in s.as_dict().items() if k != "acceptance_reliability"}
                        for label, s in scores}}
    path = write_atomic(out / "learned.json", json.dumps(model, indent=1) + "\n")
    rows = [{"command": "fit-acceptance", "trace": str(cfg.trace.path), "held_out": list(cfg.held_out) or
             f"last {cfg.held_out_fraction:.0%} of trace.path", **s.as_dict()} for _, s in scores]
    if rows:
        append_jsonl_lines(out / "results.jsonl", rows)
    print(score_table([s for _, s in scores]) if scores else "(nothing held out: no scores)")
    print(f"fitted on {samples} outcomes of {len(train)} trees; use it with acceptance=learned "
          f"acceptance.state_file={path}")
    return path


def _model_of(trace) -> tuple[str, object]:  # noqa: ANN001 - a Trace
    """The model a trace was recorded with: its path or built-in name (as its config says), and its shape."""
    model = (trace.meta.config or {}).get("model") or {}
    name = model.get("path") or (f"builtin:{model['builtin']}" if model.get("builtin") else "unknown")
    return str(name), json.dumps(trace.meta.spec, sort_keys=True, default=str)


def score_table(scores: list[AcceptanceScore]) -> str:
    """Brier score and log loss per estimator (lower is better)."""
    width = max(len("estimator"), *(len(s.estimator) for s in scores))
    lines = [f"{'estimator':<{width}}  {'brier':>7}  {'log loss':>8}  {'nodes':>7}", "-" * (width + 28)]
    lines += [f"{s.estimator:<{width}}  {s.brier:7.4f}  {s.log_loss:8.4f}  {s.nodes:7d}" for s in scores]
    return "\n".join(lines)
