"""``specfit report``: results files -> a Markdown report with PNG plots.

Reads the JSONL that ``bench`` (or ``demo``, ``generate``, a Hydra sweep of them) wrote: files or
directories, searched recursively for results.jsonl. Rows are grouped by workload, method and the
config keys that differ between runs (a sweep's axes), and averaged like the bench table. Plots:
throughput per method per workload; acceptance length against verified nodes per cycle; the
cycle-time breakdown (drafting, selection, verification compute, and the time compute waited on
copies, shown apart) per generated token. Runs that prefetched experts add prefetch precision and
recall (defined in :func:`specfit.results.prefetch_figures`) to the tables.

Replayed methods (``specfit replay``) get a table per trace, as the replay printed it, marked as
predicted time. Rows that score an acceptance estimator (``specfit replay`` of a cost-aware selector,
``specfit fit-acceptance``) add a table of Brier score and log loss per estimator and a reliability
plot (mean forecast a_v against the observed acceptance frequency, per forecast bin). Plots need
matplotlib (the ``plots`` extra); without it the report has the tables alone.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from specfit.errors import ConfigError
from specfit.files import RESULTS_ROW_KEYS, check_writable, is_results_row, read_jsonl, write_atomic
from specfit.results import comparison_table, mean_stats, paired_fields

SWEEP_KEYS_IGNORED = {"prompt", "prompt_ids", "workload", "methods", "method_presets", "workloads", "results_file",
                      "selector", "drafter", "cost_model", "predictor", "cache.name", "hydra"}


def read_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The decoding runs (rows with output_throughput) of the results at ``paths``."""
    runs = [r for r in read_all_rows(paths) if "output_throughput" in r]
    if not runs:
        raise ConfigError("report: the results hold no decoding runs (rows with output_throughput)")
    return runs


def read_all_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every row of the results at ``paths`` (files, or directories searched for results.jsonl).

    Each file is read once, however many of ``paths`` reach it (a run directory and its results.jsonl);
    a file named explicitly must hold specfit results rows."""
    rows: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for path in map(Path, paths):
        files = sorted(path.rglob("results.jsonl")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            key, eq, value = str(path).partition("=")
            if eq and key.replace(".", "").replace("_", "").isalnum() and not path.exists():  # out_dir=DIR, Hydra-style
                raise ConfigError(f"report: no results found at {path} (specfit report takes results paths and "
                                  f"--out DIR, not {key}=...)")
            raise ConfigError(f"report: no results found at {path}" + ("" if path.exists() else " (no such file or "
                                                                                       "directory)"))
        for f in files:
            if f.resolve() in seen:
                continue
            seen.add(f.resolve())
            file_rows = read_jsonl(f, key="report")  # a torn last line (an interrupted run) is skipped
            if not path.is_dir() and not any(is_results_row(r) for r in file_rows):  # named, so meant as results
                if file_rows:
                    what = f"no row has {' or '.join(map(repr, RESULTS_ROW_KEYS))}"
                else:
                    what = "its only line is cut short, an interrupted write" if f.read_bytes().strip() else "it is empty"
                raise ConfigError(f"report: {f}: holds no specfit results rows ({what}); name results.jsonl files "
                                  "or run directories")
            if file_rows and all(_is_summary_row(r) for r in file_rows):
                raise ConfigError(f"report: {f} is a bench summary (each method's means), not its runs; name the "
                                  f"results.jsonl beside it or the run directory")
            _check_runs(f, file_rows)
            rows += file_rows
    return rows


def _is_summary_row(row: dict[str, Any]) -> bool:
    """A row of bench's summary.jsonl: a method's means over a workload (or over all of them)."""
    return "command" not in row and ("outputs_identical" in row or row.get("workload") == "all")


def acceptance_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows that score an acceptance estimator, each with a ``label`` naming it and where it ran."""
    out = []
    for r in rows:
        reliability = r.get("acceptance_reliability")
        if not isinstance(reliability, list) or not all(isinstance(b, list) and len(b) == 3 for b in reliability):
            continue
        source = r.get("method") or r.get("command", "run")
        estimator = r.get("acceptance_estimator", "?")
        out.append({**r, "label": estimator if source == "fit-acceptance" else f"{source} ({estimator})"})
    places = [_scored_on(r) for r in out]
    if len(set(places)) > 1:  # several traces: the same estimator's rows must be told apart
        short = [[Path(p).name for p in place] for place in places]
        named = short if len({tuple(s) for s in short}) == len(set(places)) else places  # names clash: paths
        for r, where in zip(out, named):
            r["label"] += f" on {', '.join(where)}"
    return out


def _scored_on(row: dict[str, Any]) -> tuple[str, ...]:
    """The traces whose outcomes a row's scores were measured on: the replayed trace, or
    fit-acceptance's held-out traces (its own trace when it held out a part of it)."""
    held = row.get("held_out") if row.get("command") == "fit-acceptance" else None
    if isinstance(held, list) and held:
        return tuple(str(w) for w in held)
    return (str(row.get("trace")),)


def acceptance_table(rows: Sequence[dict[str, Any]]) -> str:
    """Brier score and log loss per scored estimator (lower is better)."""
    width = max(len("estimator"), *(len(r["label"]) for r in rows))
    lines = [f"{'estimator':<{width}}  {'brier':>7}  {'log loss':>8}  {'nodes':>8}", "-" * (width + 29)]
    for r in rows:
        lines.append(f"{r['label']:<{width}}  {float(r.get('acceptance_brier', 0)):7.4f}  "
                     f"{float(r.get('acceptance_log_loss', 0)):8.4f}  {int(r.get('acceptance_nodes', 0)):8d}")
    return "\n".join(lines)


#: Fields the report averages and sums: a run whose value is not a number would fail deep in the tables.
NUMERIC = ("output_throughput", "num_output_tokens", "total_seconds", "cycles", "draft_seconds", "select_seconds",
           "verify_compute_seconds", "h2d_seconds", "h2d_bytes", "expert_cache_hits", "expert_cache_misses",
           "spec_decode_acceptance_length", "verified_nodes_per_cycle", "experts_per_layer_union", "predictor_recall",
           "predictor_precision", "h2d_stall_seconds", "link_busy_seconds", "prefetch_issued", "prefetch_used",
           "prefetch_wasted", "verify_seconds")


def _check_runs(f: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Decoding runs (rows with output_throughput) carry the numbers the tables need; else name file and line."""
    lines = [n for n, line in enumerate(f.read_bytes().decode("utf-8").split("\n"), 1) if line.strip()]
    for n, row in zip(lines, rows):
        if "output_throughput" not in row:
            if row.get("command") in ("bench", "generate"):  # a decoding run the tables would drop unsaid
                raise ConfigError(f"report: {f} line {n}: a {row['command']} row without output_throughput")
            continue
        for key in ("num_output_tokens", "total_seconds"):
            if key not in row:
                raise ConfigError(f"report: {f} line {n}: a run row without {key}")
        for key in NUMERIC:
            value = row.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"report: {f} line {n}: {key}={json.dumps(value)[:40]} is not a number")
        if not isinstance(row.get("config", {}), dict):
            raise ConfigError(f"report: {f} line {n}: config is not an object")
        for key in ("workload", "method"):  # table titles and row labels
            if key in row and not isinstance(row[key], str):
                raise ConfigError(f"report: {f} line {n}: {key}={json.dumps(row[key])[:40]} is not a name")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        elif not isinstance(value, list):
            out[name] = value
    return out


def run_label(row: dict[str, Any]) -> str:
    """A row's method: the bench's name for it, else (``specfit generate``) what decoded: ``ar`` when
    nothing drafted (the default selector is named even then), else the selector."""
    if row.get("method"):
        return str(row["method"])
    if row.get("drafter") in (None, "none"):
        return "ar"
    return str(row.get("selector") or "run")


def sweep_axes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Config keys whose value differs between runs of the same method (what a sweep varied)."""
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_method[run_label(r)].append(_flat(r.get("config", {})))
    axes: set[str] = set()
    for configs in by_method.values():
        keys = set().union(*configs)
        axes |= {k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1}
    return sorted(k for k in axes if k.split(".")[0] not in SWEEP_KEYS_IGNORED and k not in SWEEP_KEYS_IGNORED)


def group(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    axes = sweep_axes(rows)
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        flat = _flat(r.get("config", {}))
        label = run_label(r)
        key = (r.get("workload", "-"), label, *(json.dumps(flat.get(a)) for a in axes))
        groups[key].append(r)
    summary = []
    for (workload, label, *values), members in groups.items():
        suffix = ", ".join(f"{a.split('.')[-1]}={json.loads(v)}" for a, v in zip(axes, values))
        summary.append({**mean_stats(members), "workload": workload, "method": f"{label} ({suffix})" if suffix else label,
                        "runs": len(members), "_runs": members})  # _runs: for the paired ratios, not written
    return summary


def write_report(paths: Sequence[str | Path], out_dir: str | Path) -> Path:
    out = check_writable(out_dir, "--out", directory=True)
    every = read_all_rows(paths)
    rows = [r for r in every if "output_throughput" in r]
    scored = acceptance_rows(every)
    replays = [r for r in every if r.get("command") == "replay" and "predicted_tokens_per_second" in r]
    if not rows and not scored and not replays:
        raise ConfigError("report: the results hold no decoding runs (rows with output_throughput), "
                          "no replays and no acceptance scores")
    summary = group(rows) if rows else []
    out.mkdir(parents=True, exist_ok=True)
    counts = [f"{len(rows)} decoding runs"] + ([f"{len(replays)} replayed methods"] if replays else [])
    lines = ["# specfit report", "", f"{' and '.join(counts)} from {', '.join(map(str, paths))}.", ""]
    emulated = any(r.get("h2d_emulated") for r in rows)
    if emulated:
        lines += ["H2D times are **emulated** (`cache.copy=emulated`): each copy was charged the reference link's time.", ""]
    for workload in sorted({s["workload"] for s in summary}):
        part = [s for s in summary if s["workload"] == workload]
        base = _baseline(part)
        base_runs = next(s["_runs"] for s in part if s["method"] == base)
        part = [{**s, **paired_fields(s["_runs"], base_runs)} for s in part]
        lines += [f"## Workload {workload}", "", "```", comparison_table(part, baseline=base), "```", ""]
    if any(s.get("prefetch_issued") for s in summary):
        lines += ["Prefetch: `pf prec` = prefetched experts a pass then used / experts prefetched; `pf recall` = "
                  "prefetched experts used / (those + misses), the share of the copies the passes needed that "
                  "prefetch brought; `stall ms/tok` = time compute blocked on copies per output token.", ""]
    plots = _plots(summary, out) if summary else []
    lines += replay_sections(replays)
    if scored:
        lines += ["## Acceptance estimators", "",
                  "Forecasts a_v of the cost-aware selectors' acceptance estimators against the outcomes "
                  "each verification settled (lower is better).", "", "```", acceptance_table(scored), "```", ""]
        plots += _reliability_plot(scored, out)
    lines += [f"![{name}]({name})" for name in plots]
    return write_atomic(out / "report.md", "\n".join(lines) + "\n")


def replay_sections(replays: Sequence[dict[str, Any]]) -> list[str]:
    """One table per replayed trace and time basis, as `specfit replay` printed it."""
    from specfit.commands.replay import replay_table

    lines: list[str] = []
    parts: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in replays:
        time = f"cost profile {r['cost_profile']}" if r.get("cost_profile") else "the cost model"
        parts[(str(r.get("trace")), time, str(r.get("draft_time")))].append(
            {**r, "cache_desc": f"{r.get('cache')}:{r.get('cache_slots_per_layer')}"})
    for (trace, time, draft_time), members in parts.items():
        lines += [f"## Replay of {trace}", "", f"Time predicted by {time} from the trace (drafting time: {draft_time}), "
                  "not a measured decode.", "",
                  "```", replay_table(members), "```", ""]
    return lines


def _baseline(rows: Sequence[dict[str, Any]]) -> str:
    names = [r["method"] for r in rows]
    return next((n for n in names if n == "ar" or n.startswith("ar (")), names[0])


def _plots(summary: Sequence[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []  # plots need the `plots` extra (matplotlib); the Markdown tables stand alone
    workloads = sorted({s["workload"] for s in summary})
    methods = list(dict.fromkeys(s["method"] for s in summary))
    names = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * len(workloads)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [next((s["output_throughput"] for s in summary if s["workload"] == w and s["method"] == method), 0) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=method)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput per method and workload")
    ax.legend(fontsize=7)
    names.append(_save(fig, out, "throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summary:  # one point per run
        ax.scatter(s.get("verified_nodes_per_cycle", 0), s.get("spec_decode_acceptance_length", 0), color="tab:blue")
    for (x, y), names_here in _coinciding(summary, "verified_nodes_per_cycle", "spec_decode_acceptance_length"):
        ax.annotate("\n".join(names_here), (x, y), xytext=(6, 0), textcoords="offset points", fontsize=6,
                    va="center")  # points that coincide share one label, one name a line
    ax.margins(x=0.25, y=0.15)
    ax.set_xlabel("verified nodes per cycle")
    ax.set_ylabel("acceptance length (tokens per cycle)")
    ax.set_title("Acceptance length against verified nodes")
    names.append(_save(fig, out, "acceptance.png"))

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(summary)), 4))
    parts = [("draft_seconds", "drafting"), ("select_seconds", "selection"), ("compute", "verify compute"),
             ("stall", "waiting on copies (H2D stall)")]
    labels = [f"{s['method']}\n{s['workload']}" for s in summary]
    bottom = [0.0] * len(summary)
    split = [dict(s, **dict(zip(("compute", "stall"), verify_split(s)))) for s in summary]
    for key, label in parts:
        values = [1e3 * s.get(key, 0.0) / max(s.get("num_output_tokens", 1), 1) for s in split]
        ax.bar(range(len(summary)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(summary)), labels, fontsize=6)
    ax.set_ylabel("ms per generated token")
    ax.set_title("Cycle time breakdown")
    ax.legend(fontsize=7)
    names.append(_save(fig, out, "breakdown.png"))
    return names


def verify_split(row: dict[str, Any]) -> tuple[float, float]:
    """(compute, stall) seconds of a run's verification passes.

    Where the copies are asynchronous and their wait is measured on the host (the emulated link, a
    CUDA engine with a measuring timing: rows with ``h2d_stall_seconds`` and ``verify_seconds``),
    the stall is that measured wait and compute the rest, so transfers hidden behind drafting or
    compute count nowhere. Otherwise (a CPU engine, or results from before issue 14) every H2D
    second is taken as waited, as before."""
    measured = row.get("h2d_stall_measured", row.get("h2d_emulated"))
    if measured and "h2d_stall_seconds" in row and "verify_seconds" in row:
        stall = float(row["h2d_stall_seconds"])
        return max(float(row["verify_seconds"]) - stall, 0.0), stall
    return float(row.get("verify_compute_seconds", 0.0)), float(row.get("h2d_seconds", 0.0))


def _reliability_plot(rows: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Mean forecast against observed frequency per bin, one line per estimator; the diagonal is
    a perfectly calibrated estimator."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="calibrated")
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "D", "v", "x"]
    for i, r in enumerate(rows):  # the first drawn widest: a line that coincides with a later one shows around it
        bins = r["acceptance_reliability"]
        ax.plot([b[0] for b in bins], [b[1] for b in bins], marker=markers[i % len(markers)], markersize=4,
                linestyle=styles[i % len(styles)], linewidth=max(4.0 - 0.6 * i, 1.0), alpha=0.85, label=r["label"])
    ax.set_xlabel("forecast a_v (bin mean)")
    ax.set_ylabel("observed acceptance frequency")
    ax.set_title("Reliability of acceptance estimates")
    ax.legend(fontsize=6)
    return [_save(fig, out, "reliability.png")]


def _coinciding(summary: Sequence[dict[str, Any]], x_key: str, y_key: str) -> list[tuple[tuple[float, float], list[str]]]:
    """The (x, y) points of ``summary`` with the names of the rows at each, points within 2% of the
    axes' spans taken as one (their labels would overlap)."""
    points = [(float(s.get(x_key, 0) or 0), float(s.get(y_key, 0) or 0), f"{s['method']} / {s['workload']}")
              for s in summary]
    xs, ys = [p[0] for p in points] or [0.0], [p[1] for p in points] or [0.0]
    dx, dy = 0.02 * ((max(xs) - min(xs)) or 1.0), 0.02 * ((max(ys) - min(ys)) or 1.0)
    groups: list[tuple[tuple[float, float], list[str]]] = []
    for x, y, name in points:
        for (gx, gy), names in groups:
            if abs(gx - x) <= dx and abs(gy - y) <= dy:
                names.append(name)
                break
        else:
            groups.append(((x, y), [name]))
    return groups


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name
