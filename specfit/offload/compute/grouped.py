"""``model.expert_compute=grouped``: ``torch._grouped_mm`` over every slot (empty groups for idle slots):
one grouped GEMM for gate/up and one for down, a constant number of ops whatever the number of experts."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specfit.offload.compute.base import ExpertCompute, RoundPlan, SlotViews, _compute_dtype, activate, to_device
from specfit.types.moe import ExpertLayout


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
