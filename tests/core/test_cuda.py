"""The GPU path: pinned host store, copy stream, Triton zero-copy kernel, the ordering of asynchronous
copies by CUDA events (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model

from specfit import Engine
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("copy", ["torch", "triton"])
def test_greedy_on_cuda_matches_hf_generate_on_cuda(arch, cache, copy):
    reference_model = tiny_model(arch).to("cuda")
    with torch.no_grad():
        ref = reference_model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                       do_sample=False)[0, len(PROMPT):].tolist()
    engine = Engine(tiny_model(arch), cache=CACHES[cache](), copy=copy, device="cuda")
    # pinned for the copies; cache=full copies once at build, from an unpinned store it then drops
    assert engine.runtime.store.pinned == (cache != "full")
    assert engine.runtime.slots[0].is_cuda
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == ref


@pytest.mark.parametrize("copy", ["torch", "triton"])
def test_tree_verification_on_cuda(copy):
    from drafters import ScriptedDrafter

    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    with torch.no_grad():
        ref = tiny_model().to("cuda").generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=24,
                                                min_new_tokens=24, do_sample=False)[0].tolist()
    for drafter in (ScriptedDrafter(ref, vocab=256, branching=3, depth=3), Eagle3Drafter(top_k=3, depth=3, total_tokens=8)):
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), copy=copy, drafter=drafter, device="cuda")
        assert engine.generate(PROMPT, max_new_tokens=24).token_ids == ref[len(PROMPT):]


# ------------------------------------------------------------------------------------ asynchronous copies


def _pinned(rows: int, p: int) -> torch.Tensor:
    return torch.randn(rows, p).pin_memory()


def _engines():
    from specfit.offload.copy.torch import TorchCopyEngine
    from specfit.offload.copy.triton import TritonCopyEngine

    return [TorchCopyEngine("cuda", timing="none"), TorchCopyEngine("cuda"), TritonCopyEngine("cuda", timing="none")]


@pytest.mark.parametrize("index", range(3))
def test_compute_after_wait_reads_the_landed_copy(index):
    """issue returns a ticket with the copy stream's event; after wait() the compute stream is ordered
    after it, with no host synchronisation needed for the data to be right."""
    engine = _engines()[index]
    store, slots = _pinned(16, 1 << 20), torch.zeros(4, 1 << 20, device="cuda")
    ticket = engine.issue(store, torch.tensor([3, 9]), slots, torch.tensor([1, 2]))
    assert ticket.event is not None and ticket.experts == 2
    blocked = ticket.wait()
    assert blocked >= 0.0 and (blocked == 0.0 or engine.timing != "none")
    total = slots[1:3].sum()  # enqueued on the compute stream after the wait
    assert torch.allclose(total.cpu(), store[[3, 9]].sum(), rtol=1e-4)


@pytest.mark.parametrize("index", range(3))
def test_copies_into_one_slot_land_in_issue_order(index):
    engine = _engines()[index]
    store, slots = _pinned(8, 1 << 18), torch.zeros(2, 1 << 18, device="cuda")
    first = engine.issue(store, torch.tensor([1]), slots, torch.tensor([0]))
    second = engine.issue(store, torch.tensor([5]), slots, torch.tensor([0]))
    second.wait()
    first.wait()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(slots[0].cpu(), store[5])


@pytest.mark.parametrize("index", range(3))
def test_a_copy_never_overwrites_a_slot_queued_compute_still_reads(index):
    """The copy stream waits for the compute stream queued before the issue: a slow kernel that reads
    slot 0 sees its old value even though the copy into slot 0 is issued right after it."""
    engine = _engines()[index]
    store = _pinned(4, 1 << 16)
    slots = torch.full((2, 1 << 16), 7.0, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy (~tens of ms)
    seen = slots[0].clone()
    ticket = engine.issue(store, torch.tensor([2]), slots, torch.tensor([0]))
    ticket.wait()
    after = slots[0].clone()
    torch.cuda.synchronize()
    assert (seen == 7.0).all()
    assert torch.equal(after.cpu(), store[2])


def test_runtime_waits_per_slot_with_random_prefetches_on_cuda():
    import random

    with torch.no_grad():
        ref = tiny_model().to("cuda").generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=16,
                                                min_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    for copy in ("torch", "triton"):
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), copy=copy, device="cuda")
        runtime, rng = engine.runtime, random.Random(0)

        def listener(layer, hidden, runtime=runtime, rng=rng):
            runtime.prefetch((layer + 1) % runtime.spec.num_layers, rng.sample(range(runtime.spec.num_experts), 3))

        runtime.add_layer_listener(listener)
        out = engine.generate(PROMPT, max_new_tokens=16)
        assert out.token_ids == ref
        assert runtime.stats.prefetch_issued > 0


@pytest.mark.parametrize("timing", ["wall", "events"])
def test_a_ticket_waited_late_is_charged_its_copy_time_not_the_time_since_its_issue(timing):
    """A prefetch waited for a pass later is charged the copy's own time on the copy stream: the wall
    time since its issue held everything that ran meanwhile (a first H200 run summed 9.2 s of
    "copies" over a 51 ms prefill). A synchronous copy keeps its wall time under timing="wall"."""
    import time

    from specfit.offload.copy.torch import TorchCopyEngine

    engine = TorchCopyEngine("cuda", timing=timing)
    store, slots = _pinned(4, 1 << 20), torch.zeros(4, 1 << 20, device="cuda")  # 16 MB: well under 10 ms
    ticket = engine.issue(store, torch.arange(4), slots, torch.arange(4))
    time.sleep(0.1)
    ticket.wait()
    assert 0.0 < ticket.seconds < 0.05
    record = engine.copy(store, torch.arange(4), slots, torch.arange(4))
    assert 0.0 < record.seconds < 0.05 and record.experts == 4


def test_the_torch_engine_lands_each_expert_on_its_own_event():
    """A batch of per-expert copies records an event after each: a layer waits for its own experts,
    not for the rest of a prefetch it may not use (as on the emulated link); a waited row is right
    and charged its own copy's time. The Triton engine's one launch has one event for the batch."""
    from specfit.offload.copy.torch import TorchCopyEngine
    from specfit.offload.copy.triton import TritonCopyEngine

    store, slots = _pinned(8, 1 << 20), torch.zeros(4, 1 << 20, device="cuda")
    ticket = TorchCopyEngine("cuda").issue(store, torch.tensor([6, 2, 5]), slots, torch.tensor([0, 3, 1]))
    rows = [ticket.row(i) for i in range(3)]
    assert len({id(r.event) for r in rows} | {id(ticket.event)}) == 4 and rows[2].event is not ticket.event
    assert all(r.experts == 1 for r in rows)
    rows[1].wait()
    assert torch.equal(slots[3].cpu(), store[2]) and 0.0 < rows[1].seconds < 0.05
    with pytest.raises(IndexError):
        ticket.row(3)
    batch = TritonCopyEngine("cuda").issue(store, torch.tensor([1, 4]), slots, torch.tensor([2, 0]))
    assert batch.row(1) is batch
    torch.cuda.synchronize()
