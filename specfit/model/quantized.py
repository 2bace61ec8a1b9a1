"""Quantized checkpoints, dequantized at load: specfit computes in the checkpoint's unquantized layout.

Two formats are read, tensor by tensor as the loader streams them:

- ``mxfp4`` (gpt-oss on the hub): ``<name>_blocks`` uint8 ``[..., G, 16]`` (two FP4 e2m1 values a
  byte, low nibble first) and ``<name>_scales`` uint8 ``[..., G]`` (e8m0: a power of two, bias
  127), one scale per 32 values. An experts tensor ``[E, out, G, 16]`` becomes ``[E, in, out]``,
  the layout of the same model's bf16 checkpoint (as transformers' ``convert_moe_packed_tensors``).
- ``fp8`` (DeepSeek-V3, Qwen3 FP8): ``<name>`` float8_e4m3fn ``[..., out, in]`` and
  ``<name>_scale_inv`` (``<x>.weight_scale_inv`` for ``<x>.weight``), float32 or e8m0, one per
  ``weight_block_size`` block (``[ceil(out/128), ceil(in/128)]``) or one per tensor; static
  activation scales (``input_scale``) are dropped: activations stay unquantized.

An mxfp4 value (an FP4 value times a power of two) is exact in bfloat16 and float32; an fp8 value
times its scale is computed exactly (float64) and rounded once to the chosen dtype (exact too when
the scales are powers of two). Any other ``quantization_config`` is refused, naming it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import torch

from specfit.errors import ModelError

METHODS = ("mxfp4", "fp8")

#: FP4 (e2m1) code -> value; bit 3 is the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per e8m0 scale
_ROWS_PER_CHUNK = 1 << 16  # rows of 32 values dequantized at once: bounds the index temporaries


def quantization_of(config: dict[str, Any], what: str) -> str | None:
    """``config`` (config.json's object)'s quantization method when specfit can dequantize it, None
    when it has none; any other method is a ModelError naming it and ``what`` (e.g. the model.path)."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ModelError(f"{what}: config.json's quantization_config is not an object")
    method = str(quant.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelError(f"{what}: config.json's quantization_config.quant_method={quant.get('quant_method')!r} is not "
                         f"supported: specfit dequantizes {' and '.join(METHODS)} checkpoints at load; use the model's "
                         "unquantized (bf16) weights")
    if method == "fp8":
        _block_size(quant, what)
    return method


def dequantized(names: Iterable[str], get: Callable[[str], torch.Tensor], config: dict[str, Any],
                dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under their unquantized names, in the order of ``names``: quantized
    pairs combined and dequantized to ``dtype``, every other tensor as stored. ``get`` reads one
    tensor by name (a safetensors slice, say), so only one pair is in memory at a time."""
    method = quantization_of(config, "config.json")
    names = list(names)
    if method == "mxfp4":
        yield from _mxfp4_tensors(names, get, dtype)
    elif method == "fp8":
        yield from _fp8_tensors(names, get, _block_size(config["quantization_config"], "config.json"), dtype)
    else:
        for name in names:
            yield name, get(name)


# ---------------------------------------------------------------------------------------------- mxfp4


def _mxfp4_tensors(names: list[str], get: Callable[[str], torch.Tensor],
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    present = set(names)
    for name in names:
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in present:
            continue  # read with its blocks
        if not name.endswith("_blocks"):
            yield name, get(name)
            continue
        base = name.removesuffix("_blocks")
        if base + "_scales" not in present:
            raise ModelError(f"mxfp4 tensor {name} has no {base}_scales in the checkpoint")
        weight = mxfp4_dequantize(get(name), get(base + "_scales"), dtype, name)
        if weight.dim() == 3:  # experts [E, out, in] -> [E, in, out], the bf16 checkpoint's layout (a view:
            weight = weight.transpose(1, 2)  # the loader copies it into place, no second copy here)
        yield base, weight


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     name: str = "blocks") -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16] and e8m0 ``scales`` uint8 [..., G] -> ``dtype`` [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelError(f"mxfp4 tensor {name}: blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelError(f"mxfp4 tensor {name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                         f"pair (blocks [..., G, {MXFP4_GROUP // 2}], scales [..., G])")
    *lead, groups, width = blocks.shape
    rows = math.prod(lead) * groups
    blocks, exponents = blocks.reshape(rows, width), scales.reshape(rows, 1).to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(rows, 2 * width, dtype=dtype, device=blocks.device)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = slice(start, start + _ROWS_PER_CHUNK)
        values = torch.empty(out[chunk].shape, dtype=torch.float32, device=blocks.device)
        values[:, 0::2] = lut[(blocks[chunk] & 0x0F).long()]
        values[:, 1::2] = lut[(blocks[chunk] >> 4).long()]
        out[chunk] = torch.ldexp(values, exponents[chunk].float())  # exact: a power-of-two scale
    return out.reshape(*lead, groups * 2 * width)


# ------------------------------------------------------------------------------------------------ fp8

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _block_size(quant: dict[str, Any], what: str) -> tuple[int, int] | None:
    block = quant.get("weight_block_size")
    if block is None:
        return None  # one scale per tensor
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelError(f"{what}: quantization_config.weight_block_size={block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def _scale_name(name: str) -> str:
    return name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _fp8_tensors(names: list[str], get: Callable[[str], torch.Tensor], block: tuple[int, int] | None,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    present = set(names)
    for name in names:
        if name.endswith("scale_inv") and _owner(name) in present:
            continue  # read with its weight
        if name.endswith((".input_scale", ".activation_scale")):
            continue  # static activation scales: activations are not quantized here
        tensor = get(name)
        if tensor.dtype not in _FP8:
            yield name, tensor
            continue
        scale_name = _scale_name(name)
        if scale_name not in present:
            raise ModelError(f"fp8 tensor {name} has no {scale_name} in the checkpoint")
        yield name, fp8_dequantize(tensor, get(scale_name), block, dtype, name)


def _owner(scale_name: str) -> str:
    if scale_name.endswith(".weight_scale_inv"):
        return scale_name.removesuffix(".weight_scale_inv") + ".weight"
    return scale_name.removesuffix("_scale_inv")


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """float8 ``weight`` [..., out, in] times its ``scale_inv`` per (block[0] x block[1]) block, or
    per tensor when the scale is a single value -> ``dtype``."""
    scale = scale_inv.float()
    rows, cols = weight.shape[-2:] if weight.dim() >= 2 else (1, weight.numel())
    if scale.numel() == 1:
        return (weight.double() * scale.double().reshape(())).to(dtype)
    if block is None or weight.dim() < 2:
        raise ModelError(f"fp8 tensor {name}: {tuple(scale_inv.shape)} scales but no "
                         "quantization_config.weight_block_size to apply them by")
    expect = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expect:
        raise ModelError(f"fp8 tensor {name} {tuple(weight.shape)}: its scale_inv is {tuple(scale_inv.shape)}, blocks "
                         f"of {block[0]}x{block[1]} need {expect}")
    if weight.dim() > 2:  # stacked experts: one at a time, to bound the float64 temporaries
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        for i, (w, s) in enumerate(zip(weight, scale_inv)):
            out[i] = fp8_dequantize(w, s, block, dtype, name)
        return out
    full = scale.double().repeat_interleave(block[0], dim=-2)[:rows].repeat_interleave(block[1], dim=-1)[:, :cols]
    return (weight.double() * full).to(dtype)  # exact product, rounded once to dtype
