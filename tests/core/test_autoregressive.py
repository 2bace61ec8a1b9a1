"""Autoregressive decoding through the offloaded runtime is token-identical to HF generate."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, TRITON_ON_CPU, tiny_model

from specfit import Engine
from specfit.offload.copy.emulated import EmulatedLinkEngine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.types.link_profiles import LinkSettings
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_matches_hf_generate(arch, cache):
    reference = hf_greedy(tiny_model(arch), PROMPT, 24)
    engine = Engine(tiny_model(arch), cache=CACHES[cache](), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == reference
    stats = out.stats
    assert stats["num_output_tokens"] == 24
    assert stats["spec_decode_acceptance_length"] == 1.0
    if cache == "full":
        assert stats["expert_cache_misses"] == 0
    else:
        assert stats["expert_cache_misses"] > 0


@pytest.mark.parametrize("copy", [pytest.param("triton", marks=TRITON_ON_CPU), "emulated"])
def test_greedy_identical_through_every_copy_engine(copy):
    reference = hf_greedy(tiny_model(), PROMPT, 12)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=2), copy=copy, link=LinkSettings(latency_us=1.0), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=12)
    assert out.token_ids == reference
    assert out.stats["h2d_emulated"] == (copy == "emulated")


def test_union_larger_than_slots_is_streamed_through_them():
    """Prefill of a long prompt needs nearly every expert; two slots must still compute it exactly."""
    model = tiny_model()
    prompt = list(range(3, 60))
    reference = hf_greedy(tiny_model(), prompt, 6)
    engine = Engine(model, cache=NoCache(capacity=2), device="cpu")
    assert engine.generate(prompt, max_new_tokens=6).token_ids == reference


def test_bfloat16_model_runs_in_its_dtype():
    model = tiny_model(dtype=torch.bfloat16)
    reference = hf_greedy(tiny_model(dtype=torch.bfloat16), PROMPT, 8)
    engine = Engine(model, cache=LRUCache(capacity=4), device="cpu", numerics="native")  # bf16 throughout, as HF
    assert engine.runtime.stores[0].dtype == torch.bfloat16
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == reference


def test_emulated_link_charges_reference_expert_time():
    link = LinkSettings(bandwidth_gbps=10.0, latency_us=0.0, ref_expert_bytes=1_000_000)
    engine = Engine(tiny_model(), cache=NoCache(), copy=EmulatedLinkEngine(TorchCopyEngine("cpu"), link), device="cpu")
    stats = engine.generate(PROMPT, max_new_tokens=4).stats
    assert stats["h2d_seconds"] == pytest.approx(stats["expert_cache_misses"] * 1e-4, rel=1e-6)
