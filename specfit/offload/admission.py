"""The admission protocol between the offload runtime and its cache policy, and the checks of the
cache's contract (``bind``, ``preload``, ``resident``, ``admit``, ``admit_prefetch``).

A layer's pass asks the policy round by round (:func:`admission_rounds`): one round when the union
of routed experts fits the slots, pipelined rounds of half the slots otherwise; a prefetch asks
through :func:`prefetch_loads`. Every answer is checked against the slots' real contents before
anything is copied or computed, and a violation is a PluginError naming the cache. The live
runtime and the trace replay (which only counts what the runtime would copy) both decide through
these functions, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from specfit.errors import PluginError
from specfit.interfaces import guard
from specfit.interfaces.exchange import Admission
from specfit.types.moe import MoESpec
from specfit.validation import is_collection

if TYPE_CHECKING:
    from specfit.interfaces.protocols import ExpertCache


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
    """Whether ``policy`` admits prefetches (its declared ``can_prefetch``)."""
    return policy.can_prefetch is True


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
