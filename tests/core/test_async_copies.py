"""Asynchronous copies: the emulated link's FIFO timeline against hand-computed schedules, and the
runtime's pending tickets, stall accounting and arrival times (an injected clock: no wall time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

from specfit import Engine
from specfit.offload.copy import emulated as copy_emulated
from specfit.offload.copy.base import CopyTicket
from specfit.offload.copy.emulated import EmulatedLinkEngine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.types.link_profiles import LinkSettings
from specfit.plugins.caches.lru import LRUCache

MS = 1e-3
# 1 ms per expert (1 MB over 1 GB/s) plus 0.5 ms per transfer
LINK = LinkSettings(profile=None, bandwidth_gbps=1.0, latency_us=500.0, ref_expert_bytes=1_000_000)
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


class FakeClock:
    """A clock that moves only when told to, or when the link waits (then it jumps to the deadline)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait_until(self, deadline: float) -> None:
        self.waits.append(deadline - self.now)
        self.now = max(self.now, deadline)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def emulated(clock: FakeClock) -> EmulatedLinkEngine:
    engine = EmulatedLinkEngine(TorchCopyEngine("cpu"), LINK)
    engine.clock, engine.wait_until = clock, clock.wait_until
    return engine


def tensors(rows: int = 8, slots: int = 4, p: int = 16):
    store = torch.arange(rows * p, dtype=torch.float32).view(rows, p)
    return store, torch.zeros(slots, p)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_a_transfer_completes_after_its_charge_and_lands_its_data():
    clock = FakeClock()
    link = emulated(clock)
    store, slots = tensors()
    ticket = link.issue(store, ids(3, 5), slots, ids(0, 2))
    assert isinstance(ticket, CopyTicket)
    assert (ticket.experts, ticket.bytes) == (2, 2 * 16 * 4)
    assert ticket.seconds == pytest.approx(2.5 * MS)
    assert ticket.ready_at == pytest.approx(2.5 * MS)
    assert ticket.remaining() == pytest.approx(2.5 * MS)
    assert clock.now == 0.0  # issue returns at once
    assert torch.equal(slots[0], store[3]) and torch.equal(slots[2], store[5])
    assert ticket.wait() == pytest.approx(2.5 * MS)  # nothing overlapped it: the caller waits it all
    assert clock.now == pytest.approx(2.5 * MS)
    assert ticket.wait() == 0.0 and clock.waits == [pytest.approx(2.5 * MS)]  # waiting twice blocks once


def test_each_expert_of_a_transfer_lands_on_its_own_and_is_waited_for_alone():
    """A batch of three moves its experts in order: expert i lands (i + 1) charges after the launch,
    so waiting for the first does not wait for the rest."""
    clock = FakeClock()
    link = emulated(clock)
    store, slots = tensors()
    whole = link.issue(store, ids(1, 2, 3), slots, ids(0, 1, 2))  # launch 0.5 ms, then 1 ms per expert
    rows = [whole.row(i) for i in range(3)]
    assert [r.ready_at for r in rows] == pytest.approx([1.5 * MS, 2.5 * MS, 3.5 * MS])
    assert whole.ready_at == pytest.approx(3.5 * MS) and rows[2].ready_at == whole.ready_at
    assert [(r.experts, r.seconds) for r in rows] == [(1, pytest.approx(1.0 * MS))] * 3
    assert all(r.in_flight() for r in rows)
    clock.advance(1.0 * MS)
    assert rows[0].wait() == pytest.approx(0.5 * MS)  # its own rest, not the batch's 2.5 ms
    assert not rows[0].in_flight() and rows[1].in_flight()
    clock.advance(5.0 * MS)
    assert not rows[2].in_flight()  # landed, never waited: a prefetch's wrong pick may be evicted
    assert rows[2].wait() == 0.0
    with pytest.raises(IndexError):
        whole.row(3)
    cpu = TorchCopyEngine("cpu").issue(store, ids(4), slots, ids(3))
    assert cpu.row(0) is cpu and not cpu.in_flight()  # a CPU copy has landed when issue returns
    cpu.wait()
    assert not cpu.in_flight()


def test_compute_overlapping_a_transfer_hides_it():
    clock = FakeClock()
    link = emulated(clock)
    store, slots = tensors()
    ticket = link.issue(store, ids(1), slots, ids(0))  # [0, 1.5 ms]
    clock.advance(1.0 * MS)  # compute meanwhile
    assert ticket.remaining() == pytest.approx(0.5 * MS)
    assert ticket.wait() == pytest.approx(0.5 * MS)  # only the rest is a stall
    late = link.issue(store, ids(2), slots, ids(1))  # [1.5, 3.0 ms]
    clock.advance(4.0 * MS)
    assert late.remaining() == 0.0
    assert late.wait() == 0.0  # fully hidden
    assert clock.waits == [pytest.approx(0.5 * MS)]


def test_transfers_queue_first_in_first_out_on_one_link():
    clock = FakeClock()
    link = emulated(clock)
    store, slots = tensors()
    a = link.issue(store, ids(0, 1), slots, ids(0, 1))  # [0, 2.5]
    clock.advance(0.5 * MS)
    b = link.issue(store, ids(2), slots, ids(2))  # issued at 0.5, starts when a is done: [2.5, 4.0]
    assert b.ready_at == pytest.approx(4.0 * MS)
    clock.advance(0.5 * MS)  # t = 1.0
    assert b.wait() == pytest.approx(3.0 * MS)  # waits behind a
    assert a.wait() == 0.0  # a landed before b
    clock.advance(6.0 * MS)  # t = 10: the link has been idle since 4.0
    c = link.issue(store, ids(3), slots, ids(3))
    assert c.ready_at == pytest.approx(11.5 * MS)  # starts at once, not when the link last freed
    assert link.link_busy_seconds == pytest.approx((2.5 + 1.5 + 1.5) * MS)


def test_copy_is_issue_then_wait_and_charges_as_before():
    clock = FakeClock()
    link = emulated(clock)
    store, slots = tensors()
    record = link.copy(store, ids(4, 6, 7), slots, ids(3, 0, 1))
    assert record.experts == 3 and record.seconds == pytest.approx(3.5 * MS)
    assert clock.now == pytest.approx(3.5 * MS)
    assert torch.equal(slots[3], store[4]) and torch.equal(slots[1], store[7])
    empty = link.issue(store, ids(), slots, ids())
    assert (empty.experts, empty.seconds, empty.wait()) == (0, 0.0, 0.0)


def test_a_short_wait_spins_and_a_long_one_sleeps_only_beyond_the_spin(monkeypatch):
    """The link's real wait: a host waiting on a device copy spins; only what lies beyond spin_s sleeps."""
    now, slept = [0.0], []

    def clock() -> float:  # each read is one turn of the spin loop
        now[0] += 1e-5
        return now[0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(copy_emulated.time, "perf_counter", clock)
    monkeypatch.setattr(copy_emulated.time, "sleep", sleep)
    copy_emulated._wait_until(1e-3)  # a per-layer wait on the demo: spun whole
    assert now[0] >= 1e-3 and slept == []
    copy_emulated._wait_until(now[0] + 5e-3)
    assert slept == [pytest.approx(3e-3, abs=1e-4)]


def test_the_real_engines_issue_too():
    store, slots = tensors()
    for engine in (TorchCopyEngine("cpu"), EmulatedLinkEngine(TorchCopyEngine("cpu"), LinkSettings(latency_us=1.0))):
        ticket = engine.issue(store, ids(7, 2), slots, ids(1, 3))
        ticket.wait()
        assert torch.equal(slots[1], store[7]) and torch.equal(slots[3], store[2])
        assert ticket.remaining() == 0.0


# ------------------------------------------------------------------------------------ the runtime


def build(clock: FakeClock, capacity: int = 3) -> Engine:
    return Engine(tiny_model(), cache=LRUCache(capacity=capacity), copy=emulated(clock), device="cpu")


def test_without_prefetch_every_copy_is_a_stall():
    clock = FakeClock()
    engine = build(clock)
    stats = engine.generate(PROMPT, max_new_tokens=4).stats
    assert stats["expert_cache_misses"] > 0
    # compute takes no time on this clock, so each layer waits its whole transfer
    assert stats["h2d_stall_seconds"] == pytest.approx(stats["h2d_seconds"])
    assert stats["link_busy_seconds"] == pytest.approx(stats["h2d_seconds"])
    assert stats["prefetch_issued"] == stats["prefetch_used"] == stats["prefetch_wasted"] == 0


def test_the_prefills_copies_and_stall_are_reported_apart_from_the_decodes():
    clock = FakeClock()
    engine = build(clock)
    before = engine.runtime.stats.copy()
    stats = engine.generate(PROMPT, max_new_tokens=4).stats
    whole = engine.runtime.stats.since(before)
    assert stats["prefill_h2d_seconds"] > 0  # the prompt's routing needs experts beyond 3 slots
    assert stats["prefill_h2d_seconds"] + stats["h2d_seconds"] == pytest.approx(whole.h2d_seconds)
    assert stats["prefill_h2d_stall_seconds"] + stats["h2d_stall_seconds"] == pytest.approx(whole.h2d_stall_seconds)


def test_a_prefetch_arrives_and_is_used_by_the_next_pass():
    clock = FakeClock()
    engine = build(clock, capacity=4)
    engine.generate(PROMPT, max_new_tokens=2)
    runtime = engine.runtime
    arriving = runtime.arriving()
    resident = runtime.resident()
    assert arriving.shape == resident.shape
    assert (arriving[resident] == 0.0).all() and np.isinf(arriving[~resident]).all()

    absent = [int(e) for e in np.flatnonzero(~resident[0])[:2]]
    before = runtime.stats.copy()
    assert runtime.prefetch(0, absent + absent[:1]) == 2  # duplicates and resident experts are not candidates
    arriving = runtime.arriving()
    # one transfer of two experts (0.5 ms launch, 1 ms each): the first lands after 1.5 ms, the second 2.5
    assert arriving[0, absent] == pytest.approx([1.5 * MS, 2.5 * MS])
    assert runtime.prefetch(0, absent) == 0  # already in a slot
    clock.advance(1.0 * MS)
    assert runtime.arriving()[0, absent] == pytest.approx([0.5 * MS, 1.5 * MS])
    # the next pass's layer 0 routes to the experts it routes to; make sure it needs the prefetched ones
    runtime._wait_for(0, {absent[0]: int(np.flatnonzero(runtime.slot_expert[0] == absent[0])[0])})
    during = runtime.stats.since(before)
    assert during.prefetch_issued == 2 and during.prefetch_used == 1
    assert during.h2d_stall_seconds == pytest.approx(0.5 * MS)  # the rest of its own row, not the batch's
    assert runtime.arriving()[0, absent] == pytest.approx([0.0, 1.0 * MS])


def test_layer_listeners_see_each_moe_layer_once_per_pass():
    clock = FakeClock()
    engine = build(clock)
    seen: list[tuple[int, tuple[int, ...]]] = []
    engine.runtime.add_layer_listener(lambda layer, hidden: seen.append((layer, tuple(hidden.shape))))
    engine.generate(PROMPT, max_new_tokens=2)
    layers = engine.runtime.spec.num_layers
    assert [layer for layer, _ in seen] == list(range(layers)) * 2  # prefill, then one decode pass
    assert seen[0][1][0] == len(PROMPT) and seen[-1][1][0] == 1


def recorded_routing(engine: Engine, prompt: list[int], n: int) -> list[np.ndarray]:
    """Each pass's routing, int [tokens, layers, top_k], of a greedy run."""
    runtime, passes = engine.runtime, []
    begin = runtime.begin_pass

    def record_then_begin() -> None:
        if all(r is not None for r in runtime._routing):
            passes.append(runtime.routing())
        begin()

    runtime.begin_pass = record_then_begin
    engine.generate(prompt, max_new_tokens=n)
    passes.append(runtime.routing())
    return passes


def computing(engine: Engine, clock: FakeClock, seconds: float) -> None:
    """Make each round of expert compute take ``seconds`` on the fake clock."""
    run = engine.runtime.compute.run

    def timed_run(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        clock.advance(seconds)
        run(*args, **kwargs)

    engine.runtime.compute.run = timed_run


def test_overlap_with_compute_is_measured_not_assumed():
    """Each layer 'computes' 5 ms; a listener (called once the layer's own copies are issued, before it
    computes) prefetches exactly the next layer's experts (known from a first run): their copies run
    during that compute, so the stall drops; the output does not."""
    clock = FakeClock()
    reference = build(clock, capacity=8)
    routing = recorded_routing(reference, PROMPT, 3)
    ref_stats = reference.generate(PROMPT, max_new_tokens=3)

    clock = FakeClock()
    baseline = build(clock, capacity=8)
    computing(baseline, clock, 5 * MS)
    base = baseline.generate(PROMPT, max_new_tokens=3)

    clock = FakeClock()
    engine = build(clock, capacity=8)
    computing(engine, clock, 5 * MS)
    runtime = engine.runtime

    def prefetch_next(layer: int, hidden: torch.Tensor) -> None:
        """The next layer's experts (the next pass's first layer after the last): transfers of at most
        2.5 ms, one per 5 ms of compute, so none waits behind another."""
        this_pass = runtime.stats.passes - 1
        if layer + 1 < runtime.spec.num_layers:
            runtime.prefetch(layer + 1, np.unique(routing[this_pass][:, layer + 1]).tolist())
        elif this_pass + 1 < len(routing):
            runtime.prefetch(0, np.unique(routing[this_pass + 1][:, 0]).tolist())

    runtime.add_layer_listener(prefetch_next)
    out = engine.generate(PROMPT, max_new_tokens=3)
    assert out.token_ids == base.token_ids == ref_stats.token_ids
    stats = out.stats  # decode passes only
    assert base.stats["h2d_stall_seconds"] > 0
    assert stats["expert_cache_misses"] == 0  # every decode copy was a prefetch ...
    assert stats["h2d_stall_seconds"] == pytest.approx(0.0)  # ... that landed during the previous layer
    whole = runtime.stats
    assert whole.prefetch_issued > 0 and whole.prefetch_used == whole.prefetch_issued
    assert whole.prefetch_wasted == 0


@pytest.mark.parametrize("right", [True, False])
def test_a_prefetch_is_used_or_wasted(right):
    """Two slots per layer (top-2): prefetching the decode pass's layer-0 experts during prefill's last
    layer makes both hits (used); prefetching two others makes both evicted unused (wasted)."""
    clock = FakeClock()
    routing = recorded_routing(build(clock, capacity=2), PROMPT, 2)
    needed = sorted(set(routing[1][0, 0].tolist()))
    others = [e for e in range(16) if e not in needed and e not in routing[0][:, 0]][:2]
    clock = FakeClock()
    engine = build(clock, capacity=2)
    runtime = engine.runtime

    def at_last_layer(layer: int, hidden: torch.Tensor) -> None:
        if runtime.stats.passes == 1 and layer == runtime.spec.num_layers - 1:
            assert runtime.prefetch(0, needed if right else others) == 2

    runtime.add_layer_listener(at_last_layer)
    engine.generate(PROMPT, max_new_tokens=2)
    stats = runtime.stats
    assert stats.prefetch_issued == 2
    assert (stats.prefetch_used, stats.prefetch_wasted) == ((2, 0) if right else (0, 2))



@pytest.mark.parametrize("device_ms, stall_ms", [(3.0, 3.0), (1.0, 1.5)])
def test_a_real_copy_the_host_blocks_on_under_the_emulated_link_counts_as_stall(device_ms, stall_ms):
    """The emulated link over a device engine: the host's block on a real copy still in flight is
    stall too; the wait then ends at the later of the real landing and the modelled one (1.5 ms)."""
    clock = FakeClock()

    class SlowDevice(TorchCopyEngine):
        def issue(self, *args, **kwargs):  # noqa: ANN002, ANN003
            real = super().issue(*args, **kwargs)
            landed = [False]

            def block() -> float:
                clock.advance(device_ms * MS)
                landed[0] = True
                return device_ms * MS

            return CopyTicket(real.experts, real.bytes, real.seconds, real.ready_at, block,
                              lambda: 0.0 if landed[0] else 1.0)

    link = EmulatedLinkEngine(SlowDevice("cpu"), LINK)
    link.clock, link.wait_until = clock, clock.wait_until
    store, slots = tensors()
    ticket = link.issue(store, ids(1), slots, ids(0))
    assert ticket.wait() == pytest.approx(stall_ms * MS)
    assert clock.now == pytest.approx(max(device_ms, 1.5) * MS)
