"""Engines over one load of the model (the bench's methods side by side): one host store of the
experts that every engine reads, each engine with its own dense weights, outputs as if each had
loaded the model itself."""

from __future__ import annotations

import json

import pytest
import torch

import specfit
from specfit.api import load_shared_target
from specfit.cli import main
from specfit.offload.layer import OffloadedExperts
from specfit.errors import ConfigError

PROMPT = [5, 17, 99, 3, 42]


def _config(*overrides: str):
    return specfit.compose(["model=tiny", "cache.copy=torch", *overrides])


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_engines_over_a_shared_target_decode_as_their_own_loads() -> None:
    lru, full = _config("cache=lru", "cache.capacity=2"), _config("cache=full")
    shared = load_shared_target(lru)
    store = shared.expert_store
    engines = [specfit.build(cfg, calibrate_now=False, shared_target=shared) for cfg in (lru, full, lru)]
    assert all(e.runtime.store is store for e in engines)  # one host copy of the experts
    assert len({id(e.model) for e in engines}) == 3  # each its own dense weights (moved, hooked, upcast)
    # a full cache preloads every expert but keeps the store's layers (the other engines copy from
    # them), and its slots are its own (a slot pool written by a faulty cache must not be the store)
    assert store.shared and all(layer is not None for layer in store.layers)
    assert all(slots.data_ptr() != layer.data_ptr() for slots, layer in zip(engines[1].runtime.slots, store.layers))
    alone = specfit.build(lru, calibrate_now=False)  # a load of its own
    assert all(e.info["expert_store_shared"] for e in engines) and not alone.info["expert_store_shared"]
    expected = alone.generate(PROMPT, max_new_tokens=10).token_ids
    for engine in engines:
        assert engine.generate(PROMPT, max_new_tokens=10).token_ids == expected
    # the loaded model itself stays as loaded: no engine's experts modules or hooks in it
    assert not any(isinstance(m, OffloadedExperts) for m in shared.model.modules()) and _hooks(shared.model) == 0


def test_bench_loads_each_model_once(tmp_path, capsys, monkeypatch) -> None:
    import specfit.api

    loads = []
    real = specfit.api.load_target
    monkeypatch.setattr(specfit.api, "load_target", lambda cfg: loads.append(cfg.builtin) or real(cfg))
    main(["bench", "model=tiny", "methods=[ar,ar_prefetch,eagle3]", "prompt_ids=[5,17,99]", "max_new_tokens=4",
          "drafter.total_tokens=6", "drafter.top_k=3", "repeats=1", f"hydra.run.dir={tmp_path}"])
    assert "output tokens identical across methods: yes" in capsys.readouterr().out
    assert loads == ["tiny-qwen3-moe"]  # three methods, one load
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["ar", "ar_prefetch", "eagle3"]


def test_a_shared_target_serves_only_its_model_settings() -> None:
    shared = load_shared_target(_config())
    with pytest.raises(ConfigError, match="shared_target was loaded with model.seed=0, this config has model.seed=3"):
        specfit.build(_config("model.seed=3"), calibrate_now=False, shared_target=shared)


def test_a_shared_target_whose_model_an_engine_took_is_refused() -> None:
    """Handing the shared model to an Engine directly makes it that engine's (its experts modules
    point at a runtime); copying it for another engine would copy the runtime and the whole expert
    store with it. One line instead, and load_shared_target checks its config as build() does."""
    from specfit.api import Engine
    from specfit.errors import ModelError

    shared = load_shared_target(_config())
    Engine(shared.model, expert_store=shared.expert_store)
    with pytest.raises(ModelError, match="given to an Engine directly"):
        specfit.build(_config(), calibrate_now=False, shared_target=shared)
    with pytest.raises(ConfigError, match="load_shared_target\\(\\) takes the config specfit.compose\\(\\) returns"):
        load_shared_target({})


def test_a_streamed_checkpoint_shared_by_engines(tmp_path) -> None:
    """A checkpoint streamed from safetensors (how real models load: the experts straight into the
    loader's store) serves several engines through that store, each decoding as its own load does."""
    from conftest import tiny_model

    tiny_model().save_pretrained(tmp_path / "m")
    lru = specfit.compose([f"model.path={tmp_path / 'm'}", "model.builtin=null", "cache=lru", "cache.capacity=2",
                           "cache.copy=torch"])
    shared = load_shared_target(lru)
    assert shared.expert_store is not None and shared.expert_store.shared
    expected = specfit.build(lru, calibrate_now=False).generate(PROMPT, max_new_tokens=8).token_ids
    for _ in range(2):
        engine = specfit.build(lru, calibrate_now=False, shared_target=shared)
        assert engine.runtime.store is shared.expert_store
        assert engine.generate(PROMPT, max_new_tokens=8).token_ids == expected


def test_bench_shares_one_load_across_workloads(tmp_path, capsys, monkeypatch) -> None:
    """Two workloads, two methods: one load of the demo model; each workload's engines are dropped
    before the next workload's are built."""
    import gc

    import specfit.api
    from specfit.api import Engine

    loads, alive = [], []
    real = specfit.api.load_target
    monkeypatch.setattr(specfit.api, "load_target", lambda cfg: loads.append(cfg.path) or real(cfg))
    built = Engine.__init__

    def counting(self, *a, **k):  # engines alive as each is built
        gc.collect()
        alive.append(sum(type(o) is Engine for o in gc.get_objects()))
        built(self, *a, **k)

    monkeypatch.setattr(Engine, "__init__", counting)
    main(["bench", "model=demo", "workloads=[prose,gsm]", "methods=[ar,ar_prefetch]", "workload.num_prompts=1",
          "max_new_tokens=2", "repeats=1", "cache.capacity=8", f"hydra.run.dir={tmp_path}"])
    assert "all workloads together" in capsys.readouterr().out
    assert len(loads) == 1
    # counted as each is built, itself included: the first workload's two are gone when the second's are built
    assert alive == [1, 2, 1, 2]
