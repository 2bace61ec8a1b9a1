"""The shape of a model's MoE experts, as plain data: :class:`ExpertLayout`, :class:`MoESpec`, the
canonical expert row (:func:`row_parts`) and the cache capacity rule (:func:`resolve_capacity`).

Variants of transformers' experts interface (``is_transposed``, ``is_concatenated=False`` i.e.
interleaved gate/up columns, ``has_bias`` and gpt-oss's clamped SwiGLU) are described by an
:class:`ExpertLayout`; the host store normalises every expert to one canonical row (see
:func:`row_parts`), so the compute kernels know a single layout. Finding the experts modules of a
model and describing them is :mod:`specfit.offload.discovery`; the activations are computed in
:mod:`specfit.offload.compute.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specfit.errors import ConfigError
from specfit.validation import optional_integer

if TYPE_CHECKING:
    import torch

#: Architectures whose experts follow the fused interface the slot kernels implement (tested ones).
SUPPORTED = "Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V2/V3, gpt-oss, Qwen3-Next (autoregressive only)"

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertLayout:
    """What an expert computes beyond ``down(act(gate(x)) * up(x))``.

    ``activation``: ``"silu"`` is ``act_fn(gate) * up`` with the module's own ``act_fn`` (SiLU in
    every supported family); ``"clamped_swiglu"`` is gpt-oss's: ``gate.clamp(max=limit)``,
    ``up.clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
    """

    bias: bool = False  # gate_up and down biases (gpt-oss)
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


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
    layout: ExpertLayout = ExpertLayout()

    @property
    def expert_numel(self) -> int:
        """Elements of one expert's host/slot row (biases included when the layout has them)."""
        i, h = self.intermediate_size, self.hidden_size
        return 3 * i * h + ((2 * i + h) if self.layout.bias else 0)

    @property
    def expert_bytes(self) -> int:
        return self.expert_numel * self.dtype.itemsize  # torch.dtype: its element size in bytes


def row_parts(spec: MoESpec) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The canonical row of one expert: ``{part: (offset, shape)}`` in row order.

    ``gate_up`` [2I, H] (gate rows first), ``down`` [H, I], then, with biases, ``gate_up_bias`` [2I]
    and ``down_bias`` [H]. The host store, the slots and every compute implementation use it.
    """
    i, h = spec.intermediate_size, spec.hidden_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("gate_up", (2 * i, h)), ("down", (h, i))]
    if spec.layout.bias:
        shapes += [("gate_up_bias", (2 * i,)), ("down_bias", (h,))]
    parts, offset = {}, 0
    for name, shape in shapes:
        parts[name] = (offset, shape)
        offset += _numel(shape)
    return parts


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def resolve_capacity(spec: MoESpec, capacity: int | None, capacity_bytes: int | None, default: int) -> int:
    """Slots per layer from ``cache.capacity`` (experts) or ``cache.capacity_bytes`` (all layers)."""
    capacity = optional_integer("cache.capacity", capacity, minimum=1)  # a cache built in code is checked here
    capacity_bytes = optional_integer("cache.capacity_bytes", capacity_bytes, minimum=1)
    if capacity is not None and capacity_bytes is not None:
        raise ConfigError("set cache.capacity or cache.capacity_bytes, not both")
    if capacity_bytes is not None:
        capacity = int(capacity_bytes) // (spec.expert_bytes * spec.num_layers)
        source = f"cache.capacity_bytes={capacity_bytes} ({capacity} experts per layer of {spec.expert_bytes} bytes)"
    elif capacity is not None:
        source = f"cache.capacity={capacity}"
    else:
        capacity, source = default, f"the default capacity {default}"
    if capacity < spec.top_k:
        raise ConfigError(
            f"{source} is below the model's top-k ({spec.top_k}): one token needs {spec.top_k} experts of a layer at once"
        )
    return min(int(capacity), spec.num_experts)
