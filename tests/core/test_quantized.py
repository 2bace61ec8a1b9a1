"""Quantized checkpoints: MXFP4 and block-wise FP8 dequantize exactly at load; other methods are refused.

The quantizers here are the tests' own: values representable in a format must come back
bit-identical, and a checkpoint written in the hub's quantized layout must decode exactly as the
unquantized model with the same (representable) weights does under HF generate."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file

from specfit import Engine
from specfit.model.config import ModelConfig
from specfit.model.loading import load_target
from specfit.model.quantized import FP4_VALUES, dequantized, fp8_dequantize, mxfp4_dequantize, quantization_of
from specfit.errors import ModelError
from specfit.plugins.caches.lru import LRUCache

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 1, 2, 3, 4]
LUT = torch.tensor(FP4_VALUES)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]: per group of
    32 the smallest power of two that brings the largest magnitude to <= 6, then the nearest FP4 value."""
    groups = x.double().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - LUT.double()).abs().argmin(-1).to(torch.uint8)  # nearest value (+0 before -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The tests' own decoder (float64): low nibble first, value times 2^(scale - 127)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32).long()
    values = LUT.double()[codes] * torch.exp2(scales.double() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_values_dequantize_exactly():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64))
    exps = torch.randint(-10, 6, (3, 5, 2))
    x = (LUT[codes].reshape(3, 5, 2, 32) * torch.exp2(exps.float())[..., None]).reshape(3, 5, 64)
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(mxfp4_dequantize(blocks, scales, dtype), x.to(dtype))


def test_mxfp4_experts_match_transformers_reference():
    """The experts layout ([E, out, G, 16] -> [E, in, out]) as transformers' own converter lays it out."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(1)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), dtype=torch.uint8)
    scales = torch.randint(118, 133, (4, 6, 2), dtype=torch.uint8)
    ours = dict(dequantized(["w_blocks", "w_scales", "b"], {"w_blocks": blocks, "w_scales": scales,
                                                            "b": torch.ones(3)}.__getitem__,
                            {"quantization_config": {"quant_method": "mxfp4"}}, torch.bfloat16))
    assert list(ours) == ["w", "b"]
    assert torch.equal(ours["w"], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    assert ours["w"].shape == (4, 64, 6)


@pytest.mark.parametrize("scales", ["power_of_two", "float32"])
def test_fp8_block_values_dequantize_exactly(scales):
    torch.manual_seed(2)
    rows, cols = 200, 130  # not multiples of the 128 x 128 blocks
    values = torch.randn(rows, cols).to(torch.float8_e4m3fn)
    shape = (math.ceil(rows / 128), math.ceil(cols / 128))
    scale = torch.exp2(torch.randint(-8, 3, shape).float()) if scales == "power_of_two" else torch.rand(shape) + 0.1
    full = scale.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    expected = values.double() * full
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8_dequantize(values, scale, (128, 128), dtype), expected.to(dtype))
    if scales == "power_of_two":
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

        assert torch.equal(fp8_dequantize(values, scale, (128, 128), torch.float32),
                           _dequantize_fp8_weight(values, scale, [128, 128], torch.float32))
    with pytest.raises(ModelError, match=r"fp8 tensor weight \(200, 130\): its scale_inv is \(1, 2\)"):
        fp8_dequantize(values, scale[:1], (128, 128), torch.float32)


def test_fp8_fused_experts_dequantize_expert_by_expert():
    """transformers' fused layout: `experts.gate_up_proj` [E, out, in] with `experts.gate_up_proj_scale_inv`."""
    torch.manual_seed(4)
    values = torch.randn(3, 40, 24).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, 2) + 0.5  # blocks of 16 x 16
    full = scale.double().repeat_interleave(16, 1)[:, :40].repeat_interleave(16, 2)[:, :, :24]
    tensors = {"m.experts.gate_up_proj": values, "m.experts.gate_up_proj_scale_inv": scale}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    out = dict(dequantized(tensors, tensors.__getitem__, config, torch.bfloat16))
    assert list(out) == ["m.experts.gate_up_proj"]
    assert torch.equal(out["m.experts.gate_up_proj"], (values.double() * full).to(torch.bfloat16))


def test_quantization_config_is_named_or_refused():
    assert quantization_of({}, "model.path=x") is None
    assert quantization_of({"quantization_config": {"quant_method": "mxfp4"}}, "model.path=x") == "mxfp4"
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert quantization_of(fp8, "x") == "fp8"
    for method in ("gptq", "awq", "bitsandbytes", "compressed-tensors"):
        with pytest.raises(ModelError) as info:
            quantization_of({"quantization_config": {"quant_method": method, "bits": 4}}, "model.path=/ckpt")
        message = str(info.value)
        assert "\n" not in message and message.startswith("model.path=/ckpt: ")
        assert f"quant_method={method!r} is not supported" in message and "mxfp4 and fp8" in message
    with pytest.raises(ModelError, match=r"weight_block_size=\[128\] is not two positive integers"):
        quantization_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "x")


def test_unpaired_quantized_tensors_are_named():
    mx = {"quantization_config": {"quant_method": "mxfp4"}}
    blocks = {"a.w_blocks": torch.zeros(2, 1, 16, dtype=torch.uint8)}
    with pytest.raises(ModelError, match="mxfp4 tensor a.w_blocks has no a.w_scales"):
        list(dequantized(blocks, blocks.__getitem__, mx, torch.float32))
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    weights = {"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "a.input_scale": torch.ones(())}
    with pytest.raises(ModelError, match="fp8 tensor a.weight has no a.weight_scale_inv"):
        list(dequantized(weights, weights.__getitem__, fp8, torch.float32))
    weights["a.weight_scale_inv"] = torch.full((1, 1), 2.0)
    out = dict(dequantized(weights, weights.__getitem__, fp8, torch.float32))
    assert list(out) == ["a.weight"]  # the scale is consumed, the static activation scale dropped


# ------------------------------------------------------------------------------- checkpoints on disk


def _write(directory, model: torch.nn.Module, tensors: dict[str, torch.Tensor], quant: dict) -> None:
    model.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))


def _assert_same_logits(engine: Engine, model: torch.nn.Module) -> None:
    """Greedy tokens alone would hide a slightly wrong weight; the logits do not."""
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
        got = engine.target.prefill(PROMPT).logits[-1]
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def _hf_greedy(model: torch.nn.Module, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def test_mxfp4_gpt_oss_checkpoint_loads_and_decodes_exactly(tmp_path):
    """gpt-oss's hub layout: experts' gate_up_proj/down_proj as *_blocks + *_scales (biases unquantized)."""
    model = tiny_model("tiny-gpt-oss", attn_implementation="eager")
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, in, out] -> per out row
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        param = model.get_parameter(name)
        with torch.no_grad():  # the reference holds exactly the representable weights
            param.copy_(decode_mxfp4(blocks, scales).transpose(1, 2))
    _write(tmp_path, model, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    loaded = load_target(ModelConfig(path=str(tmp_path), dtype="float32", attn_implementation="eager", device="cpu"))
    engine = Engine(loaded.model, cache=LRUCache(capacity=3), device="cpu", expert_store=loaded.expert_store)
    _assert_same_logits(engine, model)
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == _hf_greedy(model, 16)


def test_fp8_checkpoint_loads_and_decodes_exactly(tmp_path):
    """DeepSeek-V3 / Qwen3 FP8 layout: every linear weight but the head as float8_e4m3fn + weight_scale_inv."""
    model = tiny_model("tiny-qwen3-moe")
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    quantized = [n for n in tensors if n.endswith("_proj.weight")]
    assert any(".experts." in n for n in quantized) and any("self_attn" in n for n in quantized)
    torch.manual_seed(3)
    reference = {}
    for name in quantized:
        weight = tensors.pop(name)
        scale = torch.rand(math.ceil(weight.shape[0] / 16), math.ceil(weight.shape[1] / 16)) * 0.02 + 0.01
        full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)  # the tiny shapes are multiples of 16
        values = (weight / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = values, scale
        reference[name] = (values.double() * full.double()).float()
    model.load_state_dict({**model.state_dict(), **_fused(model, reference)})
    _write(tmp_path, model, tensors, {"quant_method": "fp8", "weight_block_size": [16, 16],
                                      "activation_scheme": "dynamic", "fmt": "e4m3"})
    loaded = load_target(ModelConfig(path=str(tmp_path), dtype="float32", device="cpu"))
    engine = Engine(loaded.model, cache=LRUCache(capacity=3), device="cpu", expert_store=loaded.expert_store)
    _assert_same_logits(engine, model)
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == _hf_greedy(model, 16)


def _fused(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's per-expert gate/up/down weights as the module's fused gate_up_proj / down_proj."""
    state = {k: v for k, v in weights.items() if ".experts." not in k}
    layers = sorted({k.split(".experts.")[0] for k in weights if ".experts." in k})
    for prefix in layers:
        n = model.get_parameter(f"{prefix}.experts.gate_up_proj").shape[0]
        expert = f"{prefix}.experts"
        state[f"{expert}.gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{expert}.{e}.gate_proj.weight"], weights[f"{expert}.{e}.up_proj.weight"]])
            for e in range(n)])
        state[f"{prefix}.experts.down_proj"] = torch.stack([weights[f"{prefix}.experts.{e}.down_proj.weight"]
                                                            for e in range(n)])
    return state


def test_other_quantizations_are_refused_at_load(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as info:
        load_target(ModelConfig(path=str(tmp_path), device="cpu"))
    assert "quant_method='gptq' is not supported" in str(info.value) and "\n" not in str(info.value)
