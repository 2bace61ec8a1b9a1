"""GET /metrics: Prometheus text with vLLM's metric names under the ``specfit:`` prefix.

vLLM's: ``spec_decode_num_drafts_total``, ``spec_decode_num_draft_tokens_total``,
``spec_decode_num_accepted_tokens_total``, ``spec_decode_num_accepted_tokens_per_pos_total{position}``,
``num_requests_running``, ``num_requests_waiting``, ``prompt_tokens_total``,
``generation_tokens_total``, ``request_success_total{finished_reason}``,
``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``.
specfit's own: the expert cache's ``expert_cache_hits_total``, ``expert_cache_misses_total``,
``h2d_bytes_total``, ``h2d_stall_seconds_total`` (decode phase, as a run's stats count them) and the
selector's ``spec_decode_verified_nodes_per_cycle`` (a histogram: its sum is the verified nodes).

The spec-decode counters have the meaning of a run's stats (specfit.types.stats.cycle_summary):
a draft is a cycle that drafted a tree, draft tokens are the tree's nodes, accepted tokens the
accepted nodes; position ``i`` counts the cycles whose accepted path reached depth ``i + 1``.
Each server has its own registry (several may run in one process, as the tests do).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specfit:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
            40.0, 80.0)
_E2E = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_NODES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
FINISHED_REASONS = ("stop", "length", "abort", "deadline", "error")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Cycles that drafted a tree.").labels(**labels)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft-tree nodes drafted.").labels(**labels)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.").labels(**labels)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Cycles whose accepted path reached this draft position (0: depth 1).",
                                        ("position",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        self.request_success = counter("request_success", "Requests ended, by how.", ("finished_reason",))
        for reason in FINISHED_REASONS:
            self.request_success.labels(**labels, finished_reason=reason)
        self.cache_hits = counter("expert_cache_hits", "Expert cache hits (decode phase).").labels(**labels)
        self.cache_misses = counter("expert_cache_misses", "Expert cache misses (decode phase).").labels(**labels)
        self.h2d_bytes = counter("h2d_bytes", "Expert bytes copied host to device (decode phase).").labels(**labels)
        self.h2d_stall = counter("h2d_stall_seconds", "Seconds compute waited on expert copies (decode phase).",
                                 ).labels(**labels)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests decoding (0 or 1: batch size 1).",
                             list(labels), registry=r).labels(**labels)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued behind the running one.",
                             list(labels), registry=r).labels(**labels)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first token (queue included).",
                              list(labels), buckets=_LATENCY, registry=r).labels(**labels)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between a request's committed cycles (each commits one or more tokens).",
                             list(labels), buckets=_LATENCY, registry=r).labels(**labels)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.",
                             list(labels), buckets=_E2E, registry=r).labels(**labels)
        self.verified = Histogram(PREFIX + "spec_decode_verified_nodes_per_cycle",
                                  "Draft nodes the selector had verified per cycle.", list(labels),
                                  buckets=_NODES, registry=r).labels(**labels)

    def cycle(self, record: Any) -> None:
        """One committed cycle's record (specfit.types.stats.CycleRecord)."""
        if record.drafted:
            self.num_drafts.inc()
        self.num_draft_tokens.inc(record.drafted)
        self.num_accepted_tokens.inc(record.accepted)
        for position in range(record.accepted):
            self.accepted_per_pos.labels(**self._labels, position=str(position)).inc()
        self.verified.observe(record.verified)

    def cache(self, before: Any, after: Any) -> None:
        """The expert cache's counts between two snapshots (specfit.types.stats.CacheStats)."""
        self.cache_hits.inc(max(after.hits - before.hits, 0))
        self.cache_misses.inc(max(after.misses - before.misses, 0))
        self.h2d_bytes.inc(max(after.h2d_bytes - before.h2d_bytes, 0))
        self.h2d_stall.inc(max(after.h2d_stall_seconds - before.h2d_stall_seconds, 0.0))

    def finished(self, reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=reason).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
