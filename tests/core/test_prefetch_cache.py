"""Prefetch through the cache policy: LRU's admit_prefetch, none and full, the runtime's checks
(a policy that evicts a protected expert is refused and nothing is copied), eviction safety under a
fuzzed policy, and output identical with random prefetches on every cache x copy engine."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import TRITON_ON_CPU, tiny_model

from specfit import Engine
from specfit.types.link_profiles import LinkSettings
from specfit.errors import PluginError
from specfit.interfaces import Admission
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}


def hf_greedy(prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny_model().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def random_prefetcher(runtime, seed: int, refusals: list[str] | None = None):  # noqa: ANN001, ANN201
    """A layer listener prefetching random experts of this layer, the next one and a random one."""
    rng = random.Random(seed)
    spec = runtime.spec

    def listener(layer: int, hidden: torch.Tensor) -> None:
        for target in (layer, (layer + 1) % spec.num_layers, rng.randrange(spec.num_layers)):
            experts = rng.sample(range(spec.num_experts), rng.randint(1, spec.num_experts // 2))
            try:
                issued = runtime.prefetch(target, experts)
            except PluginError as exc:
                if refusals is None:
                    raise
                refusals.append(str(exc))
            else:
                assert 0 <= issued <= len(experts)

    return listener


# ------------------------------------------------------------------------------------ LRU policy


def bound_lru(capacity: int = 4) -> LRUCache:
    cache = LRUCache(capacity=capacity)
    cache.bind(Engine(tiny_model(), cache=LRUCache(capacity=capacity), device="cpu").spec)
    return cache


def test_lru_prefetch_fills_free_slots_then_goes_in_at_the_most_recently_used_end():
    cache = bound_lru(4)
    cache.admit(0, [1, 2])
    got = cache.admit_prefetch(0, [7, 8], frozenset())
    assert got.loads == [(7, 2), (8, 3)] and got.slots == {7: 2, 8: 3}  # the free slots
    assert cache.lru_order(0) == [1, 2, 7, 8]
    got = cache.admit_prefetch(0, [9], frozenset())
    assert got.loads == [(9, 0)]  # over the least recently used expert, 1
    assert cache.lru_order(0) == [2, 7, 8, 9]
    assert cache.admit(0, [9]).loads == []  # a hit now


def test_lru_prefetch_never_evicts_protected_experts_and_drops_what_does_not_fit():
    cache = bound_lru(3)
    cache.admit(0, [1, 2, 3])
    got = cache.admit_prefetch(0, [5, 6], frozenset({1, 2}))
    assert got.loads == [(5, 2)]  # only 3 (in slot 2) was unprotected; 6 is dropped, nothing else evicted
    assert sorted(cache.lru_order(0)) == [1, 2, 5]
    assert cache.admit_prefetch(0, [7], frozenset({1, 2, 5})) == Admission({}, [])
    assert cache.admit_prefetch(0, [1, 2], frozenset()) == Admission({}, [])  # resident already


def test_none_cannot_prefetch_and_says_so_once(capsys):
    engine = Engine(tiny_model(), cache=NoCache(), device="cpu")
    engine.generate(PROMPT, max_new_tokens=1)
    free = [e for e in range(engine.spec.num_experts) if e not in engine.runtime.slot_expert[0]]
    assert engine.runtime.prefetch(0, free[:2]) == 0
    assert engine.runtime.prefetch(1, free[:1] or [0]) == 0
    err = capsys.readouterr().err
    assert err.count("cannot prefetch") == 1 and "cache 'none'" in err
    assert engine.runtime.stats.prefetch_issued == 0


def test_full_has_everything_and_copies_nothing():
    engine = Engine(tiny_model(), cache=FullCache(), device="cpu")
    assert engine.runtime.prefetch(2, list(range(engine.spec.num_experts))) == 0
    assert (engine.runtime.arriving() == 0.0).all()


def test_prefetch_checks_its_arguments():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu")
    with pytest.raises(ValueError, match="layer 9"):
        engine.runtime.prefetch(9, [0])
    with pytest.raises(ValueError, match="expert 99"):
        engine.runtime.prefetch(0, [99])


# ------------------------------------------------------------------------------------ the runtime's checks


class Evicting(LRUCache):
    """Answers a prefetch with whatever admission it is given (to test the runtime's check)."""

    name = "evicting"
    answer: object = None

    def admit_prefetch(self, layer, candidates, protected):  # noqa: ANN001, ANN201
        return self.answer(layer, candidates, protected, self)


@pytest.mark.parametrize("answer, message", [
    (lambda layer, c, p, cache: Admission({c[0]: cache._lru[layer][next(iter(p))]},
                                          [(c[0], cache._lru[layer][next(iter(p))])]), "in flight or needed"),
    (lambda layer, c, p, cache: Admission({c[0]: 7}, [(c[0], 7)]), "outside 0..2"),
    (lambda layer, c, p, cache: Admission({1: 0}, [(1, 0)]), "not a candidate"),
    (lambda layer, c, p, cache: Admission({c[0]: 0}, []), "slots and loads differ"),
    (lambda layer, c, p, cache: [(c[0], 0)], "expected an Admission"),
])
def test_a_policy_breaking_the_prefetch_contract_is_refused_and_copies_nothing(answer, message):
    cache = Evicting(capacity=3)
    engine = Engine(tiny_model(), cache=cache, copy="emulated", link=LinkSettings(latency_us=1.0), device="cpu")
    engine.generate(PROMPT, max_new_tokens=1)
    runtime = engine.runtime
    layer = 1
    resident = [int(e) for e in runtime.slot_expert[layer]]
    absent = [e for e in range(runtime.spec.num_experts) if e not in resident and e != 1]
    # make one expert "in flight": a real prefetch through LRU's own admission, on a link so slow
    # that it is still travelling when the broken admissions below are asked
    runtime.copy_engine.latency_us = 60e6
    cache.answer = lambda layer, c, p, self: LRUCache.admit_prefetch(self, layer, c[:1], p)
    assert runtime.prefetch(layer, absent[:1]) == 1
    if 1 in runtime.slot_expert[layer]:
        pytest.skip("expert 1 happens to be resident")  # the 'not a candidate' case needs it absent
    before = runtime.slots[layer].clone(), runtime.slot_expert[layer].copy(), runtime.stats.prefetch_issued
    cache.answer = answer
    with pytest.raises(PluginError, match=rf"cache 'evicting' \(admit_prefetch\): layer 1: .*{message}"):
        runtime.prefetch(layer, absent[1:3])
    assert torch.equal(runtime.slots[layer], before[0])
    assert (runtime.slot_expert[layer] == before[1]).all() and runtime.stats.prefetch_issued == before[2]


class Fuzzed(LRUCache):
    """A random policy: half its prefetch answers evict a random slot (protected or not, in range or
    not) without telling its own bookkeeping, the other half are LRU's."""

    name = "fuzzed"

    def __init__(self, capacity: int, seed: int) -> None:
        super().__init__(capacity=capacity)
        self.rng = random.Random(seed)

    def admit_prefetch(self, layer, candidates, protected):  # noqa: ANN001, ANN201
        if self.rng.random() < 0.5:
            return super().admit_prefetch(layer, candidates, protected)
        slot = self.rng.randrange(self.capacity + 1)
        victim = next((e for e, s in self._lru[layer].items() if s == slot), None)
        if slot < self.capacity and (victim is None or victim not in protected):
            # a legal answer: keep the policy's own view true
            if victim is None:
                self._free[layer].remove(slot)
            else:
                del self._lru[layer][victim]
            self._lru[layer][candidates[0]] = slot
        return Admission({candidates[0]: slot}, [(candidates[0], slot)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eviction_safety_under_a_fuzzed_policy(seed):
    """Refused admissions never touch a slot: the output equals the loop reference's and HF's."""
    reference = Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu", expert_compute="loop")
    expected = reference.generate(PROMPT, max_new_tokens=10).token_ids
    assert expected == hf_greedy(PROMPT, 10)
    engine = Engine(tiny_model(), cache=Fuzzed(3, seed), device="cpu")
    refusals: list[str] = []
    engine.runtime.add_layer_listener(random_prefetcher(engine.runtime, seed, refusals))
    out = engine.generate(PROMPT, max_new_tokens=10)
    assert out.token_ids == expected
    assert refusals and all(r.startswith("cache 'fuzzed' (admit_prefetch)") for r in refusals)
    assert any("in flight or needed" in r for r in refusals)
    stats = engine.runtime.stats
    assert stats.prefetch_issued > 0
    assert stats.prefetch_used + stats.prefetch_wasted <= stats.prefetch_issued


# ------------------------------------------------------------------------------------ identical output


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("copy", ["torch", "emulated", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_random_prefetches_never_change_the_output(cache, copy):
    expected = hf_greedy(PROMPT, 12)
    engine = Engine(tiny_model(), cache=CACHES[cache](), copy=copy, link=LinkSettings(latency_us=1.0), device="cpu")
    engine.runtime.add_layer_listener(random_prefetcher(engine.runtime, seed=len(cache) + len(copy)))
    out = engine.generate(PROMPT, max_new_tokens=12)
    assert out.token_ids == expected
    stats = out.stats
    assert (stats["prefetch_issued"] > 0) == (cache == "lru")
    assert stats["prefetch_used"] + stats["prefetch_wasted"] <= engine.runtime.stats.prefetch_issued
    arriving = engine.runtime.arriving()
    assert ((arriving == 0.0) | np.isinf(arriving) | (arriving > 0)).all()


def test_random_prefetches_during_tree_verification():
    from drafters import ScriptedDrafter

    expected = hf_greedy(PROMPT, 16)
    drafter = ScriptedDrafter(PROMPT + expected, vocab=256, branching=3, depth=3)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), copy="emulated", link=LinkSettings(latency_us=1.0),
                    drafter=drafter, device="cpu")
    engine.runtime.add_layer_listener(random_prefetcher(engine.runtime, seed=5))
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == expected
