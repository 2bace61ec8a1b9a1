"""The copy engines' contract: move a layer's missing experts from the host expert store into device
cache slots. What every engine returns (:class:`CopyRecord`, :class:`CopyTicket`), the
:class:`CopyEngine` Protocol and the argument checks; each engine lives in a module of its own and
:func:`specfit.offload.copy.factory.make_copy_engine` builds the one ``cache.copy`` names.

Layout (fixed by the runtime): ``store[E, P]`` holds one expert per row (gate_up_proj [2I, H]
flattened, then down_proj [H, I] flattened), in pinned host memory on CUDA; ``slots[S, P]`` is the
device slot pool of the same dtype. One ``copy`` call moves a batch: row ``src_ids[i]`` of the store
into row ``dst_slots[i]`` of the slots.

Engines (chosen with ``cache.copy``):

- ``torch`` (:mod:`~specfit.offload.copy.torch`): ``copy_(non_blocking=True)`` per expert on a dedicated CUDA copy stream.
- ``triton`` (:mod:`~specfit.offload.copy.triton`): one Triton kernel launch for the whole batch; on CUDA the kernel reads the pinned
  host store directly (zero-copy through unified virtual addressing). On CPU it runs under
  ``TRITON_INTERPRET=1``, which is how CI tests it.
- ``emulated`` (:mod:`~specfit.offload.copy.emulated`): wraps a real engine and charges each call the wall time a reference link would
  take (see :mod:`specfit.types.link_profiles`), so CPU runs pay realistic H2D time and say so.

Ordering on CUDA: the copy stream first waits for the compute stream (a slot about to be
overwritten may still be read by queued compute), and the compute stream then waits on the copy's
event, so compute never reads a slot before its copy lands. A caller that tracks each slot's last
use with its own events could turn the first wait off (``order_after_compute=False``) and make
``engine.copy_stream`` wait on those instead; the offload runtime does not, so it refuses such an
engine.

Timing on CUDA (``timing=``): ``"wall"`` (default) charges a synchronous ``copy`` the host wall time
from the call until the copy's event completes, i.e. the stall a synchronous caller sees, including
any queued compute the copy had to wait behind, and an issued copy (waited later: a prefetch, a
pipelined round) the CUDA-event time of the copy alone; ``"events"`` always reports the event time
(pure transfer time); both block the host on the copy's event when it is waited for, and that
block is the stall. ``"none"`` never blocks the host and reports only the enqueue time (a lower
bound) for production runs that must avoid a GPU-to-host sync per layer. On CPU every copy is
synchronous and ``seconds`` is its wall time.

Asynchronous copies: ``issue`` enqueues a batch and returns a :class:`CopyTicket` at once; the
caller waits on the ticket only just before it computes on those slots, so copies overlap compute.
``copy`` is ``issue`` then ``wait``. On CUDA the ticket holds the copy stream's event and waiting
makes the compute stream wait on it (with ``timing="none"`` nothing blocks the host; the measuring
timings block on that one event, never on the device). The emulated link is one FIFO timeline: a
transfer starts when it is issued or when the link frees up, whichever is later, and completes after
its charge; waiting on it really waits (wall clock) until then, so overlap on a CPU is measured.

The CUDA stream handling the torch and Triton engines share is :mod:`specfit.offload.copy.streamed`.
Triton is imported only when a :class:`~specfit.offload.copy.triton.TritonCopyEngine` is
constructed, so importing specfit never imports triton.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch


Timing = Literal["wall", "events", "none"]


@dataclass
class CopyRecord:
    """What one ``copy`` call moved and the time charged to it."""

    experts: int  # experts copied by this call
    bytes: int  # real bytes moved (experts * P * element size)
    seconds: float  # time charged: measured wall time, or the emulated link's charge


def _no_wait() -> float:
    return 0.0


@dataclass(eq=False)
class CopyTicket:
    """An issued copy: what it moves, its charge, when it completes, and how to wait for it.

    ``seconds``: the charge (emulated link), the measured copy time (CPU; CUDA once waited or
    settled with a measuring timing) or the enqueue time (CUDA until then, or ``timing="none"``). ``ready_at``: the
    ``time.perf_counter()`` value (the engine's clock) at which the copy completes on the emulated
    link; for a synchronous copy, the time the call returned; on CUDA, the issue time (the device
    decides). ``wait()`` returns the seconds the caller blocked; waiting twice blocks once.
    """

    experts: int
    bytes: int
    seconds: float
    ready_at: float
    _wait: Callable[[], float] = field(default=_no_wait, repr=False)
    _remaining: Callable[[], float] | None = field(default=None, repr=False)
    event: Any = None  # the copy stream's CUDA event (None off CUDA)
    waited: bool = False
    _row: Callable[[int], CopyTicket] | None = field(default=None, repr=False)
    _settle: Callable[[], None] | None = field(default=None, repr=False)

    def wait(self) -> float:
        """Block (or make the compute stream wait) until the copy has landed; seconds blocked."""
        if self.waited:
            return 0.0
        self.waited = True
        return self._wait()

    def settle(self) -> None:
        """Make ``seconds`` the copy's own time where it is still its enqueue time (a CUDA copy no
        pass waited for: a prefetch evicted unused). Blocks the host on that copy's event alone and
        leaves the compute stream as it is: for the run's statistics, once decoding is over."""
        if not self.waited and self._settle is not None:
            self._settle()

    def remaining(self) -> float:
        """Seconds until the copy lands, as far as the host knows (0.0 once it has)."""
        if self.waited:
            return 0.0
        if self._remaining is not None:
            return self._remaining()
        return 0.0

    def in_flight(self) -> bool:
        """Not waited for, and not known to have landed (a ticket that cannot tell counts as in flight)."""
        return not self.waited and (self._remaining is None or self._remaining() > 0.0)

    def record(self) -> CopyRecord:
        return CopyRecord(self.experts, self.bytes, self.seconds)

    def row(self, index: int) -> CopyTicket:
        """The ticket of the batch's ``index``-th expert alone, where the engine knows when each lands
        (the emulated link: expert i lands ``i + 1`` expert charges after the transfer starts; the
        torch engine on CUDA: an event on the copy stream after each expert's copy); otherwise (the
        Triton engine's single launch) the batch's own ticket. A layer that waits for its experts
        then waits for them, not for the rest of a batch it may not use (a prefetch's last, least
        likely pick)."""
        return self._row(index) if self._row is not None else self


@runtime_checkable
class CopyEngine(Protocol):
    """Moves ``store[src_ids]`` into ``slots[dst_slots]`` in one batched call.

    Beyond these members (which ``Engine(copy=...)`` checks an engine object for), the runtime reads
    a few optional attributes with documented defaults, so an engine written against this Protocol
    alone keeps working: ``inner`` (the engine an emulated link wraps; default None), and those of
    the real engines: ``device`` (default None: not CUDA), ``timing`` (default ``"none"``) and
    ``order_after_compute`` (default True). Every engine here sets the ones that apply to it; they
    are read only through :func:`engines_within` and :func:`waits_measured`.
    """

    name: str
    emulated: bool  # True when `seconds` is a modelled charge, not a measured transfer

    def issue(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyTicket: ...

    def copy(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyRecord: ...

    def describe(self) -> dict: ...


# --------------------------------------------------------------------------------------------------
# Shared argument checks


def _as_index(ids: torch.Tensor | Any, what: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1:
        return ids  # the runtime's own ids: nothing to convert
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(f"{what} must be a 1-D tensor of ids, got shape {tuple(ids.shape)}")
    if ids.dtype != torch.int64:
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor (int64), got {ids.dtype}")
        ids = ids.to(torch.int64)
    return ids


def _check_args(
    store: torch.Tensor, src_ids: Any, slots: torch.Tensor, dst_slots: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes, dtypes and (for host-side ids, where it is free of syncs) id ranges.

    Out-of-range ids would make the Triton kernel read or write arbitrary memory, and duplicate
    destination slots would race, so both are rejected up front. Ids that already live on a CUDA
    device are not range-checked (that would cost a device-to-host sync per call).
    """
    if store.dim() != 2 or slots.dim() != 2:
        raise ValueError(
            f"store and slots must be 2-D [rows, P]; got store {tuple(store.shape)}, slots {tuple(slots.shape)}"
        )
    if store.shape[1] != slots.shape[1]:
        raise ValueError(f"store row size {store.shape[1]} != slot row size {slots.shape[1]}")
    if store.dtype != slots.dtype:
        raise TypeError(f"store dtype {store.dtype} != slots dtype {slots.dtype}")
    src = _as_index(src_ids, "src_ids")
    dst = _as_index(dst_slots, "dst_slots")
    if src.numel() != dst.numel():
        raise ValueError(f"src_ids has {src.numel()} ids but dst_slots has {dst.numel()}")
    # Batches are small (at most a layer's experts): plain Python on the host ids is cheaper than
    # several tensor reductions.
    if src.numel() and not src.is_cuda:
        ids = src.tolist()
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= store.shape[0]:
            raise IndexError(f"src_ids out of range [0, {store.shape[0]}): min {lo}, max {hi}")
    if dst.numel() and not dst.is_cuda:
        ids = dst.tolist()
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= slots.shape[0]:
            raise IndexError(f"dst_slots out of range [0, {slots.shape[0]}): min {lo}, max {hi}")
        if len(set(ids)) != len(ids):
            raise ValueError("dst_slots contains duplicate slots; each slot may be written once per call")
    return src, dst


def _nbytes(store: torch.Tensor, src: torch.Tensor) -> int:
    """Bytes moved by copying the rows ``src`` of ``store``."""
    return src.numel() * store.shape[1] * store.element_size()


def _ids_to_device(src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id vectors on ``device``, moved in one small asynchronous H2D copy.

    The host copy is staged through pinned memory: ``cudaMemcpyAsync`` from pageable memory may
    block the host until the (copy) stream drains, i.e. behind queued compute, which would be a
    hidden sync per layer. Torch's pinned allocator records the copy's event, so the staging buffer
    is not reused before the copy has read it.
    """
    if device.type != "cuda":
        return src.to(device), dst.to(device)
    if src.device == device and dst.device == device:
        return src, dst
    ids = torch.stack((src.cpu(), dst.cpu())).pin_memory().to(device, non_blocking=True)
    return ids[0], ids[1]


def waits_measured(engine: CopyEngine) -> bool:
    """Whether a ticket's ``wait()`` returns the time the host really blocked for its copy: the
    emulated link, or a CUDA engine with a measuring timing (it synchronises on the copy's event).
    A pass's time then holds its stall, not the seconds of every copy it issued (prefetches and
    pipelined rounds land while it computes). On CUDA that stall is the host's block, an upper bound
    of the GPU's idle time where rounds are pipelined (see :func:`specfit.offload.copy.streamed._cuda_ticket`)."""
    if engine.emulated:
        return True
    device = getattr(engine, "device", None)
    return device is not None and torch.device(device).type == "cuda" and getattr(engine, "timing", "none") != "none"


def engines_within(copy_engine: CopyEngine) -> Iterator[Any]:
    """The copy engine and the engines it wraps (an emulated link's real engine, ``inner``)."""
    engine: Any = copy_engine
    while engine is not None:
        yield engine
        engine = getattr(engine, "inner", None)
