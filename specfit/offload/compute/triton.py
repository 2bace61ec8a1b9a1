"""Fused-MoE style Triton kernels over the slot pool (``model.expert_compute=triton``).

One launch per projection and admission round, as vLLM's and SGLang's fused MoE: the round's
rows are sorted by slot on the host and cut into blocks of ``BLOCK_M`` rows of one slot (a block
table: slot, first row, end of the slot's run); program (b, n) multiplies block b's rows by the
``BLOCK_N`` output columns n of its slot's weight, read in place from the slot tensor, with
float32 accumulation.

- gate/up: ``h[p] = hidden[rows[p] // top_k] @ gate_up[slot].T (+ bias)`` into a compact float32
  ``[n, 2I]`` (p the sorted position);
- the gated activation (SiLU-and-mul or gpt-oss's clamped SwiGLU) in torch on ``h``;
- down: ``out[rows[p]] = weight[rows[p]] * (act[p] @ down[slot].T (+ bias))``, float32.

Every program writes its outputs once (no atomics), so a row's result does not depend on which
other rows share its pass, and autotuning may rerun a launch. ``BLOCK_M`` follows the round's
longest run (16 for decode's 1-8 rows per expert, up to 64 for verification), the other block
sizes are autotuned per shape, except the reduction step ``BLOCK_K``, fixed so that a row's dot
products add up in one order whatever the pass's shape (batch invariance is the aim; it is not yet
verified on a GPU). With float32 activations the dot products run in IEEE float32
(weights upcast in registers: ``numerics=exact`` over bf16 slots); with bf16/fp16 activations on
tensor cores with float32 accumulation. Under ``TRITON_INTERPRET=1`` (CPU tests) one config is tried.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from specfit.offload.compute.base import ExpertCompute, RoundPlan, SlotViews, activate
from specfit.types.moe import ExpertLayout
from specfit.errors import ConfigError

_KERNEL: Any = None
_KERNEL_INTERPRETED: bool | None = None
#: The reduction step over K, the same for every shape: a row's sum runs in the same order whatever
#: BLOCK_M and BLOCK_N the pass gets (toward batch invariance: decode and verification agree).
BLOCK_K = 64


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value (Triton's own spelling rules)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def block_m(counts: np.ndarray) -> int:
    """Rows per block: the round's longest run of one slot, rounded up to 16, 32 or 64."""
    longest = int(counts.max(initial=0))
    return 16 if longest <= 16 else 32 if longest <= 32 else 64


def block_table(counts: np.ndarray, starts: np.ndarray, rows_per_block: int) -> dict[str, np.ndarray]:
    """(slot, first sorted row, end of the slot's run) of every block of ``rows_per_block`` rows."""
    used = np.flatnonzero(counts)
    per_slot = -(-counts[used] // rows_per_block)
    slot = np.repeat(used, per_slot)
    first_block = np.cumsum(per_slot) - per_slot
    j = np.arange(len(slot)) - np.repeat(first_block, per_slot)
    start = np.repeat(starts[used], per_slot) + j * rows_per_block
    end = np.repeat(starts[used] + counts[used], per_slot)
    return {"block_slot": slot, "block_start": start, "block_end": end}


def _kernel() -> Any:
    """Import triton and define the kernel on first use (TRITON_INTERPRET is read when it is defined)."""
    global _KERNEL, _KERNEL_INTERPRETED
    interpret = interpreting()
    if _KERNEL is not None and _KERNEL_INTERPRETED == interpret:
        return _KERNEL
    import triton
    import triton.language as tl

    if interpret:
        configs = [triton.Config({"BLOCK_N": 32}, num_warps=4)]
    else:  # decode (BLOCK_M 16) and verification (32-64) shapes share these; the key separates them
        configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                   for n, w, s in ((32, 4, 4), (64, 4, 3), (64, 4, 5), (128, 4, 3), (128, 8, 4), (256, 8, 3))]

    # Each new shape autotunes six configs in every process (their compiles are in Triton's disk
    # cache after the first); cache_results keeps the choice on disk too, so a later process does
    # not measure them again. (On the first H200 run, a fresh real-dims bench process got through
    # only three 48-token decodes in the minute after loading; not profiled, autotuning suspected.)
    persist = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

    @triton.autotune(configs=configs, key=["N", "K", "BLOCK_M", "GATHER", "FP32"], **persist)
    @triton.jit
    def grouped_linear(
        a_ptr, w_ptr, bias_ptr, route_ptr, c_ptr,
        rows_ptr, block_slot_ptr, block_start_ptr, block_end_ptr,
        N, K, top_k, stride_am, stride_ws, stride_wn, stride_bs, stride_cm,
        GATHER: tl.constexpr,  # True: A rows = rows // top_k, C rows = sorted positions; False: the reverse, x route weight
        HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        b = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        slot = tl.load(block_slot_ptr + b).to(tl.int64)
        start = tl.load(block_start_ptr + b)
        end = tl.load(block_end_ptr + b)
        pos = start + tl.arange(0, BLOCK_M)
        in_block = pos < end
        rows = tl.load(rows_ptr + pos, mask=in_block, other=0)
        if GATHER:
            a_rows = rows // top_k
            c_rows = pos
        else:
            a_rows = pos
            c_rows = rows
        cols = n0 + tl.arange(0, BLOCK_N)
        in_cols = cols < N
        w_base = w_ptr + slot * stride_ws
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            in_k = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=in_block[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=in_k[:, None] & in_cols[None, :], other=0.0)
            if FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a.to(w.dtype), w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot * stride_bs + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
        if not GATHER:
            acc *= tl.load(route_ptr + rows, mask=in_block, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + c_rows[:, None] * stride_cm + cols[None, :], acc, mask=in_block[:, None] & in_cols[None, :])

    _KERNEL, _KERNEL_INTERPRETED = grouped_linear, interpret
    return _KERNEL


class TritonCompute(ExpertCompute):
    """Two fused-MoE launches per round (see the module docstring)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not interpreting():
            raise ConfigError(f"model.expert_compute=triton needs a CUDA device (got {device}); on CPU Triton runs "
                              f"only under TRITON_INTERPRET=1: use grouped or auto")
        try:
            self._launch = _kernel()
        except ImportError as exc:
            raise ConfigError(f"model.expert_compute=triton: Triton does not import ({exc}); use grouped or auto") from exc

    def host_extra(self, counts: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        return block_table(counts, starts, block_m(counts))

    def run(self, views: SlotViews, hidden: torch.Tensor, weights: torch.Tensor, top_k: int, plan: RoundPlan,
            layout: ExpertLayout, act_fn: nn.Module | None, out: torch.Tensor) -> None:
        blocks = plan.extra["block_slot"].shape[0]
        if not blocks:
            return
        fp32 = torch.promote_types(hidden.dtype, views.gate_up.dtype) == torch.float32
        bm = block_m(plan.counts)
        hidden = hidden.contiguous()
        n_rows = plan.rows.shape[0]
        gate_up, down = views.gate_up, views.down
        h = torch.empty(n_rows, gate_up.shape[1], dtype=torch.float32, device=hidden.device)
        self._linear(hidden, gate_up, views.gate_up_bias, weights, h, plan, top_k, True, fp32, bm)
        act = activate(h, layout, act_fn).contiguous()
        self._linear(act, down, views.down_bias, weights, out, plan, top_k, False, fp32, bm)

    def _linear(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, route: torch.Tensor,
                c: torch.Tensor, plan: RoundPlan, top_k: int, gather: bool, fp32: bool, bm: int) -> None:
        import triton

        n, k = w.shape[1], w.shape[2]
        blocks = plan.extra["block_slot"].shape[0]
        grid = lambda meta: (blocks, triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
        self._launch[grid](
            a, w, bias if bias is not None else w, route, c,
            plan.rows, plan.extra["block_slot"], plan.extra["block_start"], plan.extra["block_end"],
            n, k, top_k, a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0, c.stride(0),
            GATHER=gather, HAS_BIAS=bias is not None, FP32=fp32, BLOCK_M=bm, BLOCK_K=BLOCK_K,
        )
