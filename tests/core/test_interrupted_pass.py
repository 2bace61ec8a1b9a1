"""An error or Ctrl-C in the middle of a pass must not leave a slot that the runtime (and the
policy) believe holds an expert whose copy was never made: the same engine, used again, would
compute with other weights and say nothing. Also: what a copy that has landed may be."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_pipelined_rounds import PROMPT, Spiteful, hf_greedy

from specfit import Engine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.offload.prefetch import LiveSink
from specfit.plugins.caches.lru import LRUCache


def stale_slots(runtime) -> list[tuple[int, int, int]]:
    """(layer, slot, expert) where the slot map names an expert, no copy into it is pending, and
    the slot does not hold that expert's weights."""
    out = []
    for layer in range(runtime.spec.num_layers):
        for slot, expert in enumerate(runtime.slot_expert[layer].tolist()):
            if expert >= 0 and slot not in runtime._pending[layer] \
                    and not torch.equal(runtime.slots[layer][slot], runtime.store.layers[layer][expert]):
                out.append((layer, slot, expert))
    return out


def test_ctrl_c_inside_a_batch_copy_leaves_no_stale_slot():
    model = tiny_model()
    expected = hf_greedy(model, PROMPT, 6)
    copier = TorchCopyEngine("cpu")
    engine = Engine(model, cache=LRUCache(capacity=4), copy=copier, device="cpu")
    prepare, calls = copier._prepare, []

    def interrupted_prepare(store, src, slots, dst):
        enqueue = prepare(store, src, slots, dst)
        calls.append(src.numel())
        if len(calls) >= 3 and src.numel() > 1 and not getattr(copier, "fired", False):
            copier.fired = True

            def first_expert_then_ctrl_c(mark=None):
                slots[int(dst[0])].copy_(store[int(src[0])])
                raise KeyboardInterrupt  # between two experts' memcpy

            return first_expert_then_ctrl_c
        return enqueue

    copier._prepare = interrupted_prepare
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT, max_new_tokens=6)
    assert copier.fired
    copier._prepare = prepare
    assert stale_slots(engine.runtime) == []
    assert engine.generate(PROMPT, max_new_tokens=6).token_ids == expected


def test_an_error_in_a_round_with_held_back_loads_leaves_no_stale_slot():
    model = tiny_model()
    expected = hf_greedy(model, PROMPT, 6)
    engine = Engine(model, cache=Spiteful(capacity=4), device="cpu")  # holds loads back for the next round
    runtime = engine.runtime
    run, fired = runtime.compute.run, []

    def failing_run(*args, **kwargs):
        recorded_not_copied = np.any(runtime.slot_expert != runtime._issued_expert)
        if not fired and recorded_not_copied:
            fired.append(True)
            raise MemoryError("out of memory in a round's compute")
        return run(*args, **kwargs)

    runtime.compute.run = failing_run
    with pytest.raises(MemoryError):
        engine.generate(PROMPT, max_new_tokens=6)
    assert fired  # the error came while a later round's loads were recorded but not copied
    runtime.compute.run = run
    assert stale_slots(runtime) == []
    assert runtime._computing[0] == -1 and np.all(runtime._slot_of == -1)
    assert engine.generate(PROMPT, max_new_tokens=6).token_ids == expected


def test_a_failed_prefetch_copy_leaves_no_stale_slot():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), device="cpu")
    runtime = engine.runtime
    engine.generate(PROMPT, max_new_tokens=2)
    absent = [int(e) for e in np.flatnonzero(~runtime.resident()[1])][:2]
    issue = runtime.copy_engine.issue

    def broken(*args, **kwargs):
        raise RuntimeError("copy engine failed")

    runtime.copy_engine.issue = broken
    with pytest.raises(RuntimeError, match="copy engine failed"):
        runtime.prefetch(1, absent)
    runtime.copy_engine.issue = issue
    assert stale_slots(runtime) == []


def test_a_landed_cpu_copy_is_not_in_flight_so_a_wrong_prefetch_can_be_replaced():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), device="cpu")  # cache.copy=torch: copies at issue
    runtime = engine.runtime
    engine.generate(PROMPT, max_new_tokens=2)
    absent = [int(e) for e in np.flatnonzero(~runtime.resident()[1])]
    assert runtime.prefetch(1, absent[:4]) == 4
    assert runtime._in_flight(1) == frozenset()
    assert runtime.prefetch(1, absent[4:6]) == 2  # evicts two of the unused picks


def test_expert_seconds_on_a_real_link_is_per_expert_copied():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), device="cpu")
    runtime = engine.runtime
    stats = runtime.stats
    stats.h2d_seconds, stats.h2d_bytes, stats.misses = 0.6, 6 * runtime.spec.expert_bytes, 2  # 4 of 6 prefetched
    sink = LiveSink(object(), runtime)
    assert sink.expert_seconds() == pytest.approx(0.1)
