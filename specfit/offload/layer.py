"""The layer a model computes its experts with once the offload runtime holds them, and the model
surgery around it: finding the experts modules an earlier runtime swapped in, and swapping them in.

Its own module so that code which only needs to recognise an offloaded model (the API's shared
target check, tests) does not import the runtime, and so that the runtime, which builds these
layers, is the only one that knows both.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from specfit.errors import ModelError
from specfit.offload.store import HostExpertStore
from specfit.types.moe import MoESpec


class LayerRuntime(Protocol):
    """What an :class:`OffloadedExperts` layer uses of its runtime (the offload runtime)."""

    orphaned: bool  # its Engine failed to build: the next runtime over the model takes over the store
    spec: MoESpec
    store: HostExpertStore

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  act_fn: nn.Module | None) -> torch.Tensor: ...


class OffloadedExperts(nn.Module):
    """Drop-in replacement for a transformers experts module; weights live in the runtime."""

    def __init__(self, runtime: LayerRuntime, layer: int, act_fn: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.act_fn = act_fn
        self.num_experts = runtime.spec.num_experts
        object.__setattr__(self, "_runtime", runtime)  # not a submodule: .to() must not move the store

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        runtime = self._runtime
        if runtime.orphaned:  # its slots are gone; the weights wait in the store for the next Engine
            raise ModelError("this model's experts belong to an Engine that failed to build, so the model cannot "
                             "run on its own; build a new Engine over it (it takes the experts over)")
        return runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights, self.act_fn)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, offloaded"


def failed_build(model: nn.Module) -> LayerRuntime | None:
    """The runtime whose Engine failed to build over ``model`` (its experts modules swapped, their
    weights in its store), which a new runtime takes over; None for a model no Engine holds. A
    model a working Engine holds, or whose store a failed full-cache build already dropped, is a
    ModelError."""
    held = {id(m._runtime): m._runtime for m in model.modules() if isinstance(m, OffloadedExperts)}
    if not held:
        return None
    previous = next(iter(held.values()))
    if len(held) == 1 and previous.orphaned:
        if any(layer is None for layer in previous.store.layers):
            raise ModelError(f"this {type(model).__name__}'s experts were in the device slots of an Engine that failed "
                             "to build (cache=full drops their host copy): load the model again")
        return previous
    raise ModelError(f"this {type(model).__name__}'s experts are held by another Engine (an Engine moves a model's "
                     "experts into its own store): reuse that Engine, load the model again, or load it once for "
                     "several engines with specfit.api.load_shared_target")


def offloaded_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The :class:`OffloadedExperts` layers of a model an earlier runtime took over, in layer order."""
    return sorted(((n, m) for n, m in model.named_modules() if isinstance(m, OffloadedExperts)),
                  key=lambda nm: nm[1].layer)


def swap_in(model: nn.Module, experts: list[tuple[str, nn.Module]], runtime: LayerRuntime) -> None:
    """Replace each experts module of ``experts`` (layer order) with an :class:`OffloadedExperts` of
    ``runtime``, keeping its ``act_fn``; ``experts`` is emptied (the replaced modules' weights are in
    the runtime's store, or were never loaded)."""
    for layer, (name, module) in enumerate(experts):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, OffloadedExperts(runtime, layer, getattr(module, "act_fn", None)))
    experts.clear()
