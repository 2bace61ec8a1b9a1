"""The GPU path: pinned host store, copy stream, Triton zero-copy kernel (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model

from specfit import Engine
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("copy", ["torch", "triton"])
def test_greedy_on_cuda_matches_hf_generate_on_cuda(arch, cache, copy):
    reference_model = tiny_model(arch).to("cuda")
    with torch.no_grad():
        ref = reference_model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                       do_sample=False)[0, len(PROMPT):].tolist()
    engine = Engine(tiny_model(arch), cache=CACHES[cache](), copy=copy, device="cuda")
    assert engine.runtime.store.pinned  # (cache=full then drops the host copy: the slots hold it)
    assert engine.runtime.slots[0].is_cuda
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref


@pytest.mark.parametrize("copy", ["torch", "triton"])
def test_tree_verification_on_cuda(copy):
    from drafters import ScriptedDrafter

    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    with torch.no_grad():
        ref = tiny_model().to("cuda").generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=24,
                                                min_new_tokens=24, do_sample=False)[0].tolist()
    for drafter in (ScriptedDrafter(ref, vocab=256, branching=3, depth=3), Eagle3Drafter(top_k=3, depth=3, total_tokens=8)):
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), copy=copy, drafter=drafter, device="cuda")
        assert engine.generate(PROMPT, max_new_tokens=24).token_ids == ref[len(PROMPT):]
