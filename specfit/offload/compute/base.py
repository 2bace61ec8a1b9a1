"""Expert compute over the device slot pool: one admission round of one MoE layer.

The offload runtime decides, on the host, which rows (token x top-k choice) each admission round
computes and in which slot each row's expert sits; a :class:`RoundPlan` carries that to the device
in one non-blocking copy. An implementation then computes every row of the round reading the
weights straight from the layer's slot tensor ``[slots, expert_numel]`` (views, no copies: see
:func:`slot_views`) and writes ``weight x expert(x)`` in float32 into the layer's output rows.
The runtime sums a token's top-k rows in float32 and casts once, so the result does not depend on
how the experts were split into rounds, and bf16 outputs are not rounded expert by expert.

Implementations (``model.expert_compute``):

- ``loop``: a Python loop over the round's slots, a few ops per expert: the reference.
- ``grouped``: ``torch._grouped_mm`` over every slot (empty groups for idle slots): one grouped
  GEMM for gate/up and one for down, a constant number of ops whatever the number of experts.
- ``triton``: a fused-MoE style Triton kernel (CUDA; CPU only under ``TRITON_INTERPRET=1``), see
  :mod:`specfit.offload.compute.triton`.
- ``auto``: ``triton`` on CUDA when Triton imports, ``grouped`` otherwise.

Weights of another dtype than the hidden states (bf16 slots under fp32 activations, ``numerics=
exact``) are upcast inside the compute; the arithmetic runs in the wider of the two dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.types.moe import ExpertLayout, MoESpec, clamped_swiglu, row_parts
from specfit.errors import ConfigError

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


def _compute_dtype(hidden: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, weights.dtype)


# ---------------------------------------------------------------------------------------------- loop


class LoopCompute(ExpertCompute):
    """One expert at a time (about ten ops each): the reference the others are tested against."""

    name = "loop"

    def run(self, views: SlotViews, hidden: torch.Tensor, weights: torch.Tensor, top_k: int, plan: RoundPlan,
            layout: ExpertLayout, act_fn: nn.Module | None, out: torch.Tensor) -> None:
        dtype = _compute_dtype(hidden, views.gate_up)
        start = 0
        for slot, n in enumerate(plan.counts.tolist()):
            if not n:
                continue
            rows = plan.rows[start:start + n]
            start += n
            x = hidden[rows // top_k].to(dtype)
            bias = views.gate_up_bias[slot].to(dtype) if views.gate_up_bias is not None else None
            h = activate(F.linear(x, views.gate_up[slot].to(dtype), bias), layout, act_fn)
            bias = views.down_bias[slot].to(dtype) if views.down_bias is not None else None
            y = F.linear(h, views.down[slot].to(dtype), bias)
            out[rows] = y.float() * weights[rows, None].float()


# ---------------------------------------------------------------------------------------------- grouped


class GroupedCompute(ExpertCompute):
    """``torch._grouped_mm`` over the slot pool: a constant number of ops per round.

    Same-dtype weights are read in place, one group per slot (idle slots are empty groups). Weights
    of a narrower dtype than the activations are gathered for the round's slots and upcast first
    (two ops, whatever the number of experts), since grouped_mm does not mix dtypes.
    """

    name = "grouped"

    def run(self, views: SlotViews, hidden: torch.Tensor, weights: torch.Tensor, top_k: int, plan: RoundPlan,
            layout: ExpertLayout, act_fn: nn.Module | None, out: torch.Tensor) -> None:
        dtype = _compute_dtype(hidden, views.gate_up)
        gate_up, down, offsets, counts = views.gate_up, views.down, plan.offsets, plan.counts
        gu_bias, dn_bias = views.gate_up_bias, views.down_bias
        row_slot = plan.row_slot
        if gate_up.dtype != dtype:  # upcast only the round's slots (compact groups)
            used = np.flatnonzero(counts)
            groups = to_device({"used": used, "used_offsets": np.cumsum(counts[used]),
                                "row_group": np.repeat(np.arange(len(used)), counts[used])}, hidden.device)
            used = groups["used"]
            gate_up, down = gate_up.index_select(0, used).to(dtype), down.index_select(0, used).to(dtype)
            offsets, row_slot = groups["used_offsets"].to(torch.int32), groups["row_group"]
            counts = counts[counts > 0]
            gu_bias = gu_bias.index_select(0, used).to(dtype) if gu_bias is not None else None
            dn_bias = dn_bias.index_select(0, used).to(dtype) if dn_bias is not None else None
        x = hidden.index_select(0, plan.rows // top_k).to(dtype)
        h = grouped_mm(x, gate_up.transpose(1, 2), offsets, counts)
        if gu_bias is not None:
            h = h + gu_bias.index_select(0, row_slot)
        h = activate(h, layout, act_fn)
        y = grouped_mm(h, down.transpose(1, 2), offsets, counts)
        if dn_bias is not None:
            y = y + dn_bias.index_select(0, row_slot)
        out.index_copy_(0, plan.rows, y.float() * weights.index_select(0, plan.rows).float().unsqueeze(1))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """``x[rows of group g] @ weight[g]`` for groups ending at ``offsets`` (int32, device; ``counts``
    the same on the host): torch._grouped_mm, or an equivalent batched matmul where it refuses the
    case (a torch without it, a dtype or stride its kernel does not take)."""
    try:
        return torch._grouped_mm(x, weight, offs=offsets)
    except (RuntimeError, NotImplementedError, AttributeError):
        return _padded_bmm(x, weight, counts)


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """The fallback: the used groups padded to the longest and one ``bmm`` (index arrays from the host)."""
    used = np.flatnonzero(counts)
    starts = np.cumsum(counts) - counts
    group = np.repeat(np.arange(len(used)), counts[used])
    pos = np.arange(len(group)) - np.repeat(starts[used], counts[used])
    idx = to_device({"used": used, "group": group, "pos": pos}, x.device)
    padded = x.new_zeros(len(used), int(counts.max(initial=0)), x.shape[1])
    padded[idx["group"], idx["pos"]] = x
    return torch.bmm(padded, weight.index_select(0, idx["used"]))[idx["group"], idx["pos"]]
