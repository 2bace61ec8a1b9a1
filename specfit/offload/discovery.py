"""Finding a model's MoE expert modules and describing them as a :class:`~specfit.types.moe.MoESpec`.

specfit hooks into models through transformers' experts interface: every supported MoE block calls
``self.experts(hidden[T, H], top_k_index[T, K], top_k_weights[T, K])`` on a module holding fused
weights ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``. Replacing that
module leaves the router, attention and shared experts untouched.

This reads torch modules (their attributes, shapes and dtypes, and probes a custom gate
numerically), so it lives with the offload runtime that replaces them, not with the plain data of
:mod:`specfit.types.moe`. Only shapes and dtypes are read, so a model built on the meta device can
be described before any weight is loaded.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specfit.errors import ModelError
from specfit.offload.compute.base import clamped_swiglu
from specfit.types.moe import SUPPORTED, ExpertLayout, MoESpec

def _is_experts_module(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3


def _dims(module: nn.Module) -> tuple[int, int, int]:
    """(experts, 2I, H) of a module's gate_up_proj, whatever its orientation."""
    e, a, b = module.gate_up_proj.shape
    return (e, b, a) if getattr(module, "is_transposed", False) else (e, a, b)


def expert_layout(name: str, module: nn.Module) -> ExpertLayout:
    """The layout of an experts module, or a ModelError naming the module and what it cannot compute.

    Transposed weights, interleaved gate/up columns and biases are normalised by the host store;
    a custom ``_apply_gate`` is accepted only when it computes gpt-oss's clamped SwiGLU (checked
    numerically on a probe, so a look-alike with other constants is not mistaken for it).
    """
    problems = []
    if not getattr(module, "has_gate", True):
        problems.append("ungated experts")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a post-expert norm")
    bias = bool(getattr(module, "has_bias", False))
    e, two_i, h = _dims(module)
    transposed = getattr(module, "is_transposed", False)
    down_shape = (e, two_i // 2, h) if transposed else (e, h, two_i // 2)
    if two_i % 2 or tuple(module.down_proj.shape) != down_shape:
        raise ModelError(f"experts module {name}: gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj "
                         f"{tuple(module.down_proj.shape)} do not match")
    if bias:
        for attr, shape in (("gate_up_proj_bias", (e, two_i)), ("down_proj_bias", (e, h))):
            tensor = getattr(module, attr, None)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
                problems.append(f"expert biases without a {attr} of shape {list(shape)}")
    activation, alpha, limit = "silu", ExpertLayout.alpha, ExpertLayout.limit
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if _is_clamped_swiglu(module, alpha, limit):
            activation = "clamped_swiglu"
        else:
            problems.append(f"a custom gate activation ({type(module).__name__}._apply_gate)")
    if problems:
        raise ModelError(f"experts module {name} ({type(module).__name__}) uses {', '.join(problems)}: not supported yet")
    return ExpertLayout(bias=bias, activation=activation, alpha=float(alpha), limit=float(limit))


def _is_clamped_swiglu(module: nn.Module, alpha: object, limit: object) -> bool:
    """Whether ``module._apply_gate`` computes :func:`clamped_swiglu` with its alpha and limit."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
        return False
    probe = torch.linspace(-3 * float(limit), 3 * float(limit), 48, dtype=torch.float64).view(3, 16)
    interleaved = not getattr(module, "is_concatenated", True)
    gate, up = (probe[..., ::2], probe[..., 1::2]) if interleaved else probe.chunk(2, dim=-1)
    try:
        got = module._apply_gate(probe)
    except Exception:  # noqa: BLE001 - any failure means: not the activation we implement
        return False
    want = clamped_swiglu(gate, up, float(alpha), float(limit))
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model``, in layer order."""
    found = [(n, m) for n, m in model.named_modules() if _is_experts_module(m)]
    for name, module in found:
        expert_layout(name, module)
    for name, module in model.named_modules():  # stacked experts of another kind: say so, never "not MoE"
        down = getattr(module, "down_proj", None)
        if not _is_experts_module(module) and isinstance(down, torch.Tensor) and down.dim() == 3:
            raise ModelError(f"experts module {name} ({type(module).__name__}) has no fused gate_up_proj "
                             "(ungated experts): not supported yet")
    return found


def moe_spec(model: nn.Module, experts: list[tuple[str, nn.Module]] | None = None) -> MoESpec:
    """Describe ``model``'s routed experts; a clear error when it has none we support."""
    experts = find_experts(model) if experts is None else experts
    if not experts:
        raise ModelError(
            f"{type(model).__name__} has no MoE experts module with fused gate_up_proj/down_proj "
            f"(transformers 5.x experts interface); supported: {SUPPORTED}"
        )
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None)
    if not top_k:
        raise ModelError(f"{type(model).__name__}'s config has no num_experts_per_tok (top-k)")
    first_name, first = experts[0]
    e, two_i, h = _dims(first)
    layout = expert_layout(first_name, first)
    for name, m in experts:
        if _dims(m) != (e, two_i, h) or expert_layout(name, m) != layout:
            raise ModelError(f"experts module {name} differs in shape or layout from {first_name}: not supported")
    layers = []
    for name, _ in experts:
        numbers = re.findall(r"\.(\d+)\.", f".{name}.")
        layers.append(int(numbers[-1]) if numbers else len(layers))
    return MoESpec(
        num_layers=len(experts),
        num_experts=e,
        top_k=int(top_k),
        hidden_size=h,
        intermediate_size=two_i // 2,
        dtype=first.gate_up_proj.dtype,
        module_names=tuple(n for n, _ in experts),
        decoder_layers=tuple(layers),
        layout=layout,
    )
