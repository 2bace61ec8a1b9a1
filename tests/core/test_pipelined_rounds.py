"""Pipelined admission rounds: a union larger than the slots computes a round while the next round's
copies are on the link. Greedy output stays HF's; the emulated link's schedule is checked by hand
(an injected clock); no slot is overwritten while a round computes on it, under a fuzzed policy;
the statistics count copies issued ahead as misses, not prefetches; cache=none keeps plain rounds."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from drafters import ScriptedDrafter

import specfit
from specfit import Engine
from specfit.offload import admission
from specfit.offload import runtime as offload
from specfit.offload.copy.emulated import EmulatedLinkEngine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.types.link_profiles import LinkSettings
from specfit.types.moe import MoESpec
from specfit.interfaces import Admission, ExpertCacheBase
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

MS = 1e-3
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
# 1 ms per expert (1 MB over 1 GB/s), no per-transfer latency: schedules are easy to compute by hand
LINK = LinkSettings(profile=None, bandwidth_gbps=1.0, latency_us=0.0, ref_expert_bytes=1_000_000)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


class RoundLog:
    """Wraps ``admission_rounds`` where the runtime looks it up (what run_layer iterates): keeps every
    round it yields, with its layer and the number of the pass (counted by ``listener``, when a runtime calls it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rounds: list[tuple[int, int, admission.Round]] = []
        self.passes = 0
        real = admission.admission_rounds

        def logged(policy, slot_expert, layer, needed) -> Iterator[admission.Round]:  # noqa: ANN001
            for rnd in real(policy, slot_expert, layer, needed):
                self.rounds.append((self.passes, layer, rnd))
                yield rnd

        monkeypatch.setattr(offload, "admission_rounds", logged)

    def listener(self, layer: int, hidden: torch.Tensor) -> None:
        self.passes += layer == 0

    def ahead(self) -> int:
        return sum(len(rnd.ahead) for _, _, rnd in self.rounds)


def check_computed_slots(runtime: offload.OffloadRuntime, log: RoundLog) -> list[int]:
    """Make the runtime's compute check, each time it runs, that every slot of the round holds its
    expert's weights. The emulated link copies the data when a transfer is issued, so a copy issued
    ahead into a slot of the round would show here. Returns the list that counts the checks."""
    checked: list[int] = []
    run = runtime.compute.run

    def checking_run(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        _, layer, rnd = log.rounds[-1]
        for expert, slot in rnd.slots.items():
            assert torch.equal(runtime.slots[layer][slot], runtime.store.layers[layer][expert]), (layer, expert, slot)
        checked.append(layer)
        run(*args, **kwargs)

    runtime.compute.run = checking_run
    return checked


# ------------------------------------------------------------------------------ the rounds themselves


def _bound(cache: LRUCache) -> np.ndarray:
    """Bind ``cache`` to the tiny model's spec; its empty slot table."""
    spec = Engine(tiny_model(), cache=LRUCache(capacity=4), device="cpu").spec
    cache.bind(spec)
    return np.full((spec.num_layers, cache.capacity), -1, dtype=np.int64)


def test_rounds_take_half_the_slots_resident_first_and_issue_the_next_rounds_copies_ahead():
    cache = LRUCache(capacity=4)
    slot_expert = _bound(cache)
    list(admission.admission_rounds(cache, slot_expert, 0, [1, 2]))  # 1 and 2 resident (slots 0, 1)
    rounds = list(admission.admission_rounds(cache, slot_expert, 0, [1, 2, 3, 4, 5, 6, 7]))
    assert [sorted(r.slots) for r in rounds] == [[1, 2], [3, 4], [5, 6], [7]]
    assert rounds[0].loads == rounds[0].fresh == []  # the hits compute at once
    assert rounds[0].ahead == [(3, 2), (4, 3)]  # into the free slots, while 1 and 2 compute
    for before, after in zip(rounds, rounds[1:]):
        assert after.loads == before.ahead + after.fresh  # every copy issued once, by one of the two
        assert not {s for _, s in before.ahead} & set(before.slots.values())  # never into a computing slot
    assert sum(len(r.loads) for r in rounds) == 5 and sum(len(r.slots) - len(r.loads) for r in rounds) == 2


class Spiteful(LRUCache):
    """A legal policy that puts each round's misses over the experts of the round it admitted just
    before (the round now computing), when it can."""

    name = "spiteful"
    last: set[int] = set()

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        lru = self._lru[layer]
        for e in [e for e in lru if e in self.last]:
            lru.move_to_end(e, last=False)  # the least recently used now: evicted first
        admission = super().admit(layer, wanted)
        self.last = set(admission.slots)
        return admission


def test_a_copy_into_a_slot_of_the_computing_round_waits_for_the_next_round():
    cache = Spiteful(capacity=4)
    slot_expert = _bound(cache)
    rounds = list(admission.admission_rounds(cache, slot_expert, 1, [0, 1, 2, 3, 4, 5, 6, 7, 8]))
    assert sorted(e for r in rounds for e in r.slots) == list(range(9))
    held_back = 0
    for before, after in zip(rounds, rounds[1:]):
        computing = set(before.slots.values())
        assert not {s for _, s in before.ahead} & computing
        assert all(s in computing for _, s in after.fresh)  # held back exactly because the slot was in use
        held_back += len(after.fresh)
    assert held_back > 0  # the policy did aim at the computing round


def test_cache_none_cannot_prefetch_and_keeps_plain_rounds(monkeypatch):
    log = RoundLog(monkeypatch)
    model = tiny_model()
    expected = hf_greedy(model, PROMPT, 4)
    engine = Engine(model, cache=NoCache(), device="cpu")
    assert not admission.can_prefetch(engine.runtime.policy)
    assert engine.generate(PROMPT, max_new_tokens=4).token_ids == expected
    assert log.rounds and log.ahead() == 0
    assert all(rnd.fresh == rnd.loads for _, _, rnd in log.rounds)


# ------------------------------------------------------------------------------ identical output


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("capacity", [2, 3, 5])
def test_pipelined_rounds_decode_hf_greedy(monkeypatch, arch, capacity):
    log = RoundLog(monkeypatch)
    model = tiny_model(arch)
    expected = hf_greedy(model, PROMPT, 8)
    engine = Engine(model, cache=LRUCache(capacity=capacity), copy="emulated", link=LinkSettings(latency_us=1.0),
                    device="cpu")
    checked = check_computed_slots(engine.runtime, log)
    out = engine.generate(PROMPT, max_new_tokens=8)
    assert out.token_ids == expected
    assert log.ahead() > 0 and len(checked) == len(log.rounds)  # the prefill's union exceeds the slots
    stats = engine.runtime.stats
    assert stats.prefetch_issued == stats.prefetch_used == stats.prefetch_wasted == 0  # no prefetcher: none
    assert stats.hits + stats.misses == stats.union_sum.sum()
    assert stats.misses * engine.spec.expert_bytes == stats.h2d_bytes  # a copy issued ahead is a miss


def test_pipelined_rounds_in_tree_verification(monkeypatch):
    log = RoundLog(monkeypatch)
    model = tiny_model()
    expected = hf_greedy(model, PROMPT, 16)
    drafter = ScriptedDrafter(PROMPT + expected, vocab=256, branching=3, depth=3)
    engine = Engine(model, cache=LRUCache(capacity=4), copy="emulated", link=LinkSettings(latency_us=1.0),
                    drafter=drafter, device="cpu")
    engine.runtime.add_layer_listener(log.listener)
    check_computed_slots(engine.runtime, log)
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == expected
    assert any(rnd.ahead for p, _, rnd in log.rounds if p > 1)  # verification passes (after the prefill) too


def test_demo_pair_eagle3_and_prefill_pipelined_decode_ar_tokens(monkeypatch):
    log = RoundLog(monkeypatch)
    demo = Path(specfit.__file__).parent / "assets" / "demo"
    prompt = json.loads((demo / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    presets = specfit.compose([]).method_presets
    outs = {}
    for method in ("ar", "eagle3"):  # EAGLE-3 verifies some 60 nodes: about 19 experts a layer, 8 slots
        overrides = ["model=demo", *presets[method], "cache.capacity=8", "cache.copy=emulated", "model.device=cpu"]
        engine = specfit.build(specfit.compose(overrides))
        check_computed_slots(engine.runtime, log)
        outs[method] = engine.generate(prompt, max_new_tokens=8)
        assert log.ahead() > 0, method  # the prefill (every expert) at least
    assert outs["eagle3"].token_ids == outs["ar"].token_ids


# ------------------------------------------------------------------------------ the emulated link's schedule


class FakeClock:
    """A clock that moves only when told to, or when the link waits (then it jumps to the deadline)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait_until(self, deadline: float) -> None:
        self.now = max(self.now, deadline)


def test_the_next_rounds_copies_overlap_the_current_rounds_compute():
    """4 slots (rounds of 2), 1 ms per expert on the link, 0.5 ms of compute per round.

    Pass 1, experts 0-7, none resident. Round 0 issues its own 2 copies (done at 2) and round 1's
    (done at 4), waits 2 and computes to 2.5; round 1 waits for 4 (1.5) while round 2's copies,
    issued at 2.5, queue behind to 6; and so on: stall 2 + 3 x 1.5 = 6.5 ms, the pass ends at 8.5
    (plain rounds of 4: 4 + 4 = 8 ms of stall, ending at 9). Pass 2, experts 4, 5 (resident) and
    8-11: the hits compute at once while 8 and 9 are copied, then two waits of 1.5 ms: 3 ms.
    """
    clock = FakeClock()
    link = EmulatedLinkEngine(TorchCopyEngine("cpu"), LINK)
    link.clock, link.wait_until = clock, clock.wait_until
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), copy=link, device="cpu")
    runtime = engine.runtime
    run = runtime.compute.run

    def compute(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        run(*args, **kwargs)
        clock.now += 0.5 * MS

    runtime.compute.run = compute
    hidden = torch.randn(4, engine.spec.hidden_size)
    weights = torch.full((4, 2), 0.5)
    stats = runtime.stats

    runtime.begin_pass()
    runtime.run_layer(0, hidden, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), weights, None)
    assert stats.h2d_stall_seconds == pytest.approx(6.5 * MS) and clock.now == pytest.approx(8.5 * MS)
    assert (stats.misses, stats.hits, stats.copy_calls, stats.prefetch_issued) == (8, 0, 4, 0)

    runtime.begin_pass()
    runtime.run_layer(0, hidden, torch.tensor([[4, 8], [5, 9], [10, 11], [4, 8]]), weights, None)
    assert stats.h2d_stall_seconds == pytest.approx(6.5 * MS + 3.0 * MS)
    assert clock.now == pytest.approx(13.0 * MS)
    assert (stats.misses, stats.hits) == (8 + 4, 2)


# ------------------------------------------------------------------------------ eviction safety


class Chaotic(ExpertCacheBase):
    """Random legal answers: admits a random part of what is wanted, puts misses over random slots
    (mostly those of the round it admitted just before, the one computing), and prefetches into
    random unprotected slots."""

    name = "chaotic"
    can_prefetch = True  # its admit_prefetch admits

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity, self.rng = capacity, random.Random(seed)

    def bind(self, spec: MoESpec) -> int:
        self.spec = spec
        self.held: list[dict[int, int]] = [{} for _ in range(spec.num_layers)]  # slot -> expert
        self.last: list[set[int]] = [set() for _ in range(spec.num_layers)]  # slots of the last admission
        return self.capacity

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        held, rng = self.held[layer], self.rng
        where = {e: s for s, e in held.items()}
        chosen = rng.sample(list(wanted), rng.randint(1, min(len(wanted), self.capacity)))
        slots = {e: where[e] for e in chosen if e in where}
        free = [s for s in range(self.capacity) if s not in slots.values()]
        rng.shuffle(free)
        if rng.random() < 0.7:
            free.sort(key=lambda s: s not in self.last[layer])
        loads = []
        for e in chosen:
            if e not in slots:
                slots[e] = free.pop(0)
                held[slots[e]] = e
                loads.append((e, slots[e]))
        self.last[layer] = set(slots.values())
        return Admission(slots, loads)

    def admit_prefetch(self, layer: int, candidates: list[int], protected: frozenset[int]) -> Admission:
        held = self.held[layer]
        open_slots = [s for s in range(self.capacity) if held.get(s) not in protected]
        self.rng.shuffle(open_slots)
        loads = []
        for e in candidates:
            if open_slots and self.rng.random() < 0.7:
                held[open_slots[-1]] = e
                loads.append((e, open_slots.pop()))
        return Admission(dict(loads), loads)

    def resident(self) -> np.ndarray:
        mask = np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=bool)
        for layer, held in enumerate(self.held):
            mask[layer, list(held.values())] = True
        return mask


def random_prefetches(runtime: offload.OffloadRuntime, seed: int):  # noqa: ANN201
    """A layer listener prefetching random experts of this layer and the next."""
    rng = random.Random(seed)
    spec = runtime.spec

    def listener(layer: int, hidden: torch.Tensor) -> None:
        for target in (layer, (layer + 1) % spec.num_layers):
            runtime.prefetch(target, rng.sample(range(spec.num_experts), rng.randint(1, 4)))

    return listener


@pytest.mark.parametrize("every_round", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_slot_is_overwritten_while_a_round_computes_under_a_fuzzed_policy(monkeypatch, seed, every_round):
    """Random prefetches of this layer and the next, from the runtime's layer listener or before
    every round computes (then the rounds admitted ahead, not only the computing one, are at stake)."""
    log = RoundLog(monkeypatch)
    model = tiny_model()
    expected = hf_greedy(model, PROMPT, 12)
    drafter = ScriptedDrafter(PROMPT + expected, vocab=256, branching=2, depth=3, seed=seed)
    engine = Engine(model, cache=Chaotic(capacity=4, seed=seed), copy="emulated", link=LinkSettings(latency_us=1.0),
                    drafter=drafter, device="cpu")
    prefetching = random_prefetches(engine.runtime, seed)
    if every_round:
        wait_for = engine.runtime._wait_for

        def prefetch_then_wait(layer, admitted):  # noqa: ANN001, ANN202
            prefetching(layer, None)
            return wait_for(layer, admitted)

        engine.runtime._wait_for = prefetch_then_wait
    else:
        engine.runtime.add_layer_listener(prefetching)
    checked = check_computed_slots(engine.runtime, log)
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == expected
    assert len(checked) == len(log.rounds) and log.ahead() > 0
    assert any(rnd.fresh and rnd.fresh != rnd.loads for _, _, rnd in log.rounds)  # copies held back happened


def test_a_later_round_short_of_hits_is_filled_up_with_misses_that_travel_during_the_round_before():
    cache = LRUCache(capacity=8)
    slot_expert = _bound(cache)
    list(admission.admission_rounds(cache, slot_expert, 0, [1, 2, 3, 4, 5, 6]))  # six resident
    rounds = list(admission.admission_rounds(cache, slot_expert, 0, list(range(1, 13))))
    assert [sorted(r.slots) for r in rounds] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert rounds[0].loads == [] and sorted(e for e, _ in rounds[0].ahead) == [7, 8]  # copied while 1-4 compute
    assert rounds[1].fresh == []  # no copy had to wait for a slot of the first round
