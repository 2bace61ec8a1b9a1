"""Host time of the look-ahead prefetcher's hook, by part, per layer and pass (a measurement, not a test).

The look-ahead (``prefetch=lookahead``, the fitted router) runs in every MoE layer of every pass, on
the host's critical path, and what it gains is the stall it removes minus that host time. This
decodes held-out prompts with AR + look-ahead on the demo pair (or ``--model``) and times, inside
one process, each part of the hook: the fitted router (prediction and learning), the picks and
the request's way through the sink, the runtime's ``prefetch`` (the cache's admission, the
copies' issue) and the copy engine's call (on the emulated link a real memcpy of each expert).
The parts nest: each row's time includes the rows indented under it. The look-ahead's gate is
off here, so that every pass runs the hook.

    python scripts/lookahead_cost.py [--capacity 8] [--prompts 4] [--tokens 48]

Timers wrap the prefetcher's and runtime's methods on the built engine; they add about a
microsecond a call. The host's speed drifts, so compare two versions of the code by running this
alternately, several times.
"""

from __future__ import annotations

import argparse
import time

import specfit.offload.runtime as offload
from specfit.api import build
from specfit.bench.method_timers import MethodTimers
from specfit.config import compose
from specfit.workloads import load_workload

# (label, depth): what each timer covers, in nesting order
PARTS = [
    ("look-ahead hook (fitted layers)", 0),
    ("fitted router: predict and learn", 1),
    ("picks and request", 1),
    ("sink: checks, held experts", 2),
    ("runtime.prefetch", 3),
    ("cache admission (prefetch_loads)", 4),
    ("issue (runtime._issue)", 4),
    ("copy engine issue (memcpy on a CPU)", 5),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per workload (prose, gsm)")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args(argv)
    base = [f"model={args.model}", f"cache.capacity={args.capacity}", "cache.copy=emulated",
            f"max_new_tokens={args.tokens}", "prefetch=lookahead", "prefetch.gate=false"]
    engine = build(compose(base), calibrate_now=False)
    prefetcher, runtime = engine.prefetcher, engine.runtime
    if getattr(prefetcher, "fitted", None) is None:
        raise SystemExit("the model has a single MoE layer: the look-ahead uses its own router there, no fitted one")
    timers = MethodTimers()
    timed, seconds, calls = timers.wrap, timers.seconds, timers.calls  # short names for the table below
    labels = [label for label, _ in PARTS]
    timed(prefetcher, "_prefetch_fitted", labels[0])
    timed(prefetcher.fitted, "observe", labels[1])
    timed(prefetcher, "_prefetch_scores", labels[2])
    timed(prefetcher.sink, "prefetch", labels[3])
    timed(runtime, "prefetch", labels[4])
    timed(offload, "prefetch_loads", labels[5])
    timed(runtime, "_issue", labels[6])
    timed(runtime.copy_engine, "issue", labels[7])
    prompts = []
    for workload in ("prose", "gsm"):
        prompts += load_workload(compose(base + [f"workload={workload}",
                                                 f"workload.num_prompts={args.prompts}"]).workload)[:args.prompts]
    engine.generate(prompts[0])  # warm-up, and the fit's first samples
    timers.clear()
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        tokens += len(engine.generate(prompt).token_ids)
    wall = time.perf_counter() - start
    hooks = calls[labels[0]]
    print(f"{tokens} tokens, {1e3 * wall / tokens:.2f} ms a token; {hooks / tokens:.1f} fitted-layer hooks a token")
    print(f"{'part':46s} {'us a call':>10s} {'calls a token':>14s} {'ms a token':>11s}")
    for label, depth in PARTS:
        name = "  " * depth + label
        n = calls[label]
        print(f"{name:46s} {1e6 * seconds[label] / max(n, 1):10.1f} {n / tokens:14.1f} {1e3 * seconds[label] / tokens:11.3f}")
    print("The runtime's _issue and the copy engine count demand copies too; 'picks and request' counts the first "
          "layer's, made from the embedding as the pass starts (outside the fitted-layer hooks).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
