"""``model.numerics``: which dtype the dense part of a half-precision target computes in.

``native`` keeps every weight in the model's dtype (bf16 activations, norms, router and sums).
``exact`` keeps the experts in the checkpoint's dtype (host store and device slots: the bytes that
are copied and cached) and upcasts every other floating parameter to float32, values unchanged, so
activations, norms, the router and the weighted expert sum are fp32. Verification passes of
different shapes then round alike, and speculative output stays identical to autoregressive output
(issue 13); decode is memory-bound, so the upcast dense weights cost little. For fp32 (or fp64)
targets both are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from specfit.validation import choice

if TYPE_CHECKING:
    from specfit.types.moe import MoESpec

NUMERICS = ("exact", "native")
HALF = (torch.float16, torch.bfloat16)


def check_numerics(value: object, key: str = "model.numerics") -> str:
    """``value`` if it is one of :data:`NUMERICS`, else a one-line ConfigError naming ``key``."""
    return choice(key, value, NUMERICS)


def dense_dtype(dtype: torch.dtype, numerics: str) -> torch.dtype:
    """The dtype a non-expert floating weight of ``dtype`` computes in under ``numerics``."""
    return torch.float32 if numerics == "exact" and dtype in HALF else dtype


def apply_numerics(model: nn.Module, numerics: str) -> None:
    """Upcast ``model``'s half-precision parameters and buffers to float32 for ``exact`` (in place).

    Called once the runtime has taken the experts out of the model, so only dense weights remain;
    a tied embedding stays tied (one parameter, cast once)."""
    check_numerics(numerics)
    if numerics == "exact":
        map_dense_tensors(model, lambda _module, _name, t: t.float() if t.dtype in HALF else None)


def map_dense_tensors(model: nn.Module, fn: Callable[[nn.Module, str, torch.Tensor], torch.Tensor | None]) -> None:
    """``fn(module, name, tensor)`` for every parameter and buffer that holds data (not meta); a
    tensor it returns replaces that one's data (a parameter stays the same object, so ties hold)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.is_meta:
                new = fn(module, name, param)
                if new is not None:
                    param.data = new
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                new = fn(module, name, buf)
                if new is not None:
                    module._buffers[name] = new


def numerics_info(numerics: str, spec: MoESpec, model: nn.Module) -> dict[str, str]:
    """What ``info`` (and results.jsonl) say: the setting, the experts' dtype and the dense weights'."""
    dense = {p.dtype for p in model.parameters() if p.is_floating_point() and not p.is_meta}
    return {
        "numerics": numerics,
        "expert_dtype": _name(spec.dtype),
        "dense_dtype": ",".join(sorted(_name(d) for d in dense)) or _name(spec.dtype),
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
