"""Per-cycle records and the run summary (keys follow vLLM / Spec-Bench where they exist)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from specfit.types.tree import DraftTree, VerifyBlock


def prediction_overlap(tree: DraftTree, block: VerifyBlock, routing: np.ndarray) -> tuple[int, int, int] | None:
    """(correct, predicted, routed) expert counts over the verified tokens and all layers."""
    if tree.root_experts is None and tree.experts is None:
        return None
    layers, k = routing.shape[1:]
    predicted = np.full((len(block), layers, k), -1, dtype=np.int64)
    if tree.root_experts is not None:
        predicted[0] = tree.root_experts[:, :k]
    if tree.experts is not None and block.nodes:
        rows = np.asarray(block.nodes)
        rows = rows[rows < tree.experts.shape[0]]
        predicted[1 : 1 + len(rows)] = tree.experts[rows][:, :, :k]
    known = (predicted >= 0).any(axis=(1, 2))  # tokens the predictor said something about
    hit = (predicted[..., :, None] == routing[..., None, :]).any(-1) & (predicted >= 0)
    return int(hit[known].sum()), int((predicted[known] >= 0).sum()), int(known.sum() * layers * k)


@dataclass
class CycleRecord:
    """One draft-select-verify cycle (an autoregressive step is a cycle with an empty tree)."""

    drafted: int  # nodes in the draft tree
    levels: int  # draft levels grown
    verified: int  # draft nodes verified (root excluded)
    accepted: int  # draft nodes accepted
    committed: int  # tokens committed (accepted + bonus), after truncation at stop / max tokens
    draft_seconds: float
    select_seconds: float
    verify_seconds: float  # wall time of the verification pass, H2D included
    h2d_seconds: float
    total_seconds: float
    misses: int
    hits: int
    union: list[int]  # experts per MoE layer in the verification pass
    predicted: dict[str, float] = field(default_factory=dict)  # the selector's predictions, if any
    # predicted vs routed experts of the verified tokens: (correct, predicted, routed), if predicted
    prediction: tuple[int, int, int] | None = None
    h2d_stall_seconds: float = 0.0  # time the verification pass blocked on copies (calibration's overlap)
    # the copies overlapped other work (prefetch on a link whose waits the host measures): the pass's
    # time holds h2d_stall_seconds of copying, not h2d_seconds (see specfit.calibrate.run)
    copies_overlap: bool = False
    # h2d_stall_seconds is what the pass waited, measured by the host (an emulated link's waits): the
    # pass's time holds it, not h2d_seconds, even without prefetch (pipelined rounds hide copies too)
    stall_measured: bool = False


# prefetch_<name> keys of a run's results the runtime and the results fill in: a prefetcher's own
# counters() may not use these names
RUNTIME_PREFETCH_COUNTS = ("issued", "used", "wasted", "precision", "recall")


def visible_copy_seconds(record: CycleRecord, overlap: bool = False) -> float:
    """The copy seconds a cycle's misses are charged for (c_copy): its H2D seconds, or, when its
    copies were pipelined by prefetch (``overlap``, or the record says so), the time compute
    blocked on them, where it was measured."""
    stall = getattr(record, "h2d_stall_seconds", None)
    pipelined_copies = overlap or getattr(record, "copies_overlap", False)
    return float(stall) if pipelined_copies and stall is not None else record.h2d_seconds


def waited_copy_seconds(record: CycleRecord, overlap: bool = False) -> float:
    """The copy seconds a cycle's time contains: what its passes waited where the host measured it
    (an emulated link; pipelined rounds hide copies behind compute even without prefetch), else
    :func:`visible_copy_seconds`. The compute fit subtracts this, so hidden copies are not taken
    for faster compute (the replay models the rounds' overlap itself)."""
    stall = getattr(record, "h2d_stall_seconds", None)
    if getattr(record, "stall_measured", False) and stall is not None:
        return float(stall)
    return visible_copy_seconds(record, overlap)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    cycles: list[CycleRecord] = field(default_factory=list)
    cache: CacheStats | None = None  # decode phase only (prefill excluded)
    prefill_cache: CacheStats | None = None  # the prefill pass's copies and stall (part of ttft)
    info: dict[str, Any] = field(default_factory=dict)  # engine description (cache, copy engine, ...)
    finish_reason: str = "length"  # "stop" (a stop token) | "length" (max_new_tokens or the context limit)
    prefetch_counters: dict[str, int] = field(default_factory=dict)  # the prefetcher's counts, this run's growth

    def summary(self) -> dict[str, Any]:
        """:func:`cycle_summary` of the cycles, with the cache's own counts (decode phase) and the
        measured times."""
        cycles = self.cycles
        decode_seconds = self.total_seconds - self.prefill_seconds
        cache = self.cache
        union = cache.union_per_layer() if cache is not None else np.zeros(0)
        return {
            "num_prompt_tokens": self.prompt_tokens,
            "num_output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "total_seconds": self.total_seconds,
            "ttft_ms": 1e3 * self.prefill_seconds,
            "output_throughput": self.output_tokens / self.total_seconds if self.total_seconds > 0 else 0.0,
            "decode_throughput": (self.output_tokens - 1) / decode_seconds if decode_seconds > 0 else 0.0,
            "mean_tpot_ms": 1e3 * decode_seconds / max(self.output_tokens - 1, 1),
            **cycle_summary(cycles),
            # the cache's counts equal the cycles' sums (one pass per cycle); a run without cycles
            # still reports its layers
            "expert_cache_hits": cache.hits if cache else 0,
            "expert_cache_misses": cache.misses if cache else 0,
            "expert_cache_hit_rate": cache.hits / max(cache.hits + cache.misses, 1) if cache else 0.0,
            "h2d_bytes": cache.h2d_bytes if cache else 0,
            "h2d_seconds": cache.h2d_seconds if cache else 0.0,
            # the pipelined runtime: time compute waited on copies, the link's transfer time, prefetches
            "h2d_stall_seconds": cache.h2d_stall_seconds if cache else 0.0,
            "link_busy_seconds": cache.link_busy_seconds if cache else 0.0,
            # the prefill's own (not in the counts above): with them, the stall of the whole run
            "prefill_h2d_seconds": self.prefill_cache.h2d_seconds if self.prefill_cache else 0.0,
            "prefill_h2d_stall_seconds": self.prefill_cache.h2d_stall_seconds if self.prefill_cache else 0.0,
            "prefetch_issued": cache.prefetch_issued if cache else 0,
            "prefetch_used": cache.prefetch_used if cache else 0,
            "prefetch_wasted": cache.prefetch_wasted if cache else 0,
            **{f"prefetch_{name}": count for name, count in self.prefetch_counters.items()},
            "experts_per_layer_union": float(union.mean()) if union.size else 0.0,
            "experts_per_layer_union_by_layer": [round(float(u), 3) for u in union],
            "draft_seconds": sum(c.draft_seconds for c in cycles),
            "select_seconds": sum(c.select_seconds for c in cycles),
            # the passes' time less what they waited on copies (the measured stall where the host
            # measures its waits or copies overlap compute, otherwise every copy's time): as calibrated
            "verify_compute_seconds": sum(c.verify_seconds - waited_copy_seconds(c) for c in cycles),
            "verify_seconds": sum(c.verify_seconds for c in cycles),  # stall included (the report splits it)
            **_prediction_summary(cycles),
            **self.info,
        }


def cycle_summary(cycles: Sequence[CycleRecord]) -> dict[str, Any]:
    """The per-cycle keys of a live run and of a trace replay, with one meaning each (vLLM's and
    Spec-Bench's names where they exist).

    ``spec_decode_acceptance_length``: tokens committed per verification cycle, the bonus token
    included (vLLM's meaning; 1.0 for autoregressive decoding); ``tokens_per_cycle`` is the same
    number under the replay table's name."""
    n = max(len(cycles), 1)
    committed = sum(c.committed for c in cycles)
    hits, misses = sum(c.hits for c in cycles), sum(c.misses for c in cycles)
    union = np.mean([c.union for c in cycles], axis=0) if cycles else np.zeros(0)
    return {
        "cycles": len(cycles),
        "decode_tokens": committed,
        "spec_decode_acceptance_length": committed / n,
        "tokens_per_cycle": committed / n,
        "num_drafts": sum(1 for c in cycles if c.drafted),
        "draft_tokens": sum(c.drafted for c in cycles),
        "draft_tokens_per_cycle": sum(c.drafted for c in cycles) / n,
        "draft_levels_per_cycle": sum(c.levels for c in cycles) / n,
        "verified_nodes": sum(c.verified for c in cycles),
        "verified_nodes_per_cycle": sum(c.verified for c in cycles) / n,
        "accepted_tokens": sum(c.accepted for c in cycles),
        "expert_cache_hits": hits,
        "expert_cache_misses": misses,
        "expert_cache_hit_rate": hits / max(hits + misses, 1),
        "experts_per_layer_union": float(union.mean()) if union.size else 0.0,
        "experts_per_layer_union_by_layer": [round(float(u), 3) for u in union],
        **_prediction_summary(cycles),
    }


def _prediction_summary(cycles: Sequence[CycleRecord]) -> dict[str, Any]:
    scored = [c.prediction for c in cycles if c.prediction is not None]
    if not scored:
        return {}
    correct, predicted, routed = (sum(x[i] for x in scored) for i in range(3))
    return {
        "predictor_precision": correct / predicted if predicted else 0.0,
        "predictor_recall": correct / routed if routed else 0.0,
    }


@dataclass
class CacheStats:
    """Counters of the expert cache; ``hits + misses`` = distinct experts requested per layer per pass."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    copy_calls: int = 0
    passes: int = 0
    union_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per layer, summed over passes
    preload_bytes: int = 0
    h2d_stall_seconds: float = 0.0  # time compute blocked waiting for copies
    link_busy_seconds: float = 0.0  # transfer time the link spent (the charges on an emulated link)
    prefetch_issued: int = 0  # experts copied by prefetch
    prefetch_used: int = 0  # prefetched experts a pass then computed with before eviction
    prefetch_wasted: int = 0  # prefetched experts evicted before any pass used them
    issue_seconds: float = 0.0  # host time in the copy engine's issue calls (a CPU's memcpy; a GPU's launch)
    # copies timed on the device (CUDA) when a pass waited for them or the decode ended (settle_copies:
    # a prefetch evicted unused), and their seconds; until then h2d_seconds holds their enqueue time
    timed_copies: int = 0
    timed_copy_seconds: float = 0.0

    @property
    def timed_copy_mean(self) -> float:
        """Seconds one expert's copy took on the device, over the timed ones (0.0: none timed yet)."""
        return self.timed_copy_seconds / self.timed_copies if self.timed_copies else 0.0

    def copy(self) -> CacheStats:
        return dataclasses.replace(self, union_sum=self.union_sum.copy())

    def since(self, earlier: CacheStats) -> CacheStats:
        """Counters accumulated after ``earlier`` (a copy taken before); ``preload_bytes`` is the
        run's, not a counter."""
        return CacheStats(**{f.name: getattr(self, f.name) if f.name == "preload_bytes"
                             else getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)})

    def union_per_layer(self) -> np.ndarray:
        return self.union_sum / max(self.passes, 1)
