"""The offloaded-experts runtime: host expert store, device slot pool, and the copies between them.

Each MoE layer's experts module is replaced by :class:`~specfit.offload.layer.OffloadedExperts`
(:mod:`specfit.offload.layer`), which computes only on
device-resident slots. Per pass and layer, the union of routed experts is admitted through the
cache policy in rounds (one round unless the union exceeds the slots); each round's missing
experts are copied in one batch by the copy engine, then computed by the expert compute
(:mod:`specfit.offload.compute.base`: grouped over the slot pool, a constant number of ops).
A union that exceeds the slots is pipelined (:func:`specfit.offload.admission.admission_rounds`): rounds of half the slots,
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

The cache policy's answers are checked in :mod:`specfit.offload.admission`, what the runtime is
built from in :mod:`specfit.offload.checks`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch
from torch import nn

from specfit.interfaces import guard
from specfit.messages import note_once
from specfit.offload.admission import admission_rounds, bind_cache, cache_preload, cache_resident, prefetch_loads
from specfit.offload.checks import check_copy_order, check_store_readable, store_spec
from specfit.offload.compute.base import ExpertCompute, SlotViews, slot_views
from specfit.offload.compute.factory import make_expert_compute
from specfit.offload.discovery import find_experts, moe_spec
from specfit.offload.layer import failed_build, offloaded_experts, swap_in
from specfit.offload.store import HostExpertStore
from specfit.types.stats import CacheStats

if TYPE_CHECKING:
    from specfit.interfaces.protocols import ExpertCache
    from specfit.offload.copy.base import CopyEngine, CopyTicket

_NONE = np.zeros(0, dtype=np.int64)


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
        previous = failed_build(model)
        if previous is not None:  # the experts modules are ours already, their weights in its store
            experts, spec = offloaded_experts(model), previous.spec
        else:
            experts = find_experts(model)
            spec = moe_spec(model, experts)
        self.device = torch.device(device)
        self.compute: ExpertCompute = make_expert_compute(compute, self.device)
        if store is not None:  # a loader's store: it must fit the model
            spec = store_spec(spec, store)
        elif previous is not None:
            store = previous.store
        self.spec = spec
        self.policy = policy
        self.copy_engine = copy_engine
        check_copy_order(copy_engine)
        self.slots_per_layer = bind_cache(policy, spec)
        preload = cache_preload(policy, spec, self.slots_per_layer)
        # every expert of every layer preloaded (cache=full): the slots will hold the only copy
        self.preloads_all = self.slots_per_layer == spec.num_experts and all(
            len(preload.get(layer, ())) == spec.num_experts for layer in range(spec.num_layers))
        self.store = self._host_store(experts, store)
        swap_in(model, experts, self)  # the replaced modules: their weights are in the store, or were never loaded
        self._init_state()
        try:
            self._preload(preload)
        except BaseException:  # the modules are swapped: the next Engine takes over the store
            self.orphan()
            raise
        model.register_forward_pre_hook(lambda *_: self.begin_pass())

    def _host_store(self, experts: list[tuple[str, nn.Module]], store: HostExpertStore | None) -> HostExpertStore:
        """The experts' host copy: ``store`` (a loader's, or an earlier runtime's), else built from the
        modules (which frees their weights); checked readable by the copy engine unless every expert
        is preloaded. Called before the modules are swapped."""
        built = store is None
        if built:  # pinned for fast copies, unless it is only read once by the preload
            store = HostExpertStore.from_modules(experts, self.spec, pin=self.device.type == "cuda" and not self.preloads_all)
        if not self.preloads_all:  # a full cache copies nothing through the engine; checked before the swap
            check_store_readable(self.copy_engine, store, self.device,
                                 " (the model's experts are in that store now: load the model again)" if built else "")
        return store

    def _init_state(self) -> None:
        """The resident map, the statistics and the bookkeeping of copies, prefetches and rounds."""
        spec = self.spec
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


