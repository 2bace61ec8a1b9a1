"""The Triton copy engine (``cache.copy=triton``): one kernel launch per batch reading the pinned
host store directly (zero-copy). Triton is imported only when a :class:`TritonCopyEngine` is
constructed (or its kernel first built), so importing this module never imports triton."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from specfit.offload.copy.base import Timing, _ids_to_device
from specfit.offload.copy.streamed import _StreamedCopy


_TRITON_KERNEL: Any = None
_TRITON_KERNEL_INTERPRETED: bool | None = None
# CUDA limits grid dimension y to 65535; programs on axis 1 loop over the remaining chunks.
_MAX_GRID_Y = 65535
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value (Triton's own spelling rules)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def _triton_kernel() -> Any:
    """Import triton and define the copy kernel on first use (keeps triton out of ``import specfit``)."""
    global _TRITON_KERNEL, _TRITON_KERNEL_INTERPRETED
    interpret = triton_interpret_enabled()
    if _TRITON_KERNEL is not None and _TRITON_KERNEL_INTERPRETED == interpret:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows_kernel(
        store_ptr, slots_ptr, src_ptr, dst_ptr,
        row_words, store_row_stride, slots_row_stride,
        BLOCK: tl.constexpr,
    ):
        # program (i, c): expert i of the batch, chunk c (and every num_programs(1)-th chunk after
        # it, only when the row has more than 65535 chunks).
        i = tl.program_id(0)
        c = tl.program_id(1)
        src = tl.load(src_ptr + i).to(tl.int64)
        dst = tl.load(dst_ptr + i).to(tl.int64)
        src_row = store_ptr + src * store_row_stride
        dst_row = slots_ptr + dst * slots_row_stride
        n_chunks = tl.cdiv(row_words, BLOCK)
        for chunk in range(c, n_chunks, tl.num_programs(1)):
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_words
            vals = tl.load(src_row + offs, mask=mask)
            tl.store(dst_row + offs, vals, mask=mask)

    _TRITON_KERNEL, _TRITON_KERNEL_INTERPRETED = _copy_rows_kernel, interpret
    return _TRITON_KERNEL


def _word_size(*tensors: torch.Tensor) -> int:
    """Widest integer word (8/4/2/1 bytes) that tiles every row of every tensor exactly.

    Copying as integer words makes the kernel dtype-agnostic (bit-exact for any dtype, NaN payloads
    included) and gives each thread wide (vectorisable) loads from host memory.
    """
    for w in (8, 4, 2):
        if all(
            (t.shape[1] * t.element_size()) % w == 0
            and (t.stride(0) * t.element_size()) % w == 0
            and t.data_ptr() % w == 0
            for t in tensors
        ):
            return w
    return 1


def _words(t: torch.Tensor, w: int) -> torch.Tensor:
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(_WORD_DTYPES[w])


class TritonCopyEngine(_StreamedCopy):
    """One Triton kernel launch copies every expert of the call: grid (n, cdiv(P, BLOCK)).

    On CUDA the store must be pinned host memory (or already on the slots' device): the kernel reads
    it directly through unified virtual addressing (pinned allocations are mapped into the device's
    address space), so the data crosses PCIe once with no staging copy and no per-expert launch.
    Pageable memory is not device-accessible, hence the pinned check. On CPU the kernel runs under
    ``TRITON_INTERPRET=1`` (the CI path).
    """

    name = "triton"
    emulated = False

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        block_bytes: int = 16384,
        num_warps: int = 4,
        timing: Timing = "wall",
        order_after_compute: bool = True,
    ) -> None:
        super().__init__(device, timing, order_after_compute)
        if block_bytes < 8 or block_bytes & (block_bytes - 1):
            raise ValueError(f"block_bytes must be a power of two >= 8, got {block_bytes}")
        self.block_bytes = block_bytes
        self.num_warps = num_warps
        dev_type = self.device.type if self.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.interpret = triton_interpret_enabled()
        if dev_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("TritonCopyEngine: device is CUDA but torch.cuda.is_available() is False")
        if dev_type != "cuda" and not self.interpret:
            raise RuntimeError(
                "the Triton copy engine needs a CUDA device; without one, run Triton's interpreter on "
                "CPU tensors by setting the environment variable TRITON_INTERPRET=1 before starting "
                "Python, or choose the plain engine with cache.copy=torch (or cache.copy=emulated)"
            )
        try:
            self._kernel = _triton_kernel()
        except ImportError as exc:
            raise RuntimeError(
                f"the Triton copy engine needs the triton package ({exc}); install triton or use cache.copy=torch"
            ) from exc

    def _prepare(self, store: torch.Tensor, src: torch.Tensor, slots: torch.Tensor,
                 dst: torch.Tensor) -> Callable[..., None]:
        if store.stride(1) != 1 or slots.stride(1) != 1:
            raise ValueError("TritonCopyEngine needs rows contiguous in memory (stride(1) == 1)")
        if slots.is_cuda:
            if store.device != slots.device and not (store.device.type == "cpu" and store.is_pinned()):
                raise ValueError(
                    "TritonCopyEngine reads the host store directly from the GPU kernel (zero-copy), "
                    "which requires pinned host memory: allocate the store with pin_memory=True "
                    f"(got a {'pageable CPU' if store.device.type == 'cpu' else str(store.device)} "
                    "tensor), or use cache.copy=torch"
                )
        elif not self.interpret:
            raise RuntimeError(
                "TritonCopyEngine got CPU slots without TRITON_INTERPRET=1; set it before starting "
                "Python or use cache.copy=torch"
            )
        elif store.is_cuda:
            raise ValueError("TritonCopyEngine: store on CUDA but slots on CPU (copies go host -> device)")

        w = _word_size(store, slots)
        store_w, slots_w = _words(store, w), _words(slots, w)
        row_words = store_w.shape[1]
        if row_words >= 2**31:
            raise ValueError(f"expert rows of {row_words} words exceed the kernel's 32-bit offsets")
        block = max(1, self.block_bytes // w)
        grid = (src.numel(), min(_cdiv(row_words, block), _MAX_GRID_Y))
        kernel, num_warps = self._kernel, self.num_warps

        def enqueue(mark: Callable[[], None] | None = None) -> None:  # one launch: no per-expert marks
            if slots.is_cuda:
                s_ids, d_ids = _ids_to_device(src, dst, slots.device)
            else:
                s_ids, d_ids = src.contiguous(), dst.contiguous()
            kernel[grid](
                store_w, slots_w, s_ids, d_ids,
                row_words, store_w.stride(0), slots_w.stride(0),
                BLOCK=block, num_warps=num_warps,
            )

        return enqueue

    def describe(self) -> dict:
        return {
            "name": self.name,
            "emulated": self.emulated,
            "block_bytes": self.block_bytes,
            "num_warps": self.num_warps,
            "interpret": self.interpret,
            **self._settings(),
        }
