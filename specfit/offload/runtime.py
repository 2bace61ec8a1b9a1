"""The offloaded-experts runtime: host expert store, device slot pool, and the layer that uses them.

Each MoE layer's experts module is replaced by :class:`OffloadedExperts`, which computes only on
device-resident slots. Per pass and layer, the union of routed experts is admitted through the
cache policy in rounds (one round unless the union exceeds the slots); each round's missing
experts are copied in one batch by the copy engine, then computed by the expert compute
(:mod:`specfit.offload.compute.base`: grouped over the slot pool, a constant number of ops).
A union that exceeds the slots is pipelined (:func:`admission_rounds`): rounds of half the slots,
resident experts first, and the next round's copies are issued into the other half before the
current round computes, so the link works while the experts compute (double buffering).
Outputs are reduced per token over its top-k in float32 in a fixed order and cast once, so the
result does not depend on how rounds were split. Reading the routing is the layer's one host sync.

Copies are asynchronous (:mod:`specfit.offload.copy.base`): each issued batch leaves a pending
ticket on the slots it writes, and a layer waits only on the slots it is about to compute with,
counting the blocked time as ``h2d_stall_seconds``. ``prefetch`` issues copies ahead of need
through the policy's ``admit_prefetch``; an expert in flight, or needed by the layer now
computing (any of its rounds), is protected from eviction by a prefetch.

The experts' only host copy is a :class:`~specfit.offload.store.HostExpertStore`: given by the
loader (the model's experts modules may then be meta tensors) or built from the modules, which
frees their weights. When the policy preloads every expert of every layer (``cache=full``), the
host copy is dropped after the preload; on a CPU device the slots are the store's own tensors.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from specfit.messages import note_once
from specfit.interfaces import guard
from specfit.offload.compute.base import ExpertCompute, SlotViews, slot_views
from specfit.offload.compute.factory import make_expert_compute
from specfit.offload.store import HostExpertStore
from specfit.types.moe import MoESpec
from specfit.offload.discovery import find_experts, moe_spec
from specfit.errors import ConfigError, ModelError, PluginError
from specfit.interfaces.bases import ExpertCacheBase
from specfit.interfaces.protocols import Admission
from specfit.types.stats import CacheStats
from specfit.validation import is_collection

if TYPE_CHECKING:
    from specfit.offload.copy.base import CopyEngine, CopyTicket
    from specfit.interfaces.protocols import ExpertCache

_NONE = np.zeros(0, dtype=np.int64)


class OffloadedExperts(nn.Module):
    """Drop-in replacement for a transformers experts module; weights live in the runtime."""

    def __init__(self, runtime: OffloadRuntime, layer: int, act_fn: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.act_fn = act_fn
        self.num_experts = runtime.spec.num_experts
        object.__setattr__(self, "_runtime", runtime)  # not a submodule: .to() must not move the store

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        runtime = self._runtime
        if runtime.orphaned:  # its slots are gone; the weights wait in the store for the next Engine
            raise ModelError("this model's experts belong to an Engine that failed to build, so the model cannot "
                             "run on its own; build a new Engine over it (it takes the experts over)")
        return runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights, self.act_fn)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, offloaded"


class OffloadRuntime:
    """Owns the host store, the device slots and the resident map; asks the policy what to keep.

    ``store``: the experts' host copy from a checkpoint loader (the model's experts modules may hold
    meta tensors; they are replaced without being read); None builds it from the modules, or takes
    over the store of an earlier runtime over the same model whose Engine failed to build.
    ``compute``: the expert compute implementation (``auto``, ``grouped``, ``loop``, ``triton``).
    """

    def __init__(self, model: nn.Module, policy: ExpertCache, copy_engine: CopyEngine, device: torch.device | str,
                 store: HostExpertStore | None = None, compute: str = "auto") -> None:
        self.orphaned = False  # the Engine that built this runtime failed: the next one takes over its store
        previous = _failed_build(model)
        if previous is not None:  # the experts modules are ours already, their weights in its store
            experts: list[tuple[str, nn.Module]] = sorted(
                ((n, m) for n, m in model.named_modules() if isinstance(m, OffloadedExperts)), key=lambda nm: nm[1].layer)
            spec = previous.spec
        else:
            experts = find_experts(model)
            spec = moe_spec(model, experts)
        self.device = torch.device(device)
        self.compute: ExpertCompute = make_expert_compute(compute, self.device)
        if store is not None:  # a loader's store: it must fit the model
            spec = _store_spec(spec, store)
        elif previous is not None:
            store = previous.store
        self.spec = spec
        self.policy = policy
        self.copy_engine = copy_engine
        _check_copy_order(copy_engine)
        self.slots_per_layer = bind_cache(policy, spec)
        preload = cache_preload(policy, spec, self.slots_per_layer)
        # every expert of every layer preloaded (cache=full): the slots will hold the only copy
        self.preloads_all = self.slots_per_layer == spec.num_experts and all(
            len(preload.get(layer, ())) == spec.num_experts for layer in range(spec.num_layers))
        built = store is None
        if built:  # pinned for fast copies, unless it is only read once by the preload
            store = HostExpertStore.from_modules(experts, spec, pin=self.device.type == "cuda" and not self.preloads_all)
        if not self.preloads_all:  # a full cache copies nothing through the engine; checked before the swap below
            _check_store_readable(copy_engine, store, self.device,
                                  " (the model's experts are in that store now: load the model again)" if built else "")
        self.store = store
        for layer, (name, module) in enumerate(experts):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, OffloadedExperts(self, layer, getattr(module, "act_fn", None)))
        experts.clear()  # the replaced modules: their weights are in the store, or were never loaded
        self.slot_expert = np.full((spec.num_layers, self.slots_per_layer), -1, dtype=np.int64)
        # the expert whose copy into each slot was issued (or preloaded): where it differs from
        # slot_expert, an admission was recorded but an exception came before its copy (see _repair)
        self._issued_expert = self.slot_expert.copy()
        self.stats = CacheStats(union_sum=np.zeros(spec.num_layers))
        self._routing: list[torch.Tensor | None] = [None] * spec.num_layers
        # copies not yet waited on: {slot: ticket} per layer (the slot's row of its batch's ticket)
        self._pending: list[dict[int, CopyTicket]] = [{} for _ in range(spec.num_layers)]
        # counted copies whose seconds may still be their enqueue time (CUDA, not yet waited): settle_copies
        self._unsettled: dict[CopyTicket, None] = {}
        # prefetched experts no pass has used yet: {slot: expert} per layer
        self._prefetched: list[dict[int, int]] = [{} for _ in range(spec.num_layers)]
        self._computing: tuple[int, np.ndarray] = (-1, _NONE)  # layer now computing, every expert its pass needs
        self._slot_of = np.full(spec.num_experts, -1, dtype=np.int64)  # a round's expert -> slot, -1 elsewhere
        self._listeners: list[Callable[[int, torch.Tensor], None]] = []
        self._said_no_prefetch = False
        self.slots: list[torch.Tensor] = []
        self._views: list[SlotViews] = []
        try:
            self._preload(preload)
        except BaseException:  # the modules are swapped: the next Engine takes over the store
            self.orphan()
            raise
        model.register_forward_pre_hook(lambda *_: self.begin_pass())

    def orphan(self) -> None:
        """Its Engine failed to build: the next runtime over the model takes over the store. The
        device slots are dropped now (on CUDA their memory returns to torch's caching allocator),
        before that runtime allocates its own; the model's experts refuse to run until then."""
        self.orphaned = True
        self.slots, self._views = [], []

    @property
    def stores(self) -> list[torch.Tensor]:
        """The host store's per-layer tensors (a released layer is None)."""
        return self.store.layers

    @property
    def device_bytes(self) -> int:
        """Bytes of the slot pool (on a CPU device: host memory, shared with the store when aliased)."""
        return sum(t.numel() * t.element_size() for t in self.slots)

    # ------------------------------------------------------------------ per pass

    def begin_pass(self) -> None:
        guard.call("cache", self.policy, "begin_pass")
        self.stats.passes += 1
        self._routing = [None] * self.spec.num_layers
        self._computing = (-1, _NONE)

    def add_layer_listener(self, fn: Callable[[int, torch.Tensor], None]) -> None:
        """Call ``fn(layer, hidden)`` once per MoE layer and pass, with the layer's (normalised)
        expert input, once the layer has issued all its copies (before its last round computes).
        A prefetch for a later layer issued there queues behind this layer's own copies on the
        FIFO link (it cannot delay them) and travels while this layer computes."""
        self._listeners.append(fn)

    def routed(self, layer: int) -> torch.Tensor | None:
        """int64 [tokens, top_k] on the host: the experts ``layer`` routed to in this pass (None before it ran)."""
        return self._routing[layer]

    def routing(self) -> np.ndarray:
        """Experts routed in the last pass: int [tokens, layers, top_k]."""
        if any(r is None for r in self._routing):
            raise RuntimeError("no complete pass recorded yet")
        return torch.stack(self._routing, dim=1).numpy()  # type: ignore[arg-type]

    def resident(self) -> np.ndarray:
        return cache_resident(self.policy, self.spec)

    def run_layer(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        act_fn: nn.Module | None,
    ) -> torch.Tensor:
        spec = self.spec
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1).to("cpu", torch.int64)  # the one host sync of the layer
        self._routing[layer] = flat.view(tokens, k)
        routed = flat.numpy()
        needed = np.flatnonzero(np.bincount(routed, minlength=spec.num_experts)).tolist()
        self.stats.union_sum[layer] += len(needed)

        weights = top_k_weights.reshape(-1)
        out = torch.zeros(tokens * k, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        slot_of = self._slot_of  # -1 outside a round's call
        stats = self.stats
        listeners, uncomputed = self._listeners, len(needed)
        # a prefetch meanwhile must not evict any of them: rounds admit ahead of computing
        self._computing = (layer, np.asarray(needed, dtype=np.int64))
        try:
            for rnd in admission_rounds(self.policy, self.slot_expert, layer, needed):
                experts = np.fromiter(rnd.slots, np.int64, len(rnd.slots))
                if rnd.fresh:
                    self._issue(layer, rnd.fresh)
                if rnd.ahead:  # the next round's copies, on the link while this round computes
                    self._issue(layer, rnd.ahead)
                uncomputed -= len(rnd.slots)
                if listeners and uncomputed <= 0:  # the last round: every copy of this layer is on the link
                    for listener in listeners:
                        listener(layer, hidden)
                    listeners = ()
                stats.misses += len(rnd.loads)
                stats.hits += len(rnd.slots) - len(rnd.loads)
                self._wait_for(layer, rnd.slots)
                slot_of[experts] = np.fromiter(rnd.slots.values(), np.int64, len(experts))
                try:
                    plan = self.compute.plan(slot_of[routed], self.slots_per_layer, hidden.device)
                finally:
                    slot_of[experts] = -1
                self.compute.run(self._views[layer], hidden, weights, k, plan, spec.layout, act_fn, out)
        except BaseException:  # an error or Ctrl-C mid-layer: no slot may keep a recorded but uncopied expert
            self._repair(layer)
            raise
        finally:
            self._computing = (-1, _NONE)
        # float32 sum over each token's top-k, in a fixed order, then one rounding to the hidden dtype
        return out.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Copy ``experts`` of ``layer`` ahead of need, as far as the policy admits them; returns
        the experts actually issued.

        Experts already in a slot are skipped; the rest go to the policy's ``admit_prefetch`` with
        the protected experts (in flight, needed by the layer now computing, or asked for by this
        prefetch and already in a slot), which it must not evict: the admission is checked like
        ``admit``'s, a violation is a PluginError naming the cache, and nothing is copied then.
        """
        spec = self.spec
        if not 0 <= int(layer) < spec.num_layers:
            raise ValueError(f"prefetch: layer {layer} outside 0..{spec.num_layers - 1}")
        layer = int(layer)
        asked = list(dict.fromkeys(int(e) for e in experts))  # distinct, in order
        if asked and not (0 <= min(asked) and max(asked) < spec.num_experts):
            bad = next(e for e in asked if not 0 <= e < spec.num_experts)
            raise ValueError(f"prefetch: expert {bad} outside 0..{spec.num_experts - 1}")
        if self.store.layers[layer] is None:  # every expert preloaded, the host copy dropped: nothing to fetch
            return 0
        loads = prefetch_loads(self.policy, self.slot_expert[layer], layer, asked, lambda: self._protected(layer),
                               self._cannot_prefetch)
        if not loads:
            return 0
        for expert, slot in loads:
            self.slot_expert[layer, slot] = expert
        try:
            self._issue(layer, loads, prefetch=True)
        except BaseException:
            self._repair(layer)
            raise
        self.stats.prefetch_issued += len(loads)
        return len(loads)

    def arriving(self) -> np.ndarray:
        """float [layers, experts]: seconds until each expert is usable: 0.0 resident and arrived,
        > 0 in flight, inf absent (for the cost model)."""
        spec = self.spec
        out = np.full((spec.num_layers, spec.num_experts), np.inf)
        resident = self.resident()
        layers, slots = np.nonzero(self.slot_expert >= 0)
        experts = self.slot_expert[layers, slots]
        held = resident[layers, experts]  # a scratch slot's leftover (cache=none) is not resident
        out[layers[held], experts[held]] = 0.0
        for layer, pending in enumerate(self._pending):
            for slot, ticket in pending.items():
                expert = int(self.slot_expert[layer, slot])
                if expert >= 0 and resident[layer, expert]:
                    left = ticket.remaining()
                    if left > 0.0 and ticket in self._unsettled:  # CUDA in flight: its ticket knows the enqueue
                        left = max(left, self.stats.timed_copy_mean)  # time only; one copy's measured time
                    out[layer, expert] = left
        return out

    def _protected(self, layer: int) -> frozenset[int]:
        """Experts of ``layer`` a prefetch must not evict: in flight, or needed by the layer now
        computing (all its rounds: a later round's experts may be admitted already)."""
        computing, admitted = self._computing
        if computing != layer:
            return self._in_flight(layer)
        return self._in_flight(layer).union(admitted.tolist())

    def _in_flight(self, layer: int) -> frozenset[int]:
        """Experts of ``layer`` whose copies no round has waited for and that may not have landed.
        One the engine knows has landed unused (a prefetch's wrong pick) may be evicted like any
        resident expert."""
        pending = self._pending[layer]
        if not pending:
            return frozenset()
        row = self.slot_expert[layer]
        return frozenset(int(row[slot]) for slot, t in pending.items() if t.in_flight())

    def _cannot_prefetch(self) -> None:
        if not self._said_no_prefetch:
            self._said_no_prefetch = True
            note_once(f"cache '{guard.plugin_name(self.policy)}' cannot prefetch; prefetches are ignored")

    # ------------------------------------------------------------------ copies

    def _issue(self, layer: int, loads: Sequence[tuple[int, int]], prefetch: bool = False,
               count: bool = True) -> CopyTicket:
        """Issue the copy of (expert, slot) pairs of one layer in one engine call; the slots are
        pending until waited on. A load into a slot whose prefetched expert was never used counts
        that prefetch as wasted."""
        host = self.store.layers[layer]
        if host is None:
            raise guard.violation("cache", self.policy, "admit", f"layer {layer}: loads {len(loads)} experts after "
                                  f"preloading every expert (the host copy was dropped); a full cache never loads")
        prefetched, pending, issued = self._prefetched[layer], self._pending[layer], self._issued_expert[layer]
        for expert, slot in loads:
            if prefetched.pop(slot, expert) != expert:
                self.stats.prefetch_wasted += 1
            if prefetch:
                prefetched[slot] = expert
        experts, slots = torch.from_numpy(np.array(loads, dtype=np.int64).T.copy())  # [2, n]: experts, slots
        start = time.perf_counter()
        ticket = self.copy_engine.issue(host, experts, self.slots[layer], slots)
        issue_seconds = time.perf_counter() - start
        for row, (expert, slot) in enumerate(loads):
            pending[slot] = ticket.row(row)  # same copy stream / FIFO link: it lands after any earlier copy
            issued[slot] = expert  # with its ticket: waited before use
        if not count:
            return ticket
        if ticket.event is not None:  # CUDA: charged its enqueue time until waited for, or settled
            self._unsettled.update(dict.fromkeys(pending[slot] for _, slot in loads))
        self.stats.issue_seconds += issue_seconds
        self.stats.h2d_bytes += ticket.bytes
        self.stats.h2d_seconds += ticket.seconds
        self.stats.link_busy_seconds += ticket.seconds
        self.stats.copy_calls += 1
        return ticket

    def _wait_for(self, layer: int, admitted: dict[int, int]) -> None:
        """Wait for the pending copies of the slots about to be computed on; count used prefetches."""
        pending, prefetched = self._pending[layer], self._prefetched[layer]
        if not pending and not prefetched:
            return
        for expert, slot in admitted.items():
            if prefetched.get(slot) == expert:
                del prefetched[slot]
                self.stats.prefetch_used += 1
            ticket = pending.pop(slot, None)
            if ticket is not None:
                measured = ticket.seconds
                self.stats.h2d_stall_seconds += ticket.wait()
                self._unsettled.pop(ticket, None)
                self._count_measured(ticket, measured)

    def _count_measured(self, ticket: CopyTicket, counted: float) -> None:
        """CUDA: the copy's measured time replaces the enqueue time ``counted`` for it."""
        if ticket.seconds != counted:
            self.stats.h2d_seconds += ticket.seconds - counted
            self.stats.link_busy_seconds += ticket.seconds - counted
            self.stats.timed_copies += ticket.experts
            self.stats.timed_copy_seconds += ticket.seconds

    def settle_copies(self, landed_only: bool = False) -> None:
        """Count the measured time of every copy no pass waited for (CUDA: a prefetch evicted unused,
        or one still pending), in place of its enqueue time. The engine calls it before a decode
        (a decode cut short by an error leaves some), after the prefill with ``landed_only`` (copies
        that have landed: settling them blocks nothing; one still in flight counts in the decode)
        and when the decode ends, before reading the statistics. Off CUDA every ticket's time is
        final already."""
        for ticket in list(self._unsettled):
            if landed_only and ticket.in_flight():
                continue
            counted = ticket.seconds
            ticket.settle()
            self._count_measured(ticket, counted)
            del self._unsettled[ticket]

    def _repair(self, layer: int) -> None:
        """After an exception mid-layer or mid-prefetch: copy, synchronously, every expert of
        ``layer`` that ``slot_expert`` (and so the policy) records but whose copy was never issued
        (a round's held-back loads, a batch cut inside the engine), so that a later pass on this
        runtime never computes on a slot holding other weights. On CUDA the device is synchronised
        first: an earlier copy into the same slot may still be in flight."""
        row, issued = self.slot_expert[layer], self._issued_expert[layer]
        stale = np.flatnonzero(row != issued).tolist()
        if not stale:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        host = self.store.layers[layer]
        for slot in stale:
            self._pending[layer].pop(slot, None)
            self._prefetched[layer].pop(slot, None)
            expert = int(row[slot])
            if expert >= 0 and host is not None:
                self.slots[layer][slot].copy_(host[expert])
            issued[slot] = expert

    def _copy(self, layer: int, loads: Sequence[tuple[int, int]]) -> None:
        """Copy (expert, slot) pairs of one layer now (the preload: counted as ``preload_bytes``, not
        as copies). One bulk copy at build time, not a transfer a pass waits for: it goes straight
        through torch rather than the copy engine, so an unpinned store (``cache=full`` does not pin
        what it reads once) is fine with the Triton engine too, and no emulated link is charged."""
        host, slots = self.store.layers[layer], self.slots[layer]
        for expert, slot in loads:  # expert by expert: no gathered temporary as large as the layer
            slots[slot].copy_(host[expert])

    def _preload(self, preload: dict[int, list[tuple[int, int]]]) -> None:
        """Allocate the slots and copy the policy's preload, layer by layer.

        When every expert of every layer is preloaded, the host copy of each layer is released once
        its slots hold it; on a CPU device with the identity placement the slots ARE the store's
        tensor (no copy at all).
        """
        spec = self.spec
        for layer in range(spec.num_layers):
            loads = preload.get(layer, [])
            host = self.store.layers[layer]
            if (self.preloads_all and self.device.type == "cpu" and host.device == self.device and not self.store.shared
                    and all(e == s for e, s in loads)):  # a shared store is other engines' too: never a slot pool
                slots = host  # the store's tensor becomes the slot pool
            else:
                slots = torch.empty(self.slots_per_layer, spec.expert_numel, dtype=spec.dtype, device=self.device)
            self.slots.append(slots)
            self._views.append(slot_views(slots, spec))
            if loads and slots is not host:
                self._copy(layer, loads)
            self.stats.preload_bytes += len(loads) * spec.expert_bytes
            for e, slot in loads:
                self.slot_expert[layer, slot] = e
                self._issued_expert[layer, slot] = e
            if self.preloads_all:
                self.store.release(layer)
        if self.preloads_all and self.store.pinned and hasattr(torch._C, "_host_emptyCache"):
            torch.cuda.synchronize(self.device)  # the copies have read the pinned rows: return them to the system
            torch._C._host_emptyCache()


def _failed_build(model: nn.Module) -> OffloadRuntime | None:
    """The runtime whose Engine failed to build over ``model`` (its experts modules swapped, their
    weights in its store), which a new runtime takes over; None for a model no Engine holds. A
    model a working Engine holds, or whose store a failed full-cache build already dropped, is a
    ModelError."""
    held = {id(m._runtime): m._runtime for m in model.modules() if isinstance(m, OffloadedExperts)}
    if not held:
        return None
    previous = next(iter(held.values()))
    if len(held) == 1 and previous.orphaned:
        if any(layer is None for layer in previous.store.layers):
            raise ModelError(f"this {type(model).__name__}'s experts were in the device slots of an Engine that failed "
                             "to build (cache=full drops their host copy): load the model again")
        return previous
    raise ModelError(f"this {type(model).__name__}'s experts are held by another Engine (an Engine moves a model's "
                     "experts into its own store): reuse that Engine, load the model again, or load it once for "
                     "several engines with specfit.api.load_shared_target")


def _check_copy_order(copy_engine: CopyEngine) -> None:
    """The runtime keeps no per-slot event of a slot's last use: a copy engine (or the engine an
    emulated link wraps) must order its copies after the compute queued before them, or a copy
    could overwrite a slot that queued compute still reads."""
    for engine in _engines_within(copy_engine):
        if getattr(engine, "order_after_compute", True) is False:
            raise ConfigError(f"copy engine {type(engine).__name__} has order_after_compute=False: the offload "
                              "runtime tracks no per-slot last use, so its copies must wait for queued compute")


def _engines_within(copy_engine: CopyEngine) -> Iterator[Any]:
    """The copy engine and the engines it wraps (an emulated link's real engine, ``inner``)."""
    engine: Any = copy_engine
    while engine is not None:
        yield engine
        engine = getattr(engine, "inner", None)


def _check_store_readable(copy_engine: CopyEngine, store: HostExpertStore, device: torch.device,
                          after: str = "") -> None:
    """The Triton engine's kernel reads the host store directly on CUDA, which needs pinned memory:
    a store that could not be pinned throughout (pinned memory ran out part-way) is named now, not
    at the first copy from one of its pageable layers, mid-decode."""
    if device.type != "cuda" or not any(getattr(e, "name", None) == "triton" for e in _engines_within(copy_engine)):
        return
    pageable = [i for i, t in enumerate(store.layers) if t is not None and t.device.type == "cpu" and not t.is_pinned()]
    if pageable:
        raise ConfigError(f"cache.copy=triton reads the host expert store from the GPU, which needs pinned memory, "
                          f"but {len(pageable)} of its {len(store.layers)} layers are not pinned (pinning failed, or "
                          f"the loader did not ask for it): use cache.copy=torch, or free pinned memory{after}")


def _store_spec(model_spec: MoESpec, store: HostExpertStore) -> MoESpec:
    """The runtime's spec with a loader's store: the model's shapes, the store's dtype (the experts may
    stay bf16 under fp32 activations); a store of other shapes is a ModelError."""
    given = store.spec
    for field_name in ("num_layers", "num_experts", "hidden_size", "intermediate_size", "layout"):
        if getattr(given, field_name) != getattr(model_spec, field_name):
            raise ModelError(f"expert store: {field_name} {getattr(given, field_name)} does not match the model's "
                             f"{getattr(model_spec, field_name)}")
    return dataclasses.replace(model_spec, dtype=given.dtype)


def bind_cache(policy: ExpertCache, spec: MoESpec) -> int:
    """``policy.bind(spec)``: the slots per layer to allocate, at least the model's top-k."""
    slots = guard.check_count("cache", policy, "bind", guard.call("cache", policy, "bind", spec), "the slots per layer")
    if slots < spec.top_k:
        raise guard.violation("cache", policy, "bind", f"asked for {slots} slots per layer, below top-k {spec.top_k}")
    return slots


def cache_preload(policy: ExpertCache, spec: MoESpec, slots: int) -> dict[int, list[tuple[int, int]]]:
    """``policy.preload()`` checked and grouped by layer: {layer: [(expert, slot), ...]}."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    entries = guard.call("cache", policy, "preload")
    if not is_collection(entries):
        raise guard.violation("cache", policy, "preload", f"must return a list of (layer, expert, slot), got "
                              f"{entries!r:.40}")
    for entry in entries:
        try:
            layer, expert, slot = (int(x) for x in entry)
        except (TypeError, ValueError):
            raise guard.violation("cache", policy, "preload", f"entries must be (layer, expert, slot) ints, got {entry!r:.60}") from None
        if not (0 <= layer < spec.num_layers and 0 <= expert < spec.num_experts and 0 <= slot < slots):
            raise guard.violation("cache", policy, "preload", f"(layer {layer}, expert {expert}, slot {slot}) is out of range "
                                  f"({spec.num_layers} layers, {spec.num_experts} experts, {slots} slots)")
        by_layer.setdefault(layer, []).append((expert, slot))
    for layer, loads in by_layer.items():
        if len({s for _, s in loads}) != len(loads):
            raise guard.violation("cache", policy, "preload", f"two experts go into one slot of layer {layer}")
    return by_layer


def cache_resident(policy: ExpertCache, spec: MoESpec) -> np.ndarray:
    """``policy.resident()``: bool [layers, experts], as selectors and cost models read it."""
    resident = guard.call("cache", policy, "resident")
    shape = (spec.num_layers, spec.num_experts)
    if not isinstance(resident, np.ndarray) or resident.dtype != np.bool_ or resident.shape != shape:
        got = f"{resident.dtype} of shape {list(resident.shape)}" if isinstance(resident, np.ndarray) else type(resident).__name__
        raise guard.violation("cache", policy, "resident", f"must return a bool array of shape {list(shape)}, got {got}")
    return resident


@dataclass
class Round:
    """One admission round of a layer's pass: what the runtime copies and computes.

    ``slots``: every expert the round computes, and its slot. ``loads``: the round's misses (the
    policy's admission), issued now (``fresh``) or by the round before it. ``ahead``: the next
    round's copies into slots this round does not use, issued now, before this round computes
    (demand copies issued early: the next round counts them as misses, not as prefetches).
    """

    slots: dict[int, int]
    loads: list[tuple[int, int]]
    fresh: list[tuple[int, int]]
    ahead: list[tuple[int, int]] = field(default_factory=list)


def can_prefetch(policy: ExpertCache) -> bool:
    """Whether ``policy`` has its own ``admit_prefetch`` (``ExpertCacheBase``'s default admits nothing)."""
    hook = getattr(type(policy), "admit_prefetch", None)
    return hook is not None and hook is not ExpertCacheBase.admit_prefetch


def admission_rounds(policy: ExpertCache, slot_expert: np.ndarray, layer: int, needed: list[int]) -> Iterator[Round]:
    """Ask ``policy`` round by round until every expert in ``needed`` has been admitted.

    ``slot_expert[layer, slot]`` is the ground truth of which expert each slot holds; every
    admission is checked against it (a policy bug must fail loudly, never compute with the wrong
    weights) and its loads are recorded in it. The offload runtime copies and computes each round;
    a trace replay only counts them, so both go through this one function.

    A union that fits the slots is one round. A larger one is pipelined when the policy can prefetch
    (:func:`_pipelined_rounds`); otherwise (``cache=none``: scratch slots reused every round) each
    round admits what it can and its copies wait for the round before it to finish.
    """
    if len(needed) > slot_expert.shape[1] and can_prefetch(policy):
        yield from _pipelined_rounds(policy, slot_expert[layer], layer, needed)
        return
    remaining = needed
    while remaining:
        admission = _admit(policy, slot_expert[layer], layer, remaining)
        yield Round(admission.slots, admission.loads, admission.loads)
        remaining = [e for e in remaining if e not in admission.slots]


def _pipelined_rounds(policy: ExpertCache, row: np.ndarray, layer: int, needed: list[int]) -> Iterator[Round]:
    """Rounds of at most half the slots, resident experts first; each round's successor is admitted
    before the round computes, and those of its copies that go to slots the round does not compute
    on are issued with the round (``ahead``), so they land while it computes. A copy the policy puts
    into a slot of the computing round is held back until that round is done (``fresh`` of the
    next), so the policy still decides every placement and no slot is overwritten while in use.

    A later round that runs out of resident experts is filled up with misses (six hits and many
    misses through 8 slots: rounds of 4 hits, 2 hits and 2 misses, then 4 misses, not a round of 2
    hits alone that hides little of the copies after it).

    Half the slots, so that the next round's copies outlast the current round's compute: on the demo
    pair's EAGLE-3 passes (about 19 experts a layer through 8 slots) a round computes in about 1 ms
    on a CPU, 2.7 experts of link time (0.38 ms each); rounds of 3, 5 or 6 measured within noise
    of 4, and the stall per token fell from 14.0 to 7.7 ms. A union that fits stays one round:
    computing its hits first would add a round whose fixed cost (about 0.6 ms for an AR pass on
    a CPU) is more than the copy time it would hide.
    """
    chunk = max(1, len(row) // 2)

    def wanted(remaining: list[int], first: bool = False) -> list[int]:
        held = set(row.tolist())
        hits = [e for e in remaining if e in held]
        if first:  # a first round's copies cannot be hidden: it computes hits only, if it has any
            return hits[:chunk] or remaining[:chunk]
        # later rounds fill up with misses: admitted while the round before computes, they travel then
        return (hits + [e for e in remaining if e not in held])[:chunk]

    remaining = needed
    admission = _admit(policy, row, layer, wanted(remaining, first=True))
    fresh = admission.loads
    while True:
        remaining = [e for e in remaining if e not in admission.slots]
        if not remaining:
            yield Round(admission.slots, admission.loads, fresh)
            return
        following = _admit(policy, row, layer, wanted(remaining))
        busy = set(admission.slots.values())
        yield Round(admission.slots, admission.loads, fresh, [(e, s) for e, s in following.loads if s not in busy])
        fresh = [(e, s) for e, s in following.loads if s in busy]
        admission = following


def _admit(policy: ExpertCache, row: np.ndarray, layer: int, wanted: list[int]) -> Admission:
    """``policy.admit(layer, wanted)``, checked against the layer's slots ``row``; its loads recorded there."""
    admission = guard.call("cache", policy, "admit", layer, wanted)
    _check_admission(policy, row, layer, wanted, admission)
    for expert, slot in admission.loads:
        row[slot] = expert
    return admission


def prefetch_loads(policy: ExpertCache, row: np.ndarray, layer: int, asked: list[int],
                   busy: Callable[[], Iterable[int]], cannot: Callable[[], None]) -> list[tuple[int, int]]:
    """The checked (expert, slot) loads of a prefetch of ``asked`` (distinct, most wanted first) into
    one layer's slots ``row``; the live runtime and the replay's modelled link decide with it.

    Experts already held are not copied, and are protected from eviction with ``busy()`` (those in
    flight or in use): evicting an expert the request names would defeat it. A policy without its
    own ``admit_prefetch`` admits nothing: ``cannot()`` is called (when there is something to
    copy) and no load returned. ``busy`` is called only when the policy is asked."""
    held = set(row.tolist())
    candidates = [e for e in asked if e not in held]
    if not candidates:
        return []
    if not can_prefetch(policy):
        cannot()
        return []
    protected = frozenset(busy()).union(e for e in asked if e in held)
    admission = guard.call("cache", policy, "admit_prefetch", layer, list(candidates), protected)
    return check_prefetch_admission(policy, row, layer, candidates, protected, admission)


def check_prefetch_admission(policy: ExpertCache, slots: np.ndarray, layer: int, candidates: list[int],
                             protected: frozenset[int], admission: Any) -> list[tuple[int, int]]:
    """The (expert, slot) loads of a prefetch admission the runtime may copy: wanted candidates into
    distinct slots in range, never over a protected expert (in flight or needed by the layer now
    computing). ``slots`` is the layer's real slot contents; live decoding and the replay's modelled
    link check with this one function. A violation is a PluginError naming the cache."""
    def bad(message: str) -> PluginError:
        return guard.violation("cache", policy, "admit_prefetch", f"layer {layer}: {message}")

    chosen_slots, loads = _admission_fields(admission, bad)
    loaded = _loads_by_expert(loads, bad)
    if len(loaded) != len(loads) or len(set(loaded.values())) != len(loads):
        raise bad("lists an expert twice, or two experts in one slot, in its loads")
    if loaded != chosen_slots:
        raise bad("slots and loads differ: a prefetch admits exactly the experts it loads")
    wanted = set(candidates)
    for expert, slot in loaded.items():
        if expert not in wanted:
            raise bad(f"prefetches expert {expert!r:.20}, which was not a candidate")
        if not _is_slot(slot, len(slots)):
            raise bad(f"puts expert {expert} in slot {slot!r:.20}, outside 0..{len(slots) - 1}")
        if int(slots[slot]) in protected:
            raise bad(f"evicts expert {int(slots[slot])} from slot {slot}, which is in flight or needed by the "
                      "layer now computing")
    return [(int(e), int(s)) for e, s in loaded.items()]


def _admission_fields(admission: Any, bad: Callable[[str], PluginError]) -> tuple[dict, list | tuple]:
    """An admission's ``slots`` (dict) and ``loads`` (list), or the error ``bad`` makes of its type."""
    chosen_slots = getattr(admission, "slots", None)
    loads = getattr(admission, "loads", None)
    if not isinstance(chosen_slots, dict) or not isinstance(loads, (list, tuple)):
        raise bad(f"returned {type(admission).__name__}, expected an Admission(slots: dict, loads: list)")
    return chosen_slots, loads


def _loads_by_expert(loads: list | tuple, bad: Callable[[str], PluginError]) -> dict:
    """``{expert: slot}`` of an admission's loads, or the error ``bad`` makes when they are not pairs."""
    try:
        return dict(loads)
    except (TypeError, ValueError):
        raise bad("loads must be (expert, slot) pairs") from None


def _is_slot(slot: Any, slots: int) -> bool:
    """Whether ``slot`` is an integer slot index in ``0..slots - 1`` (a bool is not)."""
    return not isinstance(slot, (bool, np.bool_)) and isinstance(slot, (int, np.integer)) and 0 <= slot < slots


def _check_admission(policy: ExpertCache, slots: np.ndarray, layer: int, wanted: list[int], admission: Admission) -> None:
    """An admission the runtime may compute with: every admitted expert wanted and in its own slot
    in range, the loads exactly the admitted experts that are not resident already."""
    def bad(message: str) -> PluginError:
        return guard.violation("cache", policy, "admit", f"layer {layer}: {message}")

    chosen_slots, loads = _admission_fields(admission, bad)
    if not chosen_slots:
        raise bad(f"admitted none of the wanted experts {wanted[:8]}{'...' if len(wanted) > 8 else ''}")
    chosen = list(chosen_slots.values())
    if len(set(chosen)) != len(chosen):
        raise bad("put two experts in one slot")
    loaded = _loads_by_expert(loads, bad)
    if len(loaded) != len(loads):
        raise bad("lists an expert twice in its loads")
    wanted_set = set(wanted)
    for expert, slot in chosen_slots.items():
        if expert not in wanted_set:
            raise bad(f"admitted expert {expert!r:.20}, which was not wanted")
        if not _is_slot(slot, len(slots)):
            raise bad(f"admitted expert {expert} to slot {slot!r:.20}, outside 0..{len(slots) - 1}")
        if expert not in loaded and slots[slot] != expert:
            raise bad(f"claims expert {expert} is resident in slot {slot}, it is not")
    if any(loaded[e] != chosen_slots.get(e) for e in loaded):
        raise bad("loads an expert it did not admit, or into another slot")
