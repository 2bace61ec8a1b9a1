"""``model.expert_compute=loop``: a Python loop over the round's slots, a few ops per expert: the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specfit.offload.compute.base import ExpertCompute, RoundPlan, SlotViews, _compute_dtype, activate
from specfit.types.moe import ExpertLayout


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
