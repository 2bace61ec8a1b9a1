"""Streaming a checkpoint (issue 13, one copy of the weights): the same model as transformers' load.

A checkpoint directory is read tensor by tensor into a model built on the meta device (dense
weights) and a HostExpertStore (experts). Each layout a checkpoint may use is saved in miniature,
loaded both ways (streamed, and ``from_pretrained`` whose experts go through the store's
``from_modules``), and compared weight by weight, then by logits and greedy output through the
engine.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from safetensors.torch import load_file, save_file

from specfit import Engine
from specfit.model.config import ModelConfig
from specfit.offload.store import HostExpertStore
from specfit.model.checkpoint import load_checkpoint, stream_checkpoint
from specfit.model.loading import load_target
from specfit.offload.discovery import find_experts, moe_spec
from specfit.errors import ModelError
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache

DEMO = Path(__file__).resolve().parents[2] / "specfit" / "assets" / "demo" / "target"
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


def assert_same_weights(streamed: torch.nn.Module, store: HostExpertStore, reference: torch.nn.Module) -> None:
    """Every dense parameter and buffer equal (values and dtype), every expert row equal to the store
    ``from_modules`` makes of the reference (which frees the reference copy's experts)."""
    mine = dict(streamed.named_parameters(remove_duplicate=False)) | dict(streamed.named_buffers())
    ref_experts = find_experts(reference)
    expert_names = {name for name, _ in ref_experts}
    checked = 0
    for name, tensor in [*reference.named_parameters(remove_duplicate=False), *reference.named_buffers()]:
        if name.rpartition(".")[0] in expert_names:
            continue
        assert name in mine, name
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name
        checked += 1
    assert checked > 5
    expected = HostExpertStore.from_modules(ref_experts, moe_spec(reference, ref_experts))
    assert store.missing() == []
    assert len(store.layers) == len(expected.layers)
    for got, want in zip(store.layers, expected.layers):
        assert got.dtype == want.dtype and torch.equal(got, want)


def engine_run(model: torch.nn.Module, store: HostExpertStore | None, n: int = 12):
    """(prefill logits, greedy tokens) through the offloaded runtime."""
    engine = Engine(model, expert_store=store, cache=LRUCache(capacity=4), device="cpu", ignore_eos=True)
    with torch.inference_mode():
        logits = engine.target.prefill(PROMPT).logits.clone()
    return logits, engine.generate(PROMPT, max_new_tokens=n).token_ids


def both_ways(path: Path, dtype: str = "float32", attn: str = "sdpa"):
    streamed, store = stream_checkpoint(str(path), dtype, attn, numerics="native", device="cpu")
    reference = load_checkpoint(str(path), dtype, attn)
    return streamed, store, reference


# ----------------------------------------------------------------------------- the same model


def test_demo_target_streams_to_the_same_model_as_from_pretrained():
    """Shipped in bf16 and loaded as float32: weights, buffers (rotary), the tied head, logits, greedy."""
    streamed, store, reference = both_ways(DEMO)
    assert streamed.lm_head.weight is streamed.model.embed_tokens.weight  # tie_word_embeddings
    assert store.spec.dtype == torch.float32
    assert not any(p.is_meta for n, p in streamed.named_parameters() if ".experts." not in n)
    ref_logits, ref_tokens = engine_run(copy.deepcopy(reference), None)
    assert_same_weights(streamed, store, reference)
    logits, tokens = engine_run(streamed, store)
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens


def save_tiny(arch: str, path: Path, shard: bool) -> torch.nn.Module:
    model = tiny_model(arch)
    model.save_pretrained(path, max_shard_size="60KB" if shard else "5GB")
    return model


@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_families_stream_to_the_same_model(arch, shard, tmp_path):
    """Per-expert keys as transformers 5 saves them (``experts.N.gate_proj`` / Mixtral's
    ``block_sparse_moe.experts.N.w1``), one file and sharded through the index."""
    model = save_tiny(arch, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    if arch == "tiny-mixtral":
        keys = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) if shard else \
            set(load_file(str(tmp_path / "model.safetensors")))
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys
    streamed, store, reference = both_ways(tmp_path)
    assert_same_weights(streamed, store, reference)
    logits, tokens = engine_run(streamed, store)
    ref_logits, ref_tokens = engine_run(tiny_model(arch), None)
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    del model


def test_fused_expert_keys_as_transformers_modules_hold_them(tmp_path):
    """``experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (the module's own state dict)."""
    model = save_tiny("tiny-qwen3-moe", tmp_path, shard=False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    streamed, store, _ = both_ways(tmp_path)
    assert_same_weights(streamed, store, tiny_model("tiny-qwen3-moe"))


def test_gpt_oss_fused_transposed_interleaved_experts_with_biases(tmp_path):
    """gpt-oss bf16: ``gate_up_proj [E, H, 2I]`` with gate/up interleaved, ``down_proj [E, I, H]``,
    their biases; the store gets canonical rows (gate rows first, [out, in])."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, layer_types=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():  # random biases too (transformers initialises them to zero)
        torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp_path)
    streamed, store, reference = both_ways(tmp_path, "auto", "eager")  # gpt-oss's attention sinks
    assert store.spec.layout.bias and store.spec.dtype == torch.bfloat16
    experts = reference.model.layers[1].mlp.experts
    row = store.layers[1][2]  # layer 1, expert 2, checked against the module by hand
    i, h = 16, 32
    gate_up = row[: 2 * i * h].view(2 * i, h)
    assert torch.equal(gate_up[:i], experts.gate_up_proj[2][:, 0::2].T)
    assert torch.equal(gate_up[i:], experts.gate_up_proj[2][:, 1::2].T)
    down = row[2 * i * h: 3 * i * h].view(h, i)
    assert torch.equal(down, experts.down_proj[2].T)
    bias = row[3 * i * h:]
    assert torch.equal(bias[:i], experts.gate_up_proj_bias[2][0::2]) and torch.equal(bias[2 * i:], experts.down_proj_bias[2])
    assert_same_weights(streamed, store, reference)


def test_deepseek_v3_bf16_shared_experts_and_its_float32_router(tmp_path):
    """DeepSeek-V3 in bf16: a dense first layer, shared experts beside the routed ones, and the router
    (``gate.weight``, ``e_score_correction_bias``) kept in float32 as transformers' strict plan says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp_path)
    streamed, store, reference = both_ways(tmp_path, "auto")
    assert streamed.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert store.spec.dtype == torch.bfloat16 and store.spec.num_layers == 2
    ref_logits, ref_tokens = engine_run(copy.deepcopy(reference), None, n=8)
    assert_same_weights(streamed, store, reference)
    logits, tokens = engine_run(streamed, store, n=8)
    assert torch.equal(logits, ref_logits) and tokens == ref_tokens


def test_base_model_dtype_and_numerics_at_load(tmp_path):
    """The demo (bf16 on disk) loaded auto: bf16 experts; exact: dense weights float32 with the bf16 values."""
    native, native_store = stream_checkpoint(str(DEMO), "auto", numerics="native", device="cpu")
    exact, exact_store = stream_checkpoint(str(DEMO), "auto", numerics="exact", device="cpu")
    assert native_store.spec.dtype == exact_store.spec.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(native_store.layers, exact_store.layers))
    assert native.model.norm.weight.dtype == torch.bfloat16
    assert exact.model.norm.weight.dtype == torch.float32
    assert torch.equal(exact.model.norm.weight, native.model.norm.weight.float())
    assert exact.lm_head.weight is exact.model.embed_tokens.weight


# ----------------------------------------------------------------------------- strict loading


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model().save_pretrained(path)
    return path


def broken(saved: Path, tmp_path: Path, change) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "lacks tensors the config needs: model.layers.1.mlp.experts expert 3 up"),
    (lambda s: s.pop("model.layers.2.self_attn.q_proj.weight"),
     "lacks tensors the config needs: model.layers.2.self_attn.q_proj.weight"),
    (lambda s: s.update({"model.layers.0.mlp.experts.0.extra_proj.weight": torch.zeros(2)}),
     "has tensors the config does not use: model.layers.0.mlp.experts.0.extra_proj.weight"),
    (lambda s: s.update({"model.layers.0.mlp.experts.16.up_proj.weight": torch.zeros(32, 64)}),
     "model.layers.0.mlp.experts.16.up_proj.weight is expert 16, the config implies 16 experts"),
    (lambda s: s.update({"model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(64, 16)}),
     "model.layers.0.mlp.experts.2.down_proj.weight has shape (64, 16) in the checkpoint, the config implies (64, 32)"),
])
def test_strict_loading_names_the_tensor(saved, tmp_path, change, message):
    d = broken(saved, tmp_path, change)
    with pytest.raises(ModelError) as info:
        stream_checkpoint(str(d), device="cpu")
    assert message in str(info.value) and f"model.path={d}" in str(info.value)
    assert "\n" not in str(info.value)


def test_checkpoint_with_untouched_extras_transformers_ignores(saved, tmp_path):
    """A non-persistent buffer (``rotary_emb.inv_freq``, in old checkpoints) is skipped, as transformers does."""
    d = broken(saved, tmp_path, lambda s: s.update({"model.rotary_emb.inv_freq": torch.ones(8)}))
    model, _ = stream_checkpoint(str(d), device="cpu")
    assert not torch.equal(model.model.rotary_emb.inv_freq, torch.ones(8))


def test_bin_checkpoint_falls_back_to_from_pretrained_saying_so(tmp_path, capsys):
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    loaded = load_target(ModelConfig(path=str(tmp_path), device="cpu"))
    assert "no safetensors files" in capsys.readouterr().err
    assert loaded.expert_store is None
    assert not any(p.is_meta for p in loaded.model.parameters())
    assert Engine(loaded.model, cache=FullCache(), device="cpu").generate(PROMPT, max_new_tokens=6).token_ids == \
        Engine(tiny_model(), cache=FullCache(), device="cpu").generate(PROMPT, max_new_tokens=6).token_ids


def test_load_target_hands_the_store_to_build(saved):
    """specfit.build passes the loader's store to the engine: the experts modules never held weights."""
    import specfit

    engine = specfit.build(specfit.compose([f"model.path={saved}", "model.device=cpu", "cache=full"]))
    assert engine.info["expert_host_bytes"] + engine.info["expert_device_bytes"] > 0
    ref = Engine(tiny_model(), cache=FullCache(), device="cpu")
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == ref.generate(PROMPT, max_new_tokens=8).token_ids


def test_reads_tensor_by_tensor_never_a_state_dict(saved, monkeypatch):
    """Each tensor is read once, by name; no whole-file reader (load_file, safe_open's mmap) is used."""
    import safetensors
    import safetensors.torch

    from specfit.model.streaming import SafetensorsReader

    def refuse(*args, **kwargs):
        raise AssertionError("a whole-file or mapped read")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    reads: list[str] = []
    real_get = SafetensorsReader.get
    monkeypatch.setattr(SafetensorsReader, "get", lambda self, name: reads.append(name) or real_get(self, name))
    model, store = stream_checkpoint(str(saved), device="cpu")
    names = SafetensorsReader([saved / "model.safetensors"], "x").names()
    assert sorted(reads) == sorted(names) and len(set(reads)) == len(reads)
    assert store.missing() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_weights_land_on_the_gpu_and_the_store_is_pinned():
    model, store = stream_checkpoint(str(DEMO), "float32", numerics="exact", device="cuda")
    assert all(p.device.type == "cuda" for n, p in model.named_parameters() if ".experts." not in n)
    assert store.pinned and all(t.is_pinned() for t in store.layers)
    engine = Engine(model, expert_store=store, cache=LRUCache(capacity=8), device="cuda", ignore_eos=True)
    cpu_model, cpu_store = stream_checkpoint(str(DEMO), "float32", device="cpu")
    _, reference = engine_run(cpu_model, cpu_store)
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == reference


def test_a_hub_id_streams_from_its_snapshot(saved, monkeypatch):
    """``model.path=org/name``: the hub's snapshot (here a stand-in directory) is streamed like a local one."""
    import huggingface_hub

    import specfit.model.sources

    monkeypatch.setattr(specfit.model.sources, "hub_reachable", lambda: True)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns=None, **kw: asked.append((repo, allow_patterns)) or str(saved))
    loaded = load_target(ModelConfig(path="someorg/tiny-moe", device="cpu"))
    assert asked and asked[0][0] == "someorg/tiny-moe" and "*.safetensors" in asked[0][1]
    assert "*.bin" not in asked[0][1]  # weights are fetched once, as safetensors
    assert loaded.expert_store is not None and loaded.source == "someorg/tiny-moe"
    assert not any(p.is_meta for n, p in loaded.model.named_parameters() if ".experts." not in n)


def test_a_hub_id_without_a_snapshot_is_left_to_from_pretrained(tmp_path, monkeypatch):
    """Offline, unknown or .bin-only: no snapshot to stream, so from_pretrained loads it or says why."""
    import huggingface_hub

    import specfit.model.sources
    from specfit.model.sources import hub_snapshot

    monkeypatch.setattr(specfit.model.sources, "hub_reachable", lambda: True)

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert hub_snapshot("someorg/absent") is None
    (tmp_path / "config.json").write_text("{}")  # a snapshot without safetensors weights
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path))
    assert hub_snapshot("someorg/bin-only") is None
    assert hub_snapshot(str(tmp_path)) is None  # a local directory is no hub id


def test_an_unreachable_hub_id_fails_at_once_naming_model_path(tmp_path, monkeypatch):
    """Offline and not in the hub cache: one error now, not half a minute of the hub client's retries."""
    import specfit.model.sources

    monkeypatch.setattr(specfit.model.sources, "hub_reachable", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"model.path=someorg/absent: no such local directory.*cannot be reached"):
        load_target(ModelConfig(path="someorg/absent", device="cpu"))
    (tmp_path / "models").mkdir()  # a local folder of that name: a mistyped local path, not a hub id
    with pytest.raises(ModelError, match=r"model.path=models/Qwen3: no such directory \(nothing named 'Qwen3'"):
        load_target(ModelConfig(path="models/Qwen3", device="cpu"))


def test_a_header_whose_shape_and_bytes_disagree_is_named(saved, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    data = (d / "model.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["shape"] = [32]  # its 256 bytes hold 64 floats
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    (d / "model.safetensors").write_bytes(data[:8] + text + data[8 + length:])
    with pytest.raises(ModelError, match=r"model.safetensors: tensor model.norm.weight has 256 bytes, its shape \[32\]"):
        stream_checkpoint(str(d), device="cpu")
