"""The machinery the real engines share: argument checks, then the engine's enqueue function run on
a dedicated CUDA copy stream (or inline on a CPU), and the CUDA tickets that wait on its events.

Split from the engines themselves so that :mod:`specfit.offload.copy.torch` and
:mod:`specfit.offload.copy.triton` hold only their own data movement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from specfit.offload.copy.base import CopyRecord, CopyTicket, Timing, _check_args, _nbytes, _no_wait


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
