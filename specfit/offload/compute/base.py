"""Expert compute over the device slot pool: one admission round of one MoE layer.

The offload runtime decides, on the host, which rows (token x top-k choice) each admission round
computes and in which slot each row's expert sits; a :class:`RoundPlan` carries that to the device
in one non-blocking copy. An implementation then computes every row of the round reading the
weights straight from the layer's slot tensor ``[slots, expert_numel]`` (views, no copies: see
:func:`slot_views`) and writes ``weight x expert(x)`` in float32 into the layer's output rows.
The runtime sums a token's top-k rows in float32 and casts once, so the result does not depend on
how the experts were split into rounds, and bf16 outputs are not rounded expert by expert.

Weights of another dtype than the hidden states (bf16 slots under fp32 activations, ``numerics=
exact``) are upcast inside the compute; the arithmetic runs in the wider of the two dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.types.moe import ExpertLayout, MoESpec, row_parts


# ---------------------------------------------------------------------------------------------- data


@dataclass
class SlotViews:
    """One layer's slot tensor seen as stacked weights (views: no copy)."""

    gate_up: torch.Tensor  # [S, 2I, H], gate rows first
    down: torch.Tensor  # [S, H, I]
    gate_up_bias: torch.Tensor | None  # [S, 2I]
    down_bias: torch.Tensor | None  # [S, H]


def slot_views(slots: torch.Tensor, spec: MoESpec) -> SlotViews:
    """Views of ``slots [S, expert_numel]`` in the canonical row layout (:func:`row_parts`)."""
    views = {}
    for part, (offset, shape) in row_parts(spec).items():
        numel = int(np.prod(shape))
        views[part] = slots[:, offset:offset + numel].unflatten(1, shape)
    return SlotViews(views["gate_up"], views["down"], views.get("gate_up_bias"), views.get("down_bias"))


@dataclass
class RoundPlan:
    """The rows one admission round computes, sorted by slot.

    ``rows`` are flat positions ``token * top_k + choice``; ``counts[s]`` rows use slot ``s`` and
    come in one run (``offsets[s]`` is the run's end). Device tensors arrive in one non-blocking
    copy (on a CPU they are the host arrays themselves); ``counts`` stays on the host (the loop, the
    Triton block table and the upcast's compact groups read it, no sync).
    """

    rows: torch.Tensor  # int64 [n], device
    row_slot: torch.Tensor  # int64 [n], device: the slot of each sorted row
    offsets: torch.Tensor  # int32 [S], device: cumulative ends of each slot's run
    counts: np.ndarray  # int64 [S], host
    extra: dict[str, torch.Tensor]  # implementation-specific device index tensors (Triton's block table)


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host int64 arrays on ``device`` in ONE copy (pinned and non-blocking on CUDA), split into views."""
    sizes = [len(a) for a in arrays.values()]
    packed = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays.values()]))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    elif packed.device != device:
        packed = packed.to(device)
    return dict(zip(arrays, torch.split(packed, sizes)))


# ---------------------------------------------------------------------------------------------- base


class ExpertCompute:
    """Computes one admission round of one layer (see the module docstring)."""

    name = "?"

    def host_extra(self, counts: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        """Extra host index arrays this implementation wants on the device (packed with the plan's)."""
        return {}

    def plan(self, flat_slots: np.ndarray, num_slots: int, device: torch.device) -> RoundPlan:
        """The plan of a round: ``flat_slots[row]`` is the slot of each flat row, -1 for rows of other rounds.

        A handful of numpy calls on the host; on a CPU the device tensors are views of the host
        arrays (no packing, no copy), elsewhere they travel in one copy (:func:`to_device`).
        """
        order = np.argsort(flat_slots, kind="stable")  # by slot; rows of other rounds (-1) come first
        row_slot = flat_slots[order]
        skip = int(np.searchsorted(row_slot, 0))
        if skip:
            order, row_slot = order[skip:], row_slot[skip:]
        counts = np.bincount(row_slot, minlength=num_slots)
        ends = np.cumsum(counts)
        extra = self.host_extra(counts, ends - counts)
        if device.type == "cpu" and not extra:
            return RoundPlan(torch.from_numpy(order), torch.from_numpy(row_slot.astype(np.int64, copy=False)),
                             torch.from_numpy(ends.astype(np.int32)), counts, {})
        dev = to_device({"rows": order, "row_slot": row_slot, "offsets": ends, **extra}, device)
        extra = {k: v for k, v in dev.items() if k not in ("rows", "row_slot", "offsets")}
        return RoundPlan(dev["rows"], dev["row_slot"], dev["offsets"].to(torch.int32), counts, extra)

    def run(self, views: SlotViews, hidden: torch.Tensor, weights: torch.Tensor, top_k: int, plan: RoundPlan,
            layout: ExpertLayout, act_fn: nn.Module | None, out: torch.Tensor) -> None:
        """Write ``weights[row] * expert_slot(row)(hidden[row // top_k])`` (float32) into ``out[row]``
        for every row of ``plan``; ``weights`` is the flat routing weights, ``out`` float32 [T*K, H]."""
        raise NotImplementedError


def activate(gate_up: torch.Tensor, layout: ExpertLayout, act_fn: nn.Module | None) -> torch.Tensor:
    """The gated activation on canonical (gate rows first) gate/up outputs."""
    gate, up = gate_up.chunk(2, dim=-1)
    if layout.activation == "clamped_swiglu":
        return clamped_swiglu(gate, up, layout.alpha, layout.limit)
    return (act_fn if act_fn is not None else F.silu)(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation on split (not interleaved) gate and up halves."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _compute_dtype(hidden: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, weights.dtype)
