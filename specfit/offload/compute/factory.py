"""Choosing the expert compute: ``model.expert_compute``, checked, resolved for the device, built.

Implementations (``model.expert_compute``):

- ``loop``: a Python loop over the round's slots, a few ops per expert: the reference.
- ``grouped``: ``torch._grouped_mm`` over every slot (empty groups for idle slots): one grouped
  GEMM for gate/up and one for down, a constant number of ops whatever the number of experts.
- ``triton``: a fused-MoE style Triton kernel (CUDA; CPU only under ``TRITON_INTERPRET=1``), see
  :mod:`specfit.offload.compute.triton`.
- ``auto``: ``triton`` on CUDA when Triton imports, ``grouped`` otherwise.
"""

from __future__ import annotations

import torch

from specfit.errors import ConfigError
from specfit.offload.compute.base import ExpertCompute
from specfit.offload.compute.grouped import GroupedCompute
from specfit.offload.compute.loop import LoopCompute


IMPLEMENTATIONS = ("auto", "grouped", "loop", "triton")


def check_expert_compute(value: object, key: str = "model.expert_compute") -> str:
    """``value`` if it names an implementation, else a one-line ConfigError naming ``key``."""
    if not isinstance(value, str) or value not in IMPLEMENTATIONS:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return value


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


def resolve(kind: str, device: torch.device) -> str:
    """The implementation ``kind`` runs as on ``device`` (``auto`` resolved)."""
    check_expert_compute(kind)
    if kind == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "grouped"
    return kind


def make_expert_compute(kind: str, device: torch.device | str) -> ExpertCompute:
    """The compute implementation ``kind`` (see the module docstring) for ``device``."""
    device = torch.device(device)
    kind = resolve(kind, device)
    if kind == "loop":
        return LoopCompute()
    if kind == "grouped":
        return GroupedCompute()
    from specfit.offload.compute.triton import TritonCompute

    return TritonCompute(device)
