"""The example plugin's own tests: `pytest` in docs/example-plugin (specfit's CI runs them as they are).

They need specfit but not this package installed: an uninstalled package is registered in code with
``specfit.register_plugin``, which does nothing more once its entry point has loaded it. Like the
plugin, they import nothing of specfit's but ``specfit.interfaces`` and the root ``specfit``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import specfit
import specfit_fifo_cache

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module", autouse=True)
def fifo_registered():
    specfit.register_plugin(specfit_fifo_cache, "fifo_cache")


def test_the_cache_is_registered_under_its_name():
    cfg = specfit.compose(["model=tiny", "cache=fifo", "cache.capacity=2"])
    assert OmegaConf.get_type(cfg.cache) is specfit_fifo_cache.FIFOCacheConfig  # its Config, under `cache.`
    assert cfg.cache.capacity == 2


def test_greedy_output_is_the_models_own():
    """Lossless: through a small FIFO cache (most experts copied in, some evicted), greedy decoding
    gives the tokens the unmodified model's own `generate` gives."""
    cfg = specfit.compose(["model=tiny", "cache=fifo", "cache.capacity=2", "max_new_tokens=8"])
    engine = specfit.build(cfg)
    assert engine.info["cache"] == "fifo"
    out = engine.generate(PROMPT)
    model = specfit.build_builtin("tiny-qwen3-moe", seed=0, dtype=torch.float32)  # the same seeded weights
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.token_ids == expected[0, len(PROMPT):].tolist()
    assert out.stats["expert_cache_misses"] > 0


def test_the_oldest_expert_is_evicted_first():
    spec = type("Spec", (), {"num_layers": 1, "num_experts": 8, "top_k": 2})()
    cache = specfit_fifo_cache.FIFOCache(capacity=3)
    assert cache.bind(spec) == 3
    cache.admit(0, [0, 1, 2])
    cache.admit(0, [1])  # a hit does not refresh its age (unlike LRU)
    admission = cache.admit(0, [5])
    assert admission.loads == [(5, 0)]  # expert 0, loaded first, gave up slot 0
    np.testing.assert_array_equal(np.flatnonzero(cache.resident()[0]), [1, 2, 5])
