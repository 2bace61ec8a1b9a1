"""Selector speed at paper scale (issue 5, part 5): time the exact subtree search per selection.

    python -m specfit.bench.selector_speed [--instances 500] [--seed 0] [--out FILE.jsonl]
                                           [--extra] [--ablate] [--draft-alpha A]

Instances: synthetic EAGLE-shaped 64-node trees, Qwen3-30B-A3B (48 layers, 128 experts, top-8)
with 30% of each layer's experts resident, PCIe 4.0 constants (specfit.search.synthetic),
for child_overlap 0.25 / 0.5 / 0.75; `--extra` adds stress settings beyond paper scale (more
overlap, a 100x / 1000x cheaper link) where far more nodes pay and the flow networks are large;
`--ablate` times the solver without its greedy start and without item merging.
Each selection is one full `solve` call (graph building included), timed with a wall clock after
a warm-up; the numba compile (or cache load) time of the first call is reported separately. The
bar: median <= 1 ms and p99 <= 5 ms on one core. Wall-clock tails include preemption by other
processes on a shared machine, so CPU time is shown beside it. Also compares the optimum with the
marginal-ratio greedy. Prints a table; writes one JSON line per configuration with --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from dataclasses import dataclass, field

import numpy as np

from specfit.search import evaluate, greedy, solve
from specfit.search.synthetic import QWEN3_30B_PCIE4, paper_scale_problem

BAR_MEDIAN_MS = 1.0
BAR_P99_MS = 5.0
GAP_RTOL = 1e-12  # greedy counts as suboptimal only beyond float noise


@dataclass
class Config:
    name: str
    child_overlap: float = 0.5
    resident_frac: float = 0.3
    link_speedup: float = 1.0  # divide c_miss and c_hit by this (a faster link)
    seed_offset: int = 0  # instances come from seed + seed_offset (ablations share their base's)
    solve_kw: dict = field(default_factory=dict)  # solver options (ablations)


PAPER_CONFIGS = [Config("overlap=0.25", 0.25, seed_offset=0),
                 Config("overlap=0.50 (paper)", 0.5, seed_offset=1),
                 Config("overlap=0.75", 0.75, seed_offset=2)]
EXTRA_CONFIGS = [Config("overlap=0.875", 0.875, seed_offset=3),
                 Config("link x100", 0.5, link_speedup=100.0, seed_offset=4),
                 Config("link x1000", 0.5, link_speedup=1000.0, seed_offset=5)]
ABLATION_CONFIGS = [Config(f"{c.name} {opt}=off", c.child_overlap, c.resident_frac,
                           c.link_speedup, c.seed_offset, {opt: False})
                    for c in (PAPER_CONFIGS[1], EXTRA_CONFIGS[2]) for opt in ("warm", "merge")]


def make_instances(cfg: Config, count: int, seed: int, **tree_kw) -> list:
    rng = np.random.default_rng(seed)
    consts = dict(QWEN3_30B_PCIE4)
    consts["c_miss"] /= cfg.link_speedup
    consts["c_hit"] /= cfg.link_speedup
    return [paper_scale_problem(rng, child_overlap=cfg.child_overlap,
                                resident_frac=cfg.resident_frac, constants=consts, **tree_kw)
            for _ in range(count)]


def warm_up() -> float:
    """Seconds for the first call (numba compile, or load from its on-disk cache)."""
    problem = paper_scale_problem(np.random.default_rng(12345))
    start = time.perf_counter()
    solve(problem)
    greedy(problem)
    return time.perf_counter() - start


def run_config(cfg: Config, instances: int, seed: int, **tree_kw) -> dict:
    problems = make_instances(cfg, instances, seed, **tree_kw)
    for p in problems[: min(10, len(problems))]:  # touch the code paths once more
        solve(p, **cfg.solve_kw)
    gc.collect()
    wall = np.empty(len(problems))
    cpu = np.empty(len(problems))
    results = []
    for i, p in enumerate(problems):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        res = solve(p, **cfg.solve_kw)
        wall[i] = (time.perf_counter_ns() - t0) / 1e6
        cpu[i] = (time.thread_time_ns() - c0) / 1e6
        results.append(res)
    greedy_wall = np.empty(len(problems))
    gaps = np.empty(len(problems))
    for i, (p, res) in enumerate(zip(problems, results, strict=True)):
        t0 = time.perf_counter_ns()
        mask = greedy(p)
        greedy_wall[i] = (time.perf_counter_ns() - t0) / 1e6
        gaps[i] = 1.0 - evaluate(p, mask)[2] / res.rho
    sub = gaps > GAP_RTOL
    return dict(
        config=cfg.name, solve_kw=cfg.solve_kw, child_overlap=cfg.child_overlap,
        resident_frac=cfg.resident_frac, link_speedup=cfg.link_speedup,
        instances=len(problems), seed=seed,
        median_ms=float(np.median(wall)), p90_ms=float(np.percentile(wall, 90)),
        p99_ms=float(np.percentile(wall, 99)), max_ms=float(wall.max()),
        cpu_median_ms=float(np.median(cpu)), cpu_p99_ms=float(np.percentile(cpu, 99)),
        mean_maxflow_calls=float(np.mean([r.maxflow_calls for r in results])),
        mean_iterations=float(np.mean([r.iterations for r in results])),
        mean_size=float(np.mean([r.size for r in results])),
        mean_max_depth=float(np.mean([r.max_depth for r in results])),
        mean_graph_vertices=float(np.mean([r.graph_vertices for r in results])),
        max_graph_vertices=int(max(r.graph_vertices for r in results)),
        mean_graph_arcs=float(np.mean([r.graph_arcs for r in results])),
        mean_rho=float(np.mean([r.rho for r in results])),
        greedy_median_ms=float(np.median(greedy_wall)),
        greedy_suboptimal_frac=float(sub.mean()),
        greedy_mean_gap_when_suboptimal=float(gaps[sub].mean()) if sub.any() else 0.0,
        greedy_max_gap=float(max(gaps.max(), 0.0)),
        meets_bar=bool(np.median(wall) <= BAR_MEDIAN_MS and np.percentile(wall, 99) <= BAR_P99_MS),
    )


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<30}{'n':>5} | {'median':>7}{'p90':>7}{'p99':>7}{'max':>7}{'cpu p99':>8} ms"
            f" | {'cuts':>5}{'iters':>6}{'size':>6}{'|V|':>7}{'|A|':>7}"
            f" | {'greedy subopt':>13}{'mean gap':>9}{'max gap':>9} | bar")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['config']:<30}{r['instances']:>5} | {r['median_ms']:>7.3f}{r['p90_ms']:>7.3f}"
            f"{r['p99_ms']:>7.3f}{r['max_ms']:>7.2f}{r['cpu_p99_ms']:>8.3f}   "
            f" | {r['mean_maxflow_calls']:>5.2f}{r['mean_iterations']:>6.2f}{r['mean_size']:>6.2f}"
            f"{r['mean_graph_vertices']:>7.1f}{r['mean_graph_arcs']:>7.1f}"
            f" | {100 * r['greedy_suboptimal_frac']:>12.1f}%"
            f"{100 * r['greedy_mean_gap_when_suboptimal']:>8.2f}%"
            f"{100 * r['greedy_max_gap']:>8.2f}% | {'ok' if r['meets_bar'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None, help="append one JSON line per config")
    ap.add_argument("--extra", action="store_true", help="also run the stress configurations")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the solver without the greedy start / without item merging")
    ap.add_argument("--draft-alpha", type=float, default=None,
                    help="Dirichlet concentration of the synthetic drafts (smaller: surer)")
    args = ap.parse_args(argv)
    tree_kw = {} if args.draft_alpha is None else {"draft_alpha": args.draft_alpha}

    compile_s = warm_up()
    configs = (PAPER_CONFIGS + (EXTRA_CONFIGS if args.extra else [])
               + (ABLATION_CONFIGS if args.ablate else []))
    rows = [run_config(cfg, args.instances, args.seed + cfg.seed_offset, **tree_kw)
            for cfg in configs]
    load = os.getloadavg()
    print(f"exact subtree search, {args.instances} instances/config, 64 nodes x 48 layers x 128 "
          f"experts, top-8; first call (numba compile or cache load): {compile_s:.2f} s; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load avg {load[0]:.2f}")
    print(format_table(rows))
    print(f"bar: median <= {BAR_MEDIAN_MS} ms and p99 <= {BAR_P99_MS} ms per selection "
          "(wall clock).")
    print("cuts: max-flow calls per selection (0 when pruning settles it); size: chosen nodes; "
          "|V|, |A|: largest flow network; greedy gap: 1 - rho_greedy / rho_opt.")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(dict(r, compile_s=compile_s, loadavg=load[0], **tree_kw))
                         + "\n")


if __name__ == "__main__":
    main()
