"""Expert-cache invariants, checked on real decoding through the offloaded runtime."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model

from specfit import Engine
from specfit.offload.discovery import moe_spec
from specfit.errors import ConfigError, ModelError, PluginError
from specfit.interfaces import Admission
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


class Recording(LRUCache):
    """LRU that checks residency never exceeds capacity after every admission."""

    name = "lru"

    def admit(self, layer, wanted):
        admission = super().admit(layer, wanted)
        assert self.resident().sum(axis=1).max() <= self.capacity
        return admission


@pytest.mark.parametrize("capacity", [2, 3, 7])
def test_lru_counters_and_capacity(capacity):
    engine = Engine(tiny_model(), cache=Recording(capacity=capacity), device="cpu")
    runtime = engine.runtime
    engine.generate(PROMPT, max_new_tokens=16)
    s = runtime.stats
    assert s.hits + s.misses == int(s.union_sum.sum())  # every distinct expert request is a hit or a miss
    assert s.h2d_bytes == s.misses * runtime.spec.expert_bytes
    assert runtime.resident().sum(axis=1).max() <= capacity
    # the resident map agrees with the slots' contents
    for layer in range(runtime.spec.num_layers):
        assert set(np.flatnonzero(runtime.resident()[layer])) == set(runtime.slot_expert[layer][runtime.slot_expert[layer] >= 0])


def test_lru_evicts_least_recently_used():
    spec = moe_spec(tiny_model())
    cache = LRUCache(capacity=3)
    cache.bind(spec)
    cache.admit(0, [1, 2, 3])
    cache.admit(0, [1])  # 1 is now the most recent; 2 the least
    a = cache.admit(0, [4])
    assert a.loads == [(4, a.slots[4])]
    assert cache.lru_order(0) == [3, 1, 4]
    assert cache.admit(0, [3, 4]).loads == []


def test_lru_admits_in_rounds_when_union_exceeds_capacity():
    spec = moe_spec(tiny_model())
    cache = LRUCache(capacity=2)
    cache.bind(spec)
    first = cache.admit(0, [0, 1, 2, 3, 4])
    assert len(first.slots) == 2
    second = cache.admit(0, [2, 3, 4])
    assert set(second.slots) == {2, 3} and len(second.loads) == 2


def test_none_cache_copies_every_expert_every_pass():
    engine = Engine(tiny_model(), cache=NoCache(), device="cpu")
    engine.generate(PROMPT, max_new_tokens=8)
    s = engine.runtime.stats
    assert s.hits == 0 and s.misses == int(s.union_sum.sum())
    assert not engine.runtime.resident().any()


def test_full_cache_preloads_everything():
    engine = Engine(tiny_model(), cache=FullCache(), device="cpu")
    spec = engine.spec
    assert engine.runtime.stats.preload_bytes == spec.num_layers * spec.num_experts * spec.expert_bytes
    engine.generate(PROMPT, max_new_tokens=8)
    assert engine.runtime.stats.misses == 0 and engine.runtime.resident().all()


def test_capacity_below_top_k_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"cache.capacity=1 is below the model's top-k \(2\)"):
        Engine(tiny_model(), cache=LRUCache(capacity=1), device="cpu")


def test_capacity_bytes_gives_experts_per_layer():
    spec = moe_spec(tiny_model())
    cache = LRUCache(capacity_bytes=5 * spec.expert_bytes * spec.num_layers + 7)
    assert cache.bind(spec) == 5
    with pytest.raises(ConfigError, match="not both"):
        LRUCache(capacity=4, capacity_bytes=10**9).bind(spec)


def test_model_without_moe_is_a_clear_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ModelError, match="no MoE experts module"):
        Engine(dense, device="cpu")


class LyingCache(LRUCache):
    """Claims an expert is resident without loading it: must be caught, never computed with."""

    name = "lru"

    def admit(self, layer, wanted):
        return Admission({wanted[0]: 0}, [])


def test_a_cache_that_lies_about_residency_is_caught():
    engine = Engine(tiny_model(), cache=LyingCache(capacity=2), device="cpu")
    with pytest.raises(PluginError, match="claims expert .* is resident"):
        engine.generate(PROMPT, max_new_tokens=2)
