"""Copy engines: move a layer's missing experts from the host expert store into device cache slots.

Layout (fixed by the runtime): ``store[E, P]`` holds one expert per row (gate_up_proj [2I, H]
flattened, then down_proj [H, I] flattened), in pinned host memory on CUDA; ``slots[S, P]`` is the
device slot pool of the same dtype. One ``copy`` call moves a batch: row ``src_ids[i]`` of the store
into row ``dst_slots[i]`` of the slots.

Engines (chosen with ``cache.copy``):

- ``torch``: ``copy_(non_blocking=True)`` per expert on a dedicated CUDA copy stream.
- ``triton``: one Triton kernel launch for the whole batch; on CUDA the kernel reads the pinned
  host store directly (zero-copy through unified virtual addressing). On CPU it runs under
  ``TRITON_INTERPRET=1``, which is how CI tests it.
- ``emulated``: wraps a real engine and charges each call the wall time a reference link would
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

Triton is imported only when a :class:`TritonCopyEngine` is constructed, so importing specfit never
imports triton.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from specfit.types.link_profiles import COPY_KINDS, LinkSettings


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
    """Moves ``store[src_ids]`` into ``slots[dst_slots]`` in one batched call."""

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
# Shared validation and CUDA stream handling


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


class _StreamedCopy:
    """Runs an engine's enqueue function on a dedicated copy stream (CUDA) or inline (CPU); an engine
    supplies ``_prepare`` (its own checks and its data movement, given checked, non-empty ids), this
    class the argument checks and the copy and issue around it."""

    def __init__(self, device: torch.device | str | None, timing: Timing, order_after_compute: bool) -> None:
        if timing not in ("wall", "events", "none"):
            raise ValueError(f"timing must be 'wall', 'events' or 'none', got {timing!r}")
        self.device = torch.device(device) if device is not None else None
        self.timing: Timing = timing
        self.order_after_compute = order_after_compute
        self._streams: dict[int, torch.cuda.Stream] = {}

    def copy_stream_for(self, device: torch.device) -> torch.cuda.Stream:
        """The dedicated copy stream of a CUDA device (created on first use)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            self._streams[index] = stream
        return stream

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """Copy stream of this engine's device (None off CUDA): caches can make it wait on slot events."""
        if self.device is None or self.device.type != "cuda":
            return None
        return self.copy_stream_for(self.device)

    def copy(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyRecord:
        src, dst = _check_args(store, src_ids, slots, dst_slots)
        if not src.numel():
            return CopyRecord(0, 0, 0.0)
        enqueue = self._prepare(store, src, slots, dst)  # the engine's own data movement
        return CopyRecord(src.numel(), _nbytes(store, src), self._run(slots, enqueue))

    def issue(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyTicket:
        src, dst = _check_args(store, src_ids, slots, dst_slots)
        if not src.numel():
            return CopyTicket(0, 0, 0.0, time.perf_counter())
        return self._issue(slots, self._prepare(store, src, slots, dst), src.numel(), _nbytes(store, src))

    def _run(self, slots: torch.Tensor, enqueue: Callable[..., None]) -> float:
        """Run ``enqueue`` synchronously (a copy is its issue and its wait); its seconds as timed."""
        ticket = self._issue(slots, enqueue, 0, 0, synchronous=True)
        ticket.wait()
        return ticket.seconds

    def _issue(self, slots: torch.Tensor, enqueue: Callable[..., None], experts: int, nbytes: int,
               synchronous: bool = False) -> CopyTicket:
        """Enqueue a copy and return its ticket (see the module docstring).

        Off CUDA the copy runs now and the ticket is already complete. On CUDA the copy stream first
        waits for the compute stream (queued compute may still read a slot being overwritten), the
        copy's event is recorded, and ``wait()`` makes the compute stream wait on that event; the
        measuring timings then also block the host on that event alone (not the device). A ticket
        waited long after its issue (a prefetch, a pipelined round) is charged the copy's own time on
        the copy stream (CUDA events), not the wall time since its issue, which holds whatever ran
        meanwhile; ``timing="wall"`` keeps the wall time for a synchronous ``copy``.
        """
        t0 = time.perf_counter()
        if not slots.is_cuda:
            enqueue()
            t1 = time.perf_counter()
            # landed already: not in flight, so a wrong prefetch pick is evictable before any wait
            return CopyTicket(experts, nbytes, t1 - t0, t1, _remaining=_no_wait)
        dev = slots.device
        with torch.cuda.device(dev):
            compute = torch.cuda.current_stream(dev)
            stream = self.copy_stream_for(dev)
            if self.order_after_compute:
                stream.wait_stream(compute)
            use_events = self.timing == "events" or (self.timing == "wall" and not synchronous)
            start = torch.cuda.Event(enable_timing=True) if use_events else None
            done = torch.cuda.Event(enable_timing=use_events)
            marks: list[torch.cuda.Event] = []  # one event after each expert, where the engine copies one by one

            def mark() -> None:
                marks.append(torch.cuda.Event(enable_timing=use_events))
                marks[-1].record(stream)

            with torch.cuda.stream(stream):
                if start is not None:
                    start.record(stream)
                enqueue(mark if experts > 1 else None)
                done.record(stream)
        enqueued = time.perf_counter() - t0
        timing = self.timing  # as issued: the events were created for it
        ticket = _cuda_ticket(dev, timing, experts, nbytes, enqueued, t0, start, done)
        if len(marks) == experts > 1:  # each expert's own event: a layer waits for its experts only
            def row(index: int) -> CopyTicket:
                if not 0 <= index < experts:
                    raise IndexError(f"row {index} of a copy of {experts} experts")
                begin = (start if index == 0 else marks[index - 1]) if use_events else None  # untimed events
                return _cuda_ticket(dev, timing, 1, nbytes // experts, enqueued / experts, t0, begin, marks[index])

            ticket._row = row
        return ticket

    def _settings(self) -> dict:
        return {
            "timing": self.timing,
            "order_after_compute": self.order_after_compute,
            "device": str(self.device) if self.device is not None else None,
        }


def _cuda_ticket(dev: torch.device, timing: Timing, experts: int, nbytes: int, enqueued: float, t0: float,
                 start: Any, done: Any) -> CopyTicket:
    """The ticket of a CUDA copy that lands with ``done``, recorded on the copy stream after ``start``
    (None: not timed by events). Waiting makes the compute stream wait on ``done``; a measuring
    ``timing`` also blocks the host on ``done`` alone. That block is the stall the host sees: with
    pipelined rounds the GPU may still be computing the previous round meanwhile, so as the GPU's
    idle time it is an upper bound."""
    ticket = CopyTicket(experts, nbytes, enqueued, t0, event=done)

    def wait() -> float:
        torch.cuda.current_stream(dev).wait_event(done)  # compute never reads a slot before it lands
        if timing == "none":
            return 0.0
        t_wait = time.perf_counter()
        done.synchronize()
        now = time.perf_counter()
        ticket.seconds = start.elapsed_time(done) / 1e3 if start is not None else now - t0
        return now - t_wait

    def remaining() -> float:
        return 0.0 if done.query() else max(ticket.seconds, 1e-6)

    def settle() -> None:
        if start is not None:  # timed by events: the copy's time on the copy stream
            done.synchronize()
            ticket.seconds = start.elapsed_time(done) / 1e3

    ticket._wait, ticket._remaining, ticket._settle = wait, remaining, settle
    return ticket


# --------------------------------------------------------------------------------------------------
# torch engine


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


# --------------------------------------------------------------------------------------------------
# Triton engine

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


# --------------------------------------------------------------------------------------------------
# Emulated link


def waits_measured(engine: Any) -> bool:
    """Whether a ticket's ``wait()`` returns the time the host really blocked for its copy: the
    emulated link, or a CUDA engine with a measuring timing (it synchronises on the copy's event).
    A pass's time then holds its stall, not the seconds of every copy it issued (prefetches and
    pipelined rounds land while it computes). On CUDA that stall is the host's block, an upper bound
    of the GPU's idle time where rounds are pipelined (see :func:`_cuda_ticket`)."""
    if getattr(engine, "emulated", False):
        return True
    device = getattr(engine, "device", None)
    return device is not None and torch.device(device).type == "cuda" and getattr(engine, "timing", "none") != "none"


def _wait_until(deadline: float, spin_s: float = 2e-3) -> None:
    """Block until ``time.perf_counter() >= deadline``: spin, sleeping only what lies beyond ``spin_s``.

    A host waiting for a device copy spins (CUDA's default wait does, with fewer contexts than
    cores); one that sleeps gives its core away and pays the wake-up: tens of microseconds on an
    idle machine, milliseconds on a loaded one, plus cold caches. Measured on the demo pair (AR,
    capacity 8, a machine at load 3-4, one process, prompts interleaved): sleeping all but the last
    0.2 ms, AR's stall was 7.7 ms per token and AR with ``prefetch=auto``'s 4.4 (0.98x AR's speed);
    spinning the whole wait, 3.8 and 1.4 (1.13x). A per-layer wait on the demo is a few experts'
    charge (0.4 ms each): it spins.
    """
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > spin_s:
            time.sleep(remaining - spin_s)


class EmulatedLinkEngine:
    """One FIFO link charging each transfer ``latency + n * ref_expert_bytes / bandwidth``.

    The wrapped engine (torch by default) does the real data movement when the transfer is issued;
    the link is a timeline: a transfer starts at ``max(issue time, link free)`` and completes
    ``charge`` seconds later, and waiting on its ticket blocks (wall clock) until then. So a CPU run,
    where host and device are the same RAM, pays the transfer time of the reference deployment,
    and a transfer issued ahead of need overlaps compute exactly as far as the timeline allows.
    ``seconds`` in the ticket and record is the charge; ``link_busy_seconds`` sums the charges.
    An empty batch launches no transfer and is charged nothing.

    ``clock`` (default ``time.perf_counter``) and ``wait_until(deadline)`` (default: spin until the
    clock reaches ``deadline``, sleeping only what lies beyond 2 ms) are attributes, so tests can
    replace them and check schedules by hand.
    """

    name = "emulated"
    emulated = True

    def __init__(
        self,
        inner: CopyEngine | None = None,
        link: LinkSettings | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self.inner: CopyEngine = inner if inner is not None else TorchCopyEngine(device)
        self.link = link if link is not None else LinkSettings()
        self.bandwidth_gbps, self.latency_us, self.ref_expert_bytes = self.link.resolve()
        self.clock: Callable[[], float] = time.perf_counter
        self.wait_until: Callable[[float], None] = _wait_until
        self.link_free_at = float("-inf")  # clock time at which the last issued transfer completes
        self.link_busy_seconds = 0.0

    def charge_seconds(self, experts: int, expert_bytes: int) -> float:
        """Modelled time of one call moving ``experts`` experts of ``expert_bytes`` real bytes each."""
        if experts == 0:
            return 0.0
        per_expert = self.ref_expert_bytes if self.ref_expert_bytes is not None else expert_bytes
        return self.latency_us * 1e-6 + experts * per_expert / (self.bandwidth_gbps * 1e9)

    def issue(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyTicket:
        issued = self.clock()
        inner = self.inner.issue(store, src_ids, slots, dst_slots)
        if inner.experts == 0:
            return CopyTicket(0, 0, 0.0, issued)
        charge = self.charge_seconds(inner.experts, store.shape[1] * store.element_size())
        start = max(issued, self.link_free_at)
        done = start + charge
        self.link_free_at = done
        self.link_busy_seconds += charge
        clock, wait_until = self.clock, self.wait_until
        per_expert = (charge - self.latency_us * 1e-6) / inner.experts

        def ticket(experts: int, nbytes: int, seconds: float, ready: float, inner: CopyTicket = inner) -> CopyTicket:
            def wait() -> float:
                start = clock()
                moving = inner.in_flight()  # a device copy still running (CUDA): blocking on it is stall too
                inner.wait()
                now = clock()
                blocked = now - start if moving else 0.0
                if now >= ready:
                    return blocked
                wait_until(ready)
                return blocked + clock() - now

            return CopyTicket(experts, nbytes, seconds, ready, wait, lambda: max(ready - clock(), 0.0),
                              event=inner.event)

        def row(index: int) -> CopyTicket:
            if not 0 <= index < inner.experts:
                raise IndexError(f"row {index} of a copy of {inner.experts} experts")
            ready = done - (inner.experts - 1 - index) * per_expert  # the last row lands when the batch does
            return ticket(1, inner.bytes // inner.experts, per_expert, ready, inner.row(index))

        whole = ticket(inner.experts, inner.bytes, charge, done)
        whole._row = row
        return whole

    def copy(
        self, store: torch.Tensor, src_ids: torch.Tensor, slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> CopyRecord:
        ticket = self.issue(store, src_ids, slots, dst_slots)
        ticket.wait()
        return ticket.record()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "emulated": True,
            "profile": self.link.profile,
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency_us": self.latency_us,
            "ref_expert_bytes": self.ref_expert_bytes,
            "charged_bytes": "ref_expert_bytes" if self.ref_expert_bytes is not None else "real",
            "inner": self.inner.describe(),
        }


# --------------------------------------------------------------------------------------------------
# Factory


def make_copy_engine(
    kind: str,
    device: torch.device | str | None = None,
    link: LinkSettings | Mapping[str, Any] | None = None,
) -> CopyEngine:
    """Build the engine named by ``cache.copy`` (``triton``, ``torch`` or ``emulated``).

    ``link`` (``cache.link``) only applies to ``emulated``; it may be a :class:`LinkSettings` or a
    plain mapping of its fields. Settings that cannot work (an unknown engine or link profile, a
    zero bandwidth, Triton without a GPU or its interpreter) raise a ConfigError naming the key.
    """
    from specfit.errors import ConfigError

    try:
        if kind == "torch":
            return TorchCopyEngine(device)
        if kind == "triton":
            return TritonCopyEngine(device)
        if kind == "emulated":
            if link is not None and not isinstance(link, LinkSettings):
                link = LinkSettings.from_mapping(link)
            return EmulatedLinkEngine(TorchCopyEngine(device), link)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from exc
    raise ConfigError(f"unknown copy engine cache.copy={kind!r}; valid values: {', '.join(COPY_KINDS)}")
