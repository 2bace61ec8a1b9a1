"""Prefetch sinks: the one way a prefetcher issues expert copies, checked before anything moves.

A prefetcher (:class:`specfit.interfaces.Prefetcher`) never touches the runtime: it calls
``sink.prefetch(layer, experts)``. The sink checks the request (a layer or expert id out of range,
or a value that is not an int, is one PluginError naming the prefetcher and the hook it ran in),
copies no expert already resident or in flight (those asked for are protected instead: the
cache may not evict them for this request's copies), and forwards the rest:

- :class:`LiveSink` to :meth:`specfit.offload.runtime.OffloadRuntime.prefetch` (the cache policy
  admits through ``admit_prefetch``; the runtime checks the admission and never evicts a
  protected expert);
- :class:`ModelledSink` to a modelled FIFO link in a trace replay: the real cache policy admits
  the prefetch on the replay's slot map, each copy lands ``expert_seconds`` after the link frees,
  and a verification layer that computes with an expert still in flight is charged the wait.

Both also tell a prefetcher what it needs to bound its prefetches: the link time of one expert,
the compute time of one MoE layer of a pass, and when the link will be free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from specfit.messages import note_once
from specfit.interfaces import guard
from specfit.offload.admission import prefetch_loads
from specfit.errors import PluginError, SpecfitError
from specfit.types.stats import RUNTIME_PREFETCH_COUNTS

KIND = "prefetch"  # the plug-in kind, as errors name it: "prefetch 'draft' (after_level): ..."


def check_request(prefetcher: Any, hook: str, layer: Any, experts: Any, layers: int, num_experts: int) -> tuple[int, list[int]]:
    """``(layer, experts)`` as ints in range, duplicates dropped in order; else a PluginError naming
    the prefetcher and ``hook``."""
    if type(layer) is int and type(experts) is list and 0 <= layer < layers \
            and all(type(e) is int and 0 <= e < num_experts for e in experts):
        return layer, list(dict.fromkeys(experts))  # plain ints in range (a built-in's request): no more to check

    def bad(message: str) -> PluginError:
        return guard.violation(KIND, prefetcher, hook, message)

    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layers:
        raise bad(f"prefetch layer {layer!r:.40} is out of range (0..{layers - 1})")
    if isinstance(experts, (str, bytes)):
        raise bad(f"experts must be a sequence of expert ids, got {experts!r:.40}")
    try:
        ids = list(np.asarray(experts).reshape(-1).tolist()) if isinstance(experts, np.ndarray) else list(experts)
    except TypeError:
        raise bad(f"experts must be a sequence of expert ids, got {type(experts).__name__}") from None
    for e in ids:
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)) or not 0 <= e < num_experts:
            raise bad(f"layer {int(layer)}: expert {e!r:.40} is out of range (0..{num_experts - 1})")
    return int(layer), list(dict.fromkeys(int(e) for e in ids))


@dataclass
class PrefetchCounts:
    """What a sink forwarded: requests, experts asked for, experts actually issued."""

    requests: int = 0
    asked: int = 0
    issued: int = 0


class CheckedSink:
    """Checks and forwards one prefetcher's requests (a :class:`specfit.interfaces.PrefetchSink`);
    subclasses say where they go.

    ``hook`` is the prefetcher hook running now (errors name it); :meth:`run` calls a hook with it
    set, turning an exception into one PluginError.
    """

    live: bool = True

    def __init__(self, prefetcher: Any, spec: Any) -> None:
        self.prefetcher, self.spec = prefetcher, spec
        self.hook = "bind"
        self.counts = PrefetchCounts()
        self.notes: list[str] = []

    # ------------------------------------------------------------------ for prefetchers

    def prefetch(self, layer: int, experts: Sequence[int], keep: Sequence[int] = ()) -> int:
        """Ask for ``experts`` of ``layer`` (most wanted first); returns how many copies were issued.

        ``keep``: experts worth keeping but not worth a copy (the next likeliest): those resident are
        protected from this request's evictions like the resident ones of ``experts``, so the cache
        evicts experts the prefetcher ranks lower instead; the others are ignored."""
        layer, ids = check_request(self.prefetcher, self.hook, layer, experts, self.spec.num_layers,
                                   self.spec.num_experts)
        self.counts.requests += 1
        self.counts.asked += len(ids)
        if not ids:
            return 0
        if len(keep):
            _, kept = check_request(self.prefetcher, self.hook, layer, keep, self.spec.num_layers, self.spec.num_experts)
            held = self._held(layer)
            ids += [e for e in kept if e in held and e not in ids]
        issued = int(self._issue(layer, ids))
        self.counts.issued += issued
        return issued

    def arriving(self) -> np.ndarray | None:
        """float [layers, experts]: seconds until each expert is usable (0 resident, inf absent); None: unknown."""
        return None

    def expert_seconds(self) -> float:
        """Link seconds of one expert copy (0.0: unknown)."""
        return 0.0

    def prefetches_used(self) -> int:
        """Prefetched experts that a pass computed with, so far (every prefetcher's of this run)."""
        return 0

    def saved_per_use(self) -> float:
        """At most the seconds a used prefetch takes off the passes' critical path (0.0: unknown)."""
        return self.expert_seconds()

    def capacity(self) -> int:
        """Device slots per layer (a prefetch beyond them evicts what it just copied)."""
        return self.spec.num_experts

    def layer_seconds(self, tokens: int) -> float:
        """Compute seconds of one MoE layer in a pass of ``tokens`` tokens (0.0: unknown)."""
        return 0.0

    def link_free_in(self) -> float:
        """Seconds until the link has delivered everything queued (0.0 idle or unknown)."""
        arriving = self.arriving()
        if arriving is None:
            return 0.0
        finite = arriving[np.isfinite(arriving)]
        return float(finite.max()) if finite.size else 0.0

    def now(self) -> float:
        """The sink's clock (live: wall time; replay: the modelled time of the cycle)."""
        return time.perf_counter()

    def note(self, message: str) -> None:
        """A one-time remark for the run's output (e.g. a part that cannot be replayed)."""
        if message not in self.notes:
            self.notes.append(message)

    # ------------------------------------------------------------------ for the core

    def run(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as the prefetcher's ``hook``: its requests and its errors name that hook."""
        previous, self.hook = self.hook, hook
        try:
            return fn(*args)
        except SpecfitError:
            raise
        except Exception as exc:
            raise guard.failure(KIND, self.prefetcher, hook, exc) from exc
        finally:
            self.hook = previous

    def call(self, hook: str, *args: Any) -> Any:
        """The prefetcher's own ``hook`` method, through :meth:`run`."""
        return self.run(hook, getattr(self.prefetcher, hook), *args)

    def counters(self) -> dict[str, int]:
        """The prefetcher's ``counters()``, checked: names to integers, none of the runtime's own."""
        counts = self.call("counters")
        if not isinstance(counts, dict) or not all(isinstance(k, str) and type(v) is int for k, v in counts.items()):
            raise guard.violation(KIND, self.prefetcher, "counters", f"must return a dict of names to ints, got {counts!r:.60}")
        taken = sorted(set(counts) & set(RUNTIME_PREFETCH_COUNTS))
        if taken:
            raise guard.violation(KIND, self.prefetcher, "counters",
                                  f"names {taken} would replace the runtime's own prefetch_* figures")
        return counts

    def at(self, seconds: float) -> None:
        """The cycle's clock reads ``seconds`` since it started (a replay's modelled time)."""

    def observe(self, verify_seconds: float, h2d_seconds: float, tokens: int) -> None:
        """A measured verification pass (live runs), to learn the compute time of a layer."""

    def _issue(self, layer: int, experts: list[int]) -> int:
        raise NotImplementedError

    def _held(self, layer: int) -> set[int]:
        """Experts of ``layer`` in a slot (resident or on their way)."""
        raise NotImplementedError


class LiveSink(CheckedSink):
    """Forwards to the offload runtime: real (or emulated-link) copies issued ahead of need."""

    live = True

    def __init__(self, prefetcher: Any, runtime: Any, cost_model: Any = None) -> None:
        super().__init__(prefetcher, runtime.spec)
        self.runtime, self.cost_model = runtime, cost_model
        self._layer_ema = 0.0  # measured compute seconds per MoE layer and token of a pass

    def _issue(self, layer: int, experts: list[int]) -> int:
        held = self.runtime.slot_expert[layer].tolist()
        if all(e in held for e in experts):  # all resident or in flight (most look-ahead requests): nothing to ask
            return 0
        return self.runtime.prefetch(layer, experts)  # the runtime skips those held, and keeps them

    def _held(self, layer: int) -> set[int]:
        return set(self.runtime.slot_expert[layer].tolist())

    def arriving(self) -> np.ndarray | None:
        return self.runtime.arriving()

    def capacity(self) -> int:
        return int(self.runtime.slots_per_layer)

    def note(self, message: str) -> None:
        """Kept, and printed once on stderr: a live run has no notes section of its own."""
        super().note(message)
        note_once(message)

    def prefetches_used(self) -> int:
        return self.runtime.stats.prefetch_used

    def saved_per_use(self) -> float:
        """The host time of one copy's issue (a CPU's memcpy, a GPU's launch), which the demand path
        would have spent, and where copies travel while compute goes on (the emulated link, a GPU's
        copy stream) one copy's link time, which a demand copy would have waited. A synchronous
        link (``cache.copy=torch`` on a CPU) hides nothing: only the issue moves."""
        copied = self._copied()
        issue = self.runtime.stats.issue_seconds / copied if copied else 0.0
        if not (self.runtime.copy_engine.emulated or self.runtime.device.type == "cuda"):
            return issue  # a synchronous link
        link = self.expert_seconds()
        return link + issue if link > 0 else 0.0  # the link time unknown yet: so is the saving

    def expert_seconds(self) -> float:
        charge = getattr(self.runtime.copy_engine, "charge_seconds", None)  # the emulated link's own member
        if charge is not None:
            return float(charge(1, self.spec.expert_bytes))
        stats = self.runtime.stats  # a real link: what its copies (demand and prefetch) took so far
        if stats.timed_copies:  # timed on the device (CUDA) once waited, or settled when a decode ends
            return stats.timed_copy_mean
        copied = self._copied()
        return stats.h2d_seconds / copied if copied else 0.0

    def _copied(self) -> float:
        """Experts copied so far (demand and prefetch), from the bytes moved."""
        expert_bytes = self.spec.expert_bytes
        return self.runtime.stats.h2d_bytes / expert_bytes if expert_bytes else 0.0

    def layer_seconds(self, tokens: int) -> float:
        constants = _constants(self.cost_model)
        if constants is not None:
            return max(constants.c0 + constants.c_tok * tokens, 0.0) / max(self.spec.num_layers, 1)
        return self._layer_ema * tokens

    def observe(self, verify_seconds: float, h2d_seconds: float, tokens: int) -> None:
        """A finished verification pass: learn the compute time per layer and token."""
        compute = max(verify_seconds - h2d_seconds, 0.1 * verify_seconds) / (self.spec.num_layers * max(tokens, 1))
        self._layer_ema = compute if self._layer_ema == 0.0 else 0.8 * self._layer_ema + 0.2 * compute


class ModelledSink(CheckedSink):
    """A trace replay's prefetch: the real cache policy on the replay's slot map, a modelled FIFO link.

    Time is the cycle's modelled time (``at``); a copy issued at ``t`` starts when the link is free
    and lands ``expert_seconds`` later. :meth:`settle` then charges a verification layer the wait for
    experts it uses that are still in flight, and counts prefetches used and wasted.
    """

    live = False

    def __init__(self, prefetcher: Any, spec: Any, cache: Any, slot_expert: np.ndarray, constants: Any) -> None:
        super().__init__(prefetcher, spec)
        self.cache, self.slot_expert, self.constants = cache, slot_expert, constants
        self._now = 0.0
        self._link_free = 0.0
        self._arrive = np.zeros((spec.num_layers, spec.num_experts))  # landing time of prefetched experts
        self._pending: dict[tuple[int, int], bool] = {}  # prefetched, not yet used: (layer, expert)
        self.used = self.wasted = 0
        self.stall_seconds = 0.0
        self._cannot = False

    def capacity(self) -> int:
        return int(self.slot_expert.shape[1])

    def expert_seconds(self) -> float:
        """The calibration's extra cost of a miss over a hit: what one copy adds to a pass."""
        return max(self.constants.c_miss - self.constants.c_hit, 0.0)

    def layer_seconds(self, tokens: int) -> float:
        return max(self.constants.c0 + self.constants.c_tok * tokens, 0.0) / max(self.spec.num_layers, 1)

    def now(self) -> float:
        return self._now

    def prefetches_used(self) -> int:
        return self.used

    def at(self, seconds: float) -> None:
        self._now = float(seconds)

    def begin_cycle(self) -> None:
        """A new cycle: its clock starts at 0; copies of the last one have landed."""
        self._now = self._link_free = 0.0
        self._arrive[:] = 0.0

    def arriving(self) -> np.ndarray:
        resident = np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=bool)
        rows, _ = np.nonzero(self.slot_expert >= 0)
        resident[rows, self.slot_expert[self.slot_expert >= 0]] = True
        out = np.where(resident, np.maximum(self._arrive - self._now, 0.0), np.inf)
        return out

    def link_free_in(self) -> float:
        return max(self._link_free - self._now, 0.0)

    def _cannot_prefetch(self) -> None:
        if not self._cannot:
            self.note(f"cache '{guard.plugin_name(self.cache)}' cannot prefetch (no admit_prefetch)")
            self._cannot = True

    def _held(self, layer: int) -> set[int]:
        return set(self.slot_expert[layer].tolist())

    def _issue(self, layer: int, experts: list[int]) -> int:
        row = self.slot_expert[layer]

        def in_flight() -> Iterable[int]:
            return (int(e) for e in row[row >= 0] if self._arrive[layer, e] > self._now)

        loads = prefetch_loads(self.cache, row, layer, experts, in_flight, self._cannot_prefetch)  # as the live runtime
        for expert, slot in loads:
            old = int(row[slot])
            if old >= 0 and self._pending.pop((layer, old), None) is not None:
                self.wasted += 1
            row[slot] = expert
            start = max(self._now, self._link_free)
            self._link_free = start + self.expert_seconds()
            self._arrive[layer, expert] = self._link_free
            self._pending[(layer, expert)] = True
        return len(loads)

    def settle(self, routing: np.ndarray, tokens: int, start: float) -> float:
        """A verification pass starting at modelled time ``start`` with ``routing`` (int [tokens,
        layers, top_k]): the seconds its layers wait for prefetched experts still in flight."""
        stall = 0.0
        layer_s = self.layer_seconds(tokens)
        for layer in range(self.spec.num_layers):
            needed = np.unique(routing[:, layer, :])
            runs_at = start + layer * layer_s + stall
            wait = 0.0
            for e in needed.tolist():
                if self._pending.pop((layer, int(e)), None) is not None:
                    self.used += 1
                    wait = max(wait, self._arrive[layer, int(e)] - runs_at)
            stall += max(wait, 0.0)
        self.stall_seconds += stall
        return stall

    def sweep(self) -> None:
        """After a pass: prefetched experts it evicted unused are wasted."""
        for layer, expert in [key for key in self._pending if key[1] not in self.slot_expert[key[0]]]:
            del self._pending[(layer, expert)]
            self.wasted += 1


def _constants(cost_model: Any) -> Any:
    """A cost model's constants when it has some (no error while uncalibrated)."""
    if cost_model is None or not cost_model.calibrated:  # a CostModel member: checked when the engine was built
        return None
    try:
        return cost_model.constants
    except Exception:  # noqa: BLE001 - a plug-in's property: no constants, then
        return None
