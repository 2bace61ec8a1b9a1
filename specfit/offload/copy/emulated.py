"""The emulated link (``cache.copy=emulated``): a real engine moves the data, a modelled FIFO link
charges each transfer the time a reference deployment's link would take (see
:mod:`specfit.types.link_profiles`), so CPU runs pay realistic H2D time and say so."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specfit.offload.copy.base import CopyEngine, CopyRecord, CopyTicket
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.types.link_profiles import LinkSettings


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
