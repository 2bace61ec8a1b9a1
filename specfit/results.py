"""Results files (one JSON line per run) and the comparison table printed at the end of a job."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from specfit.files import append_jsonl_lines
from specfit.interfaces.configs import PLUGIN_BASES

PLUGIN_KINDS = tuple(PLUGIN_BASES)  # every plug-in kind, so no section is recorded unresolved


def append_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Append rows to a results file, durably and never leaving half a line (see :mod:`specfit.files`)."""
    return append_jsonl_lines(path, rows, default=_jsonable)


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """A run's config as results record it: interpolations resolved, and each plug-in's section as
    its Config builds it, so an alias (``drafter.num_speculative_tokens=5``) is recorded as given
    next to the value it set (``drafter.depth: 5``)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for kind in PLUGIN_KINDS:
        node = cfg.get(kind)
        if isinstance(node, DictConfig):
            built = OmegaConf.to_object(node)  # runs the Config's __post_init__: aliases resolved
            if dataclasses.is_dataclass(built):
                config[kind] = json.loads(json.dumps(dataclasses.asdict(built), default=_jsonable))
    return config


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def stats_line(stats: dict[str, Any]) -> str:
    """One line a person reads after a generation."""
    parts = [
        f"tokens={stats['num_output_tokens']}",
        f"tok/s={stats['output_throughput']:.2f}",
        f"acceptance_length={stats['spec_decode_acceptance_length']:.2f}",
        f"cycles={stats['cycles']}",
        f"verified/cycle={stats['verified_nodes_per_cycle']:.1f}",
        f"union/layer={stats['experts_per_layer_union']:.1f}",
        f"hits={stats['expert_cache_hits']}",
        f"misses={stats['expert_cache_misses']}",
        f"h2d={stats['h2d_bytes'] / 1e6:.1f}MB/{stats['h2d_seconds']:.3f}s",
    ]
    if stats.get("prefetch_issued") or stats.get("h2d_stall_seconds"):
        figures = prefetch_figures(stats)
        parts.append(f"stall={stats.get('h2d_stall_seconds', 0.0):.3f}s prefetch={stats.get('prefetch_issued', 0)}"
                     f"/used {stats.get('prefetch_used', 0)}/wasted {stats.get('prefetch_wasted', 0)}"
                     + (f" (precision {figures['prefetch_precision']:.2f}, recall {figures['prefetch_recall']:.2f})"
                        if "prefetch_precision" in figures else ""))
    if "expert_host_bytes" in stats:  # where the weights live (Engine.info)
        shared = " (shared)" if stats.get("expert_store_shared") else ""
        parts.append(f"memory=experts host {stats['expert_host_bytes'] / 1e6:.1f}MB{shared} + device "
                     f"{stats['expert_device_bytes'] / 1e6:.1f}MB, dense {stats['dense_device_bytes'] / 1e6:.1f}MB")
    if stats.get("h2d_emulated"):
        link = stats.get("copy_engine", {})
        parts.append(f"[H2D EMULATED: {link.get('bandwidth_gbps', '?')} GB/s, "
                     f"{link.get('ref_expert_bytes') or 'real'} B/expert]")
    return " ".join(parts)


COLUMNS = [
    ("method", "method", "{}"),
    ("tok/s", "output_throughput", "{:.2f}"),
    ("vs base", "speedup", "{:.2f}x"),
    ("paired [95% CI]", "paired_text", "{}"),
    ("vs eagle3_nc", "speedup_vs_eagle3_nocache", "{:.2f}x"),
    ("accept len", "spec_decode_acceptance_length", "{:.2f}"),
    ("verified/cyc", "verified_nodes_per_cycle", "{:.1f}"),
    ("union/layer", "experts_per_layer_union", "{:.2f}"),
    ("hit rate", "expert_cache_hit_rate", "{:.2f}"),
    ("H2D MB", "h2d_mb", "{:.1f}"),
    ("H2D s", "h2d_seconds", "{:.3f}"),
    ("stall ms/tok", "stall_ms_per_token", "{:.2f}"),
    ("pf prec", "prefetch_precision", "{:.2f}"),
    ("pf recall", "prefetch_recall", "{:.2f}"),
    ("recall", "predictor_recall", "{:.2f}"),
]


def prefetch_figures(stats: dict[str, Any]) -> dict[str, float]:
    """How well prefetch worked, from a run's (or summed runs') counts; empty where nothing was
    prefetched, and the stall only where the run measured it.

    - ``prefetch_precision`` = used / issued: the share of prefetched experts a pass then computed
      with before they were evicted;
    - ``prefetch_recall`` = used / (used + misses): of the expert copies the passes needed (an
      expert a pass used that was not already resident: prefetched in time, or missed and copied
      on demand; one prefetched but evicted before use is a miss), the share prefetch brought;
    - ``stall_ms_per_token``: the time compute blocked on copies, per output token;
    - ``stall_free_bound``: how much faster the run would be with every copy hidden at no host
      cost, total / (total - stall, prefill's included): the most any prefetcher can give it on
      this host and link, whose compute speed sets how much of the time is stall.
    """
    out: dict[str, float] = {}
    tokens = stats.get("num_output_tokens", 0)
    if "h2d_stall_seconds" in stats and tokens:
        out["stall_ms_per_token"] = 1e3 * stats["h2d_stall_seconds"] / tokens
        seconds = stats.get("total_seconds", 0.0)
        stall = stats["h2d_stall_seconds"] + stats.get("prefill_h2d_stall_seconds", 0.0)
        if seconds > stall > 0:
            out["stall_free_bound"] = seconds / (seconds - stall)
    issued, used = stats.get("prefetch_issued", 0), stats.get("prefetch_used", 0)
    if issued:
        out["prefetch_precision"] = used / issued
        needed = used + stats.get("expert_cache_misses", 0)
        out["prefetch_recall"] = used / needed if needed else 0.0
    return out


@dataclass(frozen=True)
class PairedRatio:
    """A method's speed over the baseline's, run by run: the geometric mean of the per-run ratios
    of tokens per second (runs paired by prompt and repeat, so each pair ran under the same load)
    and a 95% bootstrap interval over the pairs."""

    ratio: float
    low: float
    high: float
    pairs: int

    def text(self) -> str:
        return f"{self.ratio:.2f}x [{self.low:.2f}-{self.high:.2f}]"


def paired_ratio(runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]],
                 resamples: int = 2000, seed: int = 0) -> PairedRatio | None:
    """:class:`PairedRatio` of ``runs`` over ``base_runs``: paired by workload, prompt and repeat
    where the rows say them (results files), else in order when both have as many runs (a bench's
    runs of one job); None without a usable pair. On a shared machine the same method's speed
    moves by 10% or more from one prompt to the next, and a ratio of totals hides how much of a
    difference that noise could make; the interval says whether a run resolved it (fixed seed:
    reproducible)."""
    logs = [math.log(_speed(r) / _speed(b)) for r, b in _pairs(runs, base_runs) if _speed(r) > 0 and _speed(b) > 0]
    if not logs:
        return None
    values = np.asarray(logs)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return PairedRatio(math.exp(values.mean()), math.exp(low), math.exp(high), len(values))


def paired_fields(runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A summary's paired speed-up over the baseline: ``speedup_paired``, ``speedup_ci95_low``,
    ``speedup_ci95_high`` and ``paired_runs`` (nothing without a pair)."""
    paired = paired_ratio(runs, base_runs)
    if paired is None:
        return {}
    return {"speedup_paired": paired.ratio, "speedup_ci95_low": paired.low, "speedup_ci95_high": paired.high,
            "paired_runs": paired.pairs}


_PAIR_KEYS = ("workload", "prompt_index", "repeat")


def _pairs(runs: Sequence[dict[str, Any]], base_runs: Sequence[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """A key seen again (a report over several bench jobs) pairs its n-th run with the baseline's
    n-th, in file order, so each job's runs pair with that job's, not all with the last job's."""
    if all(k in r for r in (*runs, *base_runs) for k in _PAIR_KEYS[1:]):
        base = dict(_keyed(base_runs))
        return [(r, base[key]) for key, r in _keyed(runs) if key in base]
    return list(zip(runs, base_runs)) if len(runs) == len(base_runs) else []  # else the order pairs nothing


def _keyed(runs: Sequence[dict[str, Any]]) -> list[tuple[tuple, dict[str, Any]]]:
    """(workload, prompt, repeat, occurrence of that triple so far) per run."""
    seen: dict[tuple, int] = {}
    out = []
    for r in runs:
        key = tuple(r.get(k) for k in _PAIR_KEYS)
        seen[key] = seen.get(key, -1) + 1
        out.append(((*key, seen[key]), r))
    return out


def _speed(run: dict[str, Any]) -> float:
    seconds = run.get("total_seconds", 0.0)
    return run.get("num_output_tokens", 0) / seconds if seconds else 0.0


def comparison_table(rows: Sequence[dict[str, Any]], baseline: str | None = None) -> str:
    """A fixed-width table of per-method means; speedups are relative to ``baseline`` (default: the
    first row) and to vanilla EAGLE-3 without a cache when it was run."""
    if not rows:
        return "(no results)"
    base = next((r for r in rows if r["method"] == baseline), rows[0])
    vanilla = next((r for r in rows if r["method"] == "eagle3_nocache"), None)
    table = []
    for r in rows:
        r = dict(r, h2d_mb=r.get("h2d_bytes", 0) / 1e6, **prefetch_figures(r))
        r["speedup"] = r["output_throughput"] / base["output_throughput"] if base["output_throughput"] else 0.0
        if "speedup_paired" in r:
            r["paired_text"] = PairedRatio(r["speedup_paired"], r["speedup_ci95_low"], r["speedup_ci95_high"], 0).text()
        if vanilla is not None and vanilla["output_throughput"]:
            r["speedup_vs_eagle3_nocache"] = r["output_throughput"] / vanilla["output_throughput"]
        table.append([fmt.format(r[key]) if key in r else "-" for _, key, fmt in COLUMNS])
    header = [name for name, _, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(lines)


PER_CYCLE = ("spec_decode_acceptance_length", "experts_per_layer_union", "predictor_recall", "predictor_precision")


def mean_stats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs as one: throughput over all tokens and seconds, per-cycle figures weighted by
    cycles, counts and seconds summed (a prefetcher's counts too: integer ``prefetch_*`` keys),
    anything else a plain mean."""
    out: dict[str, Any] = {}
    cycles = [max(r.get("cycles", 1), 1) for r in runs]
    for key, value in runs[0].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = value
        elif key in PER_CYCLE or key.endswith("_per_cycle"):
            out[key] = sum(r.get(key, 0) * c for r, c in zip(runs, cycles)) / sum(cycles)
        else:
            out[key] = sum(r.get(key, 0) for r in runs) / len(runs)
    tokens = sum(r["num_output_tokens"] for r in runs)
    seconds = sum(r["total_seconds"] for r in runs)
    out["output_throughput"] = tokens / seconds if seconds else 0.0
    totals = ("expert_cache_hits", "expert_cache_misses", "h2d_bytes", "h2d_seconds", "num_output_tokens", "total_seconds",
              "draft_seconds", "select_seconds", "verify_compute_seconds", "cycles", "draft_tokens", "verified_nodes",
              "accepted_tokens", "h2d_stall_seconds", "prefill_h2d_stall_seconds", "link_busy_seconds", "prefetch_issued",
              "prefetch_used", "prefetch_wasted", "verify_seconds")
    counters = {key for r in runs for key, value in r.items() if key.startswith("prefetch_") and type(value) is int}
    totals += tuple(sorted(counters - set(totals)))
    for key in totals:
        if key in out or key in counters:
            out[key] = sum(r.get(key, 0) for r in runs)
    hits, misses = out.get("expert_cache_hits", 0), out.get("expert_cache_misses", 0)
    out["expert_cache_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    out.update(prefetch_figures(out))
    return out


def spec_bench_answers(rows: Sequence[dict[str, Any]], tokenizers: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Bench rows as Spec-Bench answer lines, per method: one line per prompt (``question_id``
    ``WORKLOAD-INDEX``, ``category`` the workload), one choice per repeat.

    A choice has Spec-Bench's fields, one entry per turn (a prompt is one turn here): ``turns``
    (the output text; token ids when the model has no tokenizer), ``decoding_steps`` (cycles),
    ``new_tokens``, ``wall_time`` (seconds) and ``accept_lengths`` (tokens committed per cycle),
    so Spec-Bench's ``evaluation/speed.py`` reads the files as they are.
    """
    by_prompt: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        by_prompt.setdefault((row["method"], row["workload"], row["prompt_index"]), []).append(row)
    answers: dict[str, list[dict[str, Any]]] = {}
    for (method, workload, index), runs in by_prompt.items():
        tokenizer = tokenizers.get(method)
        choices = []
        for row in sorted(runs, key=lambda r: r["repeat"]):
            ids = row.get("output_ids", [])
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, ids))
            choices.append({"index": row["repeat"], "turns": [text], "decoding_steps": [row["cycles"]],
                            "new_tokens": [row["num_output_tokens"]], "wall_time": [row["total_seconds"]],
                            "accept_lengths": list(row.get("accept_lengths", []))})
        answers.setdefault(method, []).append({"question_id": f"{workload}-{index}", "category": workload,
                                               "answer_id": f"{method}-{workload}-{index}", "model_id": method,
                                               "choices": choices})
    return answers
