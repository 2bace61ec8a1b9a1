"""The one decode thread and its bounded FIFO queue.

The offloaded engine decodes at batch size 1 (the experts of one sequence's tokens already fill the
cache), so requests are decoded one at a time, in arrival order, by one thread; the asyncio side only
enqueues a :class:`Job` and relays what the thread hands back through the job's asyncio queue
(``loop.call_soon_threadsafe``). A full queue is refused at once (503 with Retry-After).

Each engine event is checked at its cycle boundary: a job its client gave up on (disconnect), one
past its deadline, or the running one when a shutdown's grace is over, is cancelled there by closing
the engine's stream, which leaves the engine ready for the next request. Stop strings are matched on
the streamed text; the text that could be the start of one is held back until it is not.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specfit.decode.sampling import SamplingParams
from specfit.errors import ConfigError
from specfit.serve.metrics import ServerMetrics
from specfit.serve.protocol import APIError, bad, deadline_exceeded, internal, overloaded

log = logging.getLogger("specfit.serve")

WARMUP_PROMPT = [1, 2, 3, 4]  # token ids every vocabulary has
WARMUP_TOKENS = 4
# a finished decode's stats a non-streamed answer carries ("specfit": {...}): what /metrics sums
REPORTED_STATS = ("num_prompt_tokens", "num_output_tokens", "cycles", "num_drafts", "draft_tokens", "accepted_tokens",
                  "verified_nodes", "spec_decode_acceptance_length", "expert_cache_hits", "expert_cache_misses",
                  "h2d_bytes", "h2d_stall_seconds", "ttft_ms", "total_seconds")


@dataclass
class Delta:
    """Text and tokens of one committed cycle (the text held back for stop strings excluded)."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    """The request ended: why, its last text and tokens, and its token counts."""

    finish_reason: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    all_token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] | None = None  # the decode's own numeric stats (None: cut short by a stop string)


@dataclass
class Failed:
    error: APIError


@dataclass
class Job:
    """A checked request in the queue: the decode's arguments, and where its events go."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    timeout: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "abort"

    @property
    def deadline(self) -> float:
        return self.arrival + self.timeout

    def cancel(self, reason: str = "abort") -> None:
        """The client will not read on (gone, or answered already): stop at the next cycle boundary."""
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody to tell
            pass


class Worker:
    """Decodes the queued jobs one at a time on its own thread (see the module docstring)."""

    def __init__(self, engine: Any, metrics: ServerMetrics, max_waiting: int = 64, shutdown_timeout: float = 10.0,
                 warmup: bool = True) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_waiting, self.shutdown_timeout, self.warmup = max_waiting, shutdown_timeout, warmup
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()  # the running job is cancelled (a shutdown's grace is over)
        self._counting = False  # cycles of requests only, not of the warm-up
        self.running: Job | None = None
        self.ready = self.draining = self.stopping = False
        self.failure: str | None = None
        engine.add_listener(self)

    # ------------------------------------------------------------------ the asyncio side

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="specfit-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def state(self) -> str:
        """ok | starting | draining | failed | stopped: /health's answer."""
        if self.failure is not None:
            return "failed"
        if self.draining or self.stopping:
            return "draining"
        if not self.alive:
            return "stopped" if self._thread is not None else "starting"
        return "ok" if self.ready else "starting"

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise the 503 that says why not (full, shutting down, engine failed)."""
        with self._cond:
            if self.draining or self.stopping:
                raise overloaded("the server is shutting down and takes no new requests", retry_after=5)
            if self.failure is not None or not self.alive:
                raise APIError(503, f"the engine is not running ({self.failure or 'stopped'})", type="server_error",
                               code="engine_unavailable")
            if len(self._waiting) >= self.max_waiting:
                raise overloaded(f"the queue is full ({self.max_waiting} requests waiting, server.max_waiting): "
                                 "requests are decoded one at a time; retry later")
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def waiting(self) -> int:
        return len(self._waiting)

    def drain(self) -> None:
        """SIGTERM: no new jobs; the waiting ones get a 503 now, the running one ``shutdown_timeout``
        seconds to finish before it is cancelled."""
        with self._cond:
            if self.draining:
                return
            self.draining = True
            dropped = list(self._waiting)
            self._waiting.clear()
            self.metrics.waiting.set(0)
        for job in dropped:
            job.put(Failed(overloaded("the server is shutting down: this request was not started", retry_after=5)))
            self.metrics.finished("abort")
        timer = threading.Timer(self.shutdown_timeout, self._abort.set)
        timer.daemon = True
        timer.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread: drain, cancel the running job at its next cycle, wait up to ``timeout``."""
        self.drain()
        self._abort.set()
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine listener

    def cycle_ended(self, record: Any) -> None:
        if self._counting:
            self.metrics.cycle(record)

    def decode_ended(self) -> None:
        pass

    # ------------------------------------------------------------------ the engine thread

    def _main(self) -> None:
        try:
            if self.warmup:
                self.engine.generate(WARMUP_PROMPT, max_new_tokens=WARMUP_TOKENS)
        except Exception as exc:  # noqa: BLE001 - said by /health and every request, logged in full
            log.exception("specfit serve: the warm-up decode failed")
            self.failure = f"the warm-up decode failed: {type(exc).__name__}: {exc}"
            return
        self.ready = True
        while True:
            with self._cond:
                while not self._waiting and not self.stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self.metrics.waiting.set(len(self._waiting))
            self._serve(job)

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # answered already (deadline in the queue) or its client left
            self.metrics.finished(job.cancel_reason)
            return
        if time.monotonic() > job.deadline:
            job.put(Failed(deadline_exceeded(job.timeout)))
            self.metrics.finished("deadline")
            return
        self.running = job
        self.metrics.running.set(1)
        try:
            reason = self._decode(job)
        except APIError as exc:
            job.put(Failed(exc))
            reason = "error"
        except Exception as exc:  # noqa: BLE001 - a bug: the client gets one line, the log the traceback
            log.exception("specfit serve: a request failed")
            job.put(Failed(internal(exc)))
            reason = "error"
        finally:
            self.running = None
            self.metrics.running.set(0)
        self.metrics.finished(reason)

    def _decode(self, job: Job) -> str:
        """Decode ``job``, relaying each cycle; returns how it ended (metrics' finished_reason)."""
        engine, metrics = self.engine, self.metrics
        try:
            events = engine.stream(job.ids, max_new_tokens=job.max_tokens, sampling=job.sampling)
        except ConfigError as exc:
            raise bad(str(exc)) from None
        metrics.prompt_tokens.inc(len(job.ids))
        hold = max((len(s) for s in job.stop), default=1) - 1  # characters that may begin a stop string
        text, sent, tokens = "", 0, []
        before = last = None
        self._counting = True
        try:
            for event in events:
                now = time.monotonic()
                if before is None:
                    before = engine.runtime.stats.copy()  # the decode phase starts after the prefill's token
                    metrics.ttft.observe(now - job.arrival)
                    last = now
                elif event.token_ids:  # a cycle's tokens (the closing event adds none)
                    metrics.itl.observe(now - last)
                    last = now
                tokens.extend(event.token_ids)
                metrics.generation_tokens.inc(len(event.token_ids))
                text += event.text or ""
                final, reason = event.finish_reason is not None, event.finish_reason
                cut = _first_stop(text, job.stop, sent)
                if cut is not None:
                    text, final, reason = text[:cut], True, "stop"
                safe = len(text) if final else max(sent, len(text) - hold)
                piece, sent = text[sent:safe], safe
                if final:
                    metrics.e2e.observe(time.monotonic() - job.arrival)
                    stats = None if event.output is None else {
                        k: v for k, v in event.output.stats.items() if k in REPORTED_STATS}
                    job.put(Done(reason, piece, list(event.token_ids), len(job.ids), len(tokens), tokens, stats))
                    return reason
                job.put(Delta(piece, list(event.token_ids)))
                if job.cancelled.is_set():
                    return job.cancel_reason
                if self._abort.is_set():
                    job.put(Failed(overloaded("the server is shutting down: this request was cancelled",
                                              retry_after=5)))
                    return "abort"
                if time.monotonic() > job.deadline:
                    job.put(Failed(deadline_exceeded(job.timeout)))
                    return "deadline"
            raise RuntimeError("the engine's stream ended without its closing event")
        finally:
            events.close()  # cancelled at this cycle boundary where it had not ended: the engine is ready
            self._counting = False
            if before is not None:
                metrics.cache(before, engine.runtime.stats.copy())


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the first stop string in ``text`` begins, searching from ``start`` (None: none)."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
