"""What a failed engine build puts back on the model it was given: the forward hooks and the dense
weights' dtypes and devices, as they were before the build (the next Engine over the model starts
from the model as it was loaded)."""

from __future__ import annotations

import torch
from torch import nn

from specfit.model.numerics import map_dense_tensors

_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def forward_hooks(model: nn.Module) -> dict[nn.Module, dict[str, dict]]:
    """Every module's forward hooks as they are now (for :func:`restore_forward_hooks`)."""
    return {m: {name: dict(getattr(m, name)) for name in _FORWARD_HOOKS} for m in model.modules()}


def restore_forward_hooks(saved: dict[nn.Module, dict[str, dict]]) -> None:
    """Put back the hooks :func:`forward_hooks` saw: those the runtime and the plug-ins of a failed
    build registered go (they would run in the next Engine's passes)."""
    for module, hooks in saved.items():
        for name, entries in hooks.items():
            current = getattr(module, name)
            current.clear()
            current.update(entries)


def dense_placement(model: nn.Module) -> dict[tuple[nn.Module, str], tuple[torch.dtype, torch.device]]:
    """Each parameter's and buffer's dtype and device (for :func:`restore_dense_placement`)."""
    saved: dict[tuple[nn.Module, str], tuple[torch.dtype, torch.device]] = {}

    def note(module: nn.Module, name: str, t: torch.Tensor) -> None:
        saved[module, name] = (t.dtype, t.device)

    map_dense_tensors(model, note)
    return saved


def restore_dense_placement(model: nn.Module, saved: dict[tuple[nn.Module, str], tuple[torch.dtype, torch.device]]) -> None:
    """Cast and move back what a failed build's ``numerics`` upcast or moved (exact: half values
    were upcast, so casting back loses nothing); the replaced experts modules are gone already."""
    def back(module: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor | None:
        dtype, device = saved.get((module, name), (t.dtype, t.device))
        return t.to(device, dtype) if (t.dtype, t.device) != (dtype, device) else None

    map_dense_tensors(model, back)
