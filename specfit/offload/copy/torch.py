"""The torch copy engine (``cache.copy=torch``): ``copy_(non_blocking=True)`` per expert on the
copy stream, or one batched index copy when store and slots share a CUDA device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specfit.offload.copy.base import Timing, _ids_to_device
from specfit.offload.copy.streamed import _StreamedCopy


class TorchCopyEngine(_StreamedCopy):
    """Plain ``copy_(non_blocking=True)`` per expert; a batched index copy when both are on one CUDA
    device. On a CPU the per-expert copy is a plain memcpy: 3-5x cheaper than ``index_select`` +
    ``index_copy_`` (measured: 1-8 experts of the demo, 10-70 us against 30-235 us), which allocate
    and fill a gathered temporary first.

    Per-expert copies need the ids on the host (``.tolist()``); ids on a CUDA device would force a
    sync, so the cache should keep its bookkeeping ids on the CPU. A store that is not pinned still
    works but each H2D copy is then synchronous (pageable memory is staged by the driver).
    """

    name = "torch"
    emulated = False

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        timing: Timing = "wall",
        order_after_compute: bool = True,
    ) -> None:
        super().__init__(device, timing, order_after_compute)

    def _prepare(self, store: torch.Tensor, src: torch.Tensor, slots: torch.Tensor,
                 dst: torch.Tensor) -> Callable[..., None]:
        if store.device == slots.device and slots.is_cuda:
            def enqueue(mark: Callable[[], None] | None = None) -> None:  # one gather: no per-expert marks
                s, d = _ids_to_device(src, dst, slots.device)
                slots.index_copy_(0, d, store.index_select(0, s))
        else:  # host to device, or on a CPU: one memcpy per expert, no gathered temporary
            pairs = list(zip(src.tolist(), dst.tolist()))

            def enqueue(mark: Callable[[], None] | None = None) -> None:
                for s_i, d_i in pairs:
                    slots[d_i].copy_(store[s_i], non_blocking=True)
                    if mark is not None:  # on CUDA: this expert's own event
                        mark()

        return enqueue

    def describe(self) -> dict:
        return {"name": self.name, "emulated": self.emulated, **self._settings()}
