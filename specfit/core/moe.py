"""Finding a model's MoE expert modules and describing their shape.

specfit hooks into models through transformers' experts interface: every supported MoE block calls
``self.experts(hidden[T, H], top_k_index[T, K], top_k_weights[T, K])`` on a module holding fused
weights ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``. Replacing that
module leaves the router, attention and shared experts untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from specfit.errors import ModelError

#: Architectures whose experts follow the fused interface the slot kernels implement (tested ones).
SUPPORTED = "Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V2/V3"


@dataclass(frozen=True)
class MoESpec:
    """Shape of a model's routed experts, as the cache, cost model and selectors see it."""

    num_layers: int  # MoE layers (indexed 0..num_layers-1 throughout specfit)
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert
    dtype: torch.dtype
    module_names: tuple[str, ...]  # path of each MoE layer's experts module
    decoder_layers: tuple[int, ...]  # decoder-layer index of each MoE layer

    @property
    def expert_numel(self) -> int:
        return 3 * self.intermediate_size * self.hidden_size

    @property
    def expert_bytes(self) -> int:
        return self.expert_numel * torch.tensor([], dtype=self.dtype).element_size()


def _is_experts_module(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3


def _check_supported(name: str, module: nn.Module) -> None:
    """Reject expert layouts the slot kernels do not implement, rather than computing them wrongly."""
    problems = []
    if getattr(module, "has_bias", False):
        problems.append("expert biases")
    if getattr(module, "is_transposed", False):
        problems.append("transposed weights")
    if not getattr(module, "has_gate", True):
        problems.append("ungated experts")
    if not getattr(module, "is_concatenated", True):
        problems.append("interleaved gate/up rows")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a post-expert norm")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        problems.append("a custom gate activation")
    if problems:
        raise ModelError(f"experts module {name} ({type(module).__name__}) uses {', '.join(problems)}: not supported yet")
    gu, dn = module.gate_up_proj, module.down_proj
    e, two_i, h = gu.shape
    if dn.shape != (e, h, two_i // 2):
        raise ModelError(f"experts module {name}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} do not match")


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model``, in layer order."""
    found = [(n, m) for n, m in model.named_modules() if _is_experts_module(m)]
    for name, module in found:
        _check_supported(name, module)
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
    first = experts[0][1]
    e, two_i, h = first.gate_up_proj.shape
    for name, m in experts:
        if tuple(m.gate_up_proj.shape) != (e, two_i, h):
            raise ModelError(f"experts module {name} differs in shape from {experts[0][0]}: not supported")
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
    )
