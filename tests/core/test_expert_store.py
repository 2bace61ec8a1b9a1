"""The experts' host store: canonical rows, part writes, what is missing, from modules, pinning, one copy."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_model
from test_expert_compute import Holder, gpt_oss_experts

from specfit import Engine
from specfit.offload.store import HostExpertStore, canonical
from specfit.types.moe import ExpertLayout, row_parts
from specfit.offload.discovery import find_experts, moe_spec
from specfit.errors import ModelError
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache

PROMPT = list(range(3, 40))


def spec(bias: bool = False, dtype: torch.dtype = torch.float32):
    return dataclasses.replace(moe_spec(tiny_model()), dtype=dtype, layout=ExpertLayout(bias=bias))


def test_expert_numel_counts_biases():
    plain, biased = spec(), spec(bias=True)
    i, h = plain.intermediate_size, plain.hidden_size
    assert plain.expert_numel == 3 * i * h
    assert biased.expert_numel == 3 * i * h + 2 * i + h
    assert list(row_parts(biased)) == ["gate_up", "down", "gate_up_bias", "down_bias"]


def test_writes_land_in_canonical_rows_and_missing_lists_the_rest():
    s = spec(dtype=torch.bfloat16)
    store = HostExpertStore(s)
    i, h = s.intermediate_size, s.hidden_size
    gate, up = torch.randn(i, h), torch.randn(i, h)
    down = torch.randn(s.num_experts, h, i)
    store.write(1, 3, "gate", gate)
    store.write(1, 3, "up", up)
    store.write(1, slice(None), "down", down)  # a stack: every expert of the layer
    row = store.layers[1][3]
    assert row.dtype == torch.bfloat16
    assert torch.equal(row[:2 * i * h].view(2 * i, h), torch.cat((gate, up)).bfloat16())
    assert torch.equal(row[2 * i * h:].view(h, i), down[3].bfloat16())
    missing = store.missing()
    assert "layer 1 expert 3 gate" not in missing and "layer 1 expert 3 down" not in missing
    assert "layer 1 expert 4 up" in missing and "layer 0 expert 0 gate" in missing
    assert len(missing) == s.num_layers * s.num_experts * 3 - 2 - s.num_experts
    assert store.missing(limit=2) == ["layer 0 expert 0 gate", "layer 0 expert 0 up"]
    store.write(2, slice(0, 4), "gate_up", torch.randn(4, 2 * i, h))
    assert "layer 2 expert 3 up" not in store.missing() and "layer 2 expert 4 up" in store.missing()
    assert store.nbytes == s.num_layers * s.num_experts * s.expert_numel * 2


def test_bad_writes_are_model_errors_naming_layer_part_and_shape():
    s = spec()
    store = HostExpertStore(s)
    with pytest.raises(ModelError, match=r"expert store layer 2 down: got shape \[3, 4\], expected \[64, 32\]"):
        store.write(2, 0, "down", torch.zeros(3, 4))
    with pytest.raises(ModelError, match=r"expert store layer 0 gate: got shape \[32, 64\], expected \[2, 32, 64\]"):
        store.write(0, slice(0, 2), "gate", torch.zeros(32, 64))
    with pytest.raises(ModelError, match=r"layer 0: unknown part 'gate_up_bias'"):
        store.write(0, 0, "gate_up_bias", torch.zeros(64))
    with pytest.raises(ModelError, match=r"layer 9 is outside 0..3"):
        store.write(9, 0, "down", torch.zeros(64, 32))
    with pytest.raises(ModelError, match=r"expert 16 is outside 0..15"):
        store.write(0, 16, "down", torch.zeros(64, 32))


def test_from_modules_copies_and_frees_the_weights():
    model = tiny_model()
    reference = copy.deepcopy(model)
    experts = find_experts(model)
    s = moe_spec(model, experts)
    store = HostExpertStore.from_modules(experts, s)
    assert store.missing() == []
    split = 2 * s.intermediate_size * s.hidden_size
    for layer, (_, ref) in enumerate(find_experts(reference)):
        assert torch.equal(store.layers[layer][:, :split], ref.gate_up_proj.detach().reshape(s.num_experts, -1))
        assert torch.equal(store.layers[layer][:, split:], ref.down_proj.detach().reshape(s.num_experts, -1))
    assert all(module.gate_up_proj.is_meta and module.down_proj.is_meta for _, module in experts)


def test_from_modules_normalises_gpt_oss_transposed_interleaved_layout():
    module = gpt_oss_experts()
    reference = copy.deepcopy(module)
    model = Holder([module])
    s = moe_spec(model)
    store = HostExpertStore.from_modules(find_experts(model), s)
    assert store.missing() == []
    parts = row_parts(s)
    row = store.layers[0][5]

    def part(name):  # noqa: ANN001, ANN202
        offset, shape = parts[name]
        return row[offset:offset + int(torch.tensor(shape).prod())].view(shape)

    gate_up = reference.gate_up_proj[5].detach().T  # [2I, H], gate/up interleaved
    assert torch.equal(part("gate_up"), torch.cat((gate_up[0::2], gate_up[1::2])))
    assert torch.equal(part("down"), reference.down_proj[5].detach().T)
    bias = reference.gate_up_proj_bias[5].detach()
    assert torch.equal(part("gate_up_bias"), torch.cat((bias[0::2], bias[1::2])))
    assert torch.equal(part("down_bias"), reference.down_proj_bias[5].detach())
    assert torch.equal(canonical("gate_up_bias", bias, interleaved=True), part("gate_up_bias"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here: the fallback cannot be seen")
def test_pinning_that_fails_warns_once_and_falls_back(capsys):
    store = HostExpertStore(spec(), pin=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specfit: warning: the host expert store is not pinned")
    assert not store.pinned and not store.layers[0].is_pinned()
    HostExpertStore(spec(), pin=False)  # no pinning asked: no warning
    assert capsys.readouterr().err == ""


def test_pinning_that_fails_part_way_leaves_the_store_unpinned(capsys, monkeypatch):
    """Pinned memory running out after some layers: the store is not ``pinned`` (the rest are
    pageable), one warning says so."""
    empty, calls = torch.empty, []

    def runs_out(*args, pin_memory=False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if pin_memory:
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("out of pinned memory")
            return empty(*args, **kwargs)  # stands in for a pinned allocation
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", runs_out)
    store = HostExpertStore(spec(), pin=True)
    assert len(calls) == 3 and not store.pinned
    assert capsys.readouterr().err.count("not pinned") == 1


def test_the_triton_engine_on_cuda_refuses_a_store_not_pinned_throughout():
    from specfit.offload.copy.emulated import EmulatedLinkEngine
    from specfit.offload.checks import check_store_readable
    from specfit.errors import ConfigError

    class Triton:
        name = "triton"

    store = HostExpertStore(spec())  # pageable
    for engine in (Triton(), EmulatedLinkEngine(Triton())):
        with pytest.raises(ConfigError, match=r"cache.copy=triton .* 4 of its 4 layers are not pinned"):
            check_store_readable(engine, store, torch.device("cuda"))
    check_store_readable(Triton(), store, torch.device("cpu"))  # the interpreter on a CPU reads any memory


def test_full_cache_keeps_the_experts_in_slots_only():
    model = tiny_model()
    engine = Engine(model, cache=FullCache(), device="cpu")
    s, rt = engine.spec, engine.runtime
    assert rt.store.nbytes == 0 and engine.info["expert_host_bytes"] == 0
    assert engine.info["expert_device_bytes"] == s.num_layers * s.num_experts * s.expert_bytes
    assert 0 < engine.info["dense_device_bytes"] < s.num_layers * s.num_experts * s.expert_bytes


def test_lru_cache_holds_the_store_and_its_slots():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), device="cpu")
    s = engine.spec
    assert engine.info["expert_host_bytes"] == s.num_layers * s.num_experts * s.expert_bytes
    assert engine.info["expert_device_bytes"] == s.num_layers * 4 * s.expert_bytes


def test_a_given_store_replaces_meta_experts_without_reading_them():
    """What the loader does: the experts go straight into a store, the model's experts modules stay meta."""
    source = tiny_model()
    expected = Engine(copy.deepcopy(source), cache=LRUCache(capacity=4), device="cpu").generate(PROMPT, 6).token_ids
    experts = find_experts(source)
    store = HostExpertStore.from_modules(experts, moe_spec(source, experts))  # leaves the modules on meta
    engine = Engine(source, cache=LRUCache(capacity=4), device="cpu", expert_store=store)
    assert engine.generate(PROMPT, 6).token_ids == expected


def test_a_store_of_other_shapes_is_refused():
    model = tiny_model()
    other = HostExpertStore(dataclasses.replace(moe_spec(model), num_experts=8))
    with pytest.raises(ModelError, match="expert store: num_experts 8 does not match the model's 16"):
        Engine(model, device="cpu", expert_store=other)


def test_a_bf16_store_under_a_float32_model_computes_in_float32():
    """numerics=exact: the store (and slots) keep the checkpoint's bf16, the spec reports it."""
    model = tiny_model()
    experts = find_experts(model)
    s = dataclasses.replace(moe_spec(model, experts), dtype=torch.bfloat16)
    store = HostExpertStore.from_modules(experts, s)
    engine = Engine(model, cache=LRUCache(capacity=4), device="cpu", expert_store=store)
    assert engine.spec.dtype == torch.bfloat16 and engine.runtime.slots[0].dtype == torch.bfloat16
    assert len(engine.generate(PROMPT, 4).token_ids) == 4
