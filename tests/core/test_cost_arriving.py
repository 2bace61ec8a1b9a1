"""The union cost model with experts in flight (issue 14, item 4): an expert arriving by the time
its layer runs is a hit plus its remaining wait, not a miss; without `arriving` nothing changes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from specfit.types.costs import CostConstants
from specfit.types.moe import MoESpec
from specfit.search import evaluate
from specfit.search.bruteforce import brute_force
from specfit.search.exact import greedy, solve
from specfit.search.synthetic import random_small_problem
from specfit.types.tree import DraftTree
from specfit.interfaces import SelectionContext
from specfit.plugins.cost_models.union import UnionCostModel, arrival_waits
from specfit.plugins.selectors.specfit import SpecFitSelector

C = CostConstants(c0=1e-3, c_tok=1e-4, c_miss=5e-3, c_hit=1e-4)
INF = math.inf


def two_children() -> tuple[UnionCostModel, DraftTree, np.ndarray]:
    """Root uses resident expert 0 in both layers; child 0 (q 0.6) needs expert 1, child 1 (q 0.5)
    expert 2, in both layers; neither is resident. Verifying either as misses loses to the root
    alone (rho 1.6 / 11.4 ms and 1.5 / 11.4 ms against 1 / 1.3 ms)."""
    model = UnionCostModel(constants=C)
    model.bind(MoESpec(num_layers=2, num_experts=4, top_k=1, hidden_size=8, intermediate_size=8,
                       dtype=torch.float32, module_names=("a", "b"), decoder_layers=(0, 1)))
    tree = DraftTree(root_token=0)
    tree.add_level([-1, -1], [5, 6], [math.log(0.6), math.log(0.5)])
    tree.root_experts = np.array([[0], [0]], dtype=np.int32)
    tree.experts = np.array([[[1], [1]], [[2], [2]]], dtype=np.int32)
    resident = np.zeros((2, 4), dtype=bool)
    resident[:, 0] = True
    return model, tree, resident


def arriving_for(resident: np.ndarray, **in_flight: float) -> np.ndarray:
    """0 where resident, inf where absent, and the given seconds for experts named e<id>."""
    arriving = np.where(resident, 0.0, INF)
    for name, seconds in in_flight.items():
        arriving[:, int(name[1:])] = seconds
    return arriving


def choose(model: UnionCostModel, tree: DraftTree, resident: np.ndarray, arriving=None) -> list[int]:
    ctx = SelectionContext(resident=resident, draft_seconds=0.0, max_depth=1, max_nodes=8, cost_model=model)
    if arriving is not None:
        ctx.arriving = arriving  # the field the runtime fills (contract H); set as the cycle does
    return SpecFitSelector().select(tree, ctx).nodes


def test_an_arriving_expert_changes_the_chosen_subtree() -> None:
    model, tree, resident = two_children()
    assert choose(model, tree, resident) == []
    # child 1's expert is already on the link and lands before either layer runs: a hit
    assert choose(model, tree, resident, arriving_for(resident, e2=1e-4)) == [1]
    # landing long after its layers run: no better than a miss (the wait is capped at one copy)
    assert choose(model, tree, resident, arriving_for(resident, e2=1.0)) == []
    # nothing in flight: the same problem as without arriving, node for node
    assert choose(model, tree, resident, arriving_for(resident)) == []


def test_remaining_wait_is_charged_on_top_of_a_hit() -> None:
    model, tree, resident = two_children()
    start1 = 0.5 * (C.c0 + C.c_tok)  # layer 1 of 2 runs after half a root-only pass's fixed work
    arriving = arriving_for(resident, e2=start1 + 2e-4)
    problem = model.problem(tree, np.array([0.6, 0.5]), resident, 0.0, arriving=arriving)
    assert problem.resident[:, 2].all() and not problem.resident[:, 1].any()
    assert problem.wait[0, 2] == pytest.approx(start1 + 2e-4)  # layer 0 runs at once
    assert problem.wait[1, 2] == pytest.approx(2e-4)
    _, seconds, _ = evaluate(problem, np.array([False, True]))
    expected = C.c0 + 2 * C.c_tok + 2 * C.c_hit + 2 * C.c_hit + (start1 + 2e-4) + 2e-4
    assert seconds == pytest.approx(expected)
    # capped: in flight never costs more than a miss
    _, wait = arrival_waits(C, resident, arriving_for(resident, e2=10.0))
    assert wait[:, 2] == pytest.approx([C.c_miss - C.c_hit] * 2)


def test_without_arriving_the_problem_is_todays() -> None:
    model, tree, resident = two_children()
    accept = np.array([0.6, 0.5])
    plain = model.problem(tree, accept, resident, 1e-3)
    assert not plain.wait.any()
    same = model.problem(tree, accept, resident, 1e-3, arriving=arriving_for(resident))
    assert np.array_equal(same.resident, plain.resident) and not same.wait.any()
    for mask in ([False, False], [True, False], [True, True]):
        assert evaluate(same, np.array(mask)) == evaluate(plain, np.array(mask))
    # cache-oblivious: every expert a miss, in flight or not
    oblivious = UnionCostModel(constants=C, cache_aware=False)
    oblivious.bind(model.spec)
    p = oblivious.problem(tree, accept, resident, 0.0, arriving=arriving_for(resident, e2=0.0))
    assert not p.resident.any() and not p.wait.any()


def test_bad_arriving_is_refused_naming_it() -> None:
    model, tree, resident = two_children()
    with pytest.raises(ValueError, match="arriving"):
        model.problem(tree, np.zeros(2), resident, 0.0, arriving=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="arriving"):
        model.problem(tree, np.zeros(2), resident, 0.0, arriving=np.full((2, 4), np.nan))


@pytest.mark.parametrize("seed", range(150))
def test_exact_search_with_waits_matches_brute_force(seed: int) -> None:
    """The exact search charges c_hit + wait for an item in flight, as `evaluate` defines it."""
    rng = np.random.default_rng(1000 + seed)
    base = random_small_problem(rng, accept_grid=bool(seed % 3 == 0))
    resident = rng.random(base.resident.shape) < 0.6
    wait = np.where(rng.random(base.resident.shape) < 0.5, rng.random(base.resident.shape), 0.0)
    problem = dataclasses.replace(base, resident=resident,
                                  wait=wait * (base.c_miss - base.c_hit if base.c_miss > base.c_hit else base.c_miss))
    result = solve(problem)
    bf = brute_force(problem)
    n_exp, seconds, rho = evaluate(problem, result.mask)
    assert rho >= bf.best_rho * (1.0 - 1e-9), (rho, bf.best_rho)
    assert result.time_cost == seconds  # the same sum in the same order, to the last bit
    assert result.n_expected == pytest.approx(n_exp, rel=1e-12)
    greedy_mask = greedy(problem)
    assert evaluate(problem, greedy_mask)[2] <= bf.best_rho * (1.0 + 1e-9)


def test_waits_only_count_for_usable_experts() -> None:
    """A wait given for an expert that is not resident is ignored: it is a miss."""
    base = random_small_problem(np.random.default_rng(7), n_nodes=4, layers=2, experts=4, top_k=2)
    resident = np.zeros((2, 4), dtype=bool)
    waited = dataclasses.replace(base, resident=resident, wait=np.ones((2, 4)))
    plain = dataclasses.replace(base, resident=resident)
    assert not waited.wait.any()
    mask = np.ones(base.n_nodes, dtype=bool)
    assert evaluate(waited, mask) == evaluate(plain, mask)


def cycles(stall_share: float | None, rng: np.random.Generator, n: int = 24) -> list:
    """Cycles whose time is c0 + c_tok (n + 1) + c_hit used + (visible copy) + D, exactly, where a
    miss issues 4 ms of transfer of which `stall_share` is visible (None: nothing measured, all
    visible, as before issue 14)."""
    from specfit.types.stats import CycleRecord

    out = []
    for _ in range(n):
        verified, misses, hits = int(rng.integers(0, 8)), int(rng.integers(1, 20)), int(rng.integers(0, 20))
        issued = 4e-3 * misses
        visible = issued if stall_share is None else stall_share * issued
        draft = 1e-3 + 2e-3 * (levels := int(rng.integers(0, 4)))
        total = C.c0 + C.c_tok * (verified + 1) + C.c_hit * (hits + misses) + visible + draft
        record = CycleRecord(drafted=verified, levels=levels, verified=verified, accepted=0, committed=1,
                             draft_seconds=draft, select_seconds=0.0, verify_seconds=total - draft,
                             h2d_seconds=issued, total_seconds=total, misses=misses, hits=hits, union=[])
        record.h2d_stall_seconds = 0.0 if stall_share is None else visible  # measured by the pipelined runtime
        out.append(record)
    return out


def test_calibration_fits_the_overlap_it_observes() -> None:
    from specfit.types.costs import fit_constants

    records = cycles(0.25, np.random.default_rng(3))
    pipelined = fit_constants(records, overlap=True)
    assert pipelined.c_hit == pytest.approx(C.c_hit, rel=1e-6)
    assert pipelined.c0 == pytest.approx(C.c0, rel=1e-6)
    assert pipelined.c_miss - pipelined.c_hit == pytest.approx(1e-3, rel=1e-6)  # a quarter of 4 ms visible
    # the same cycles read as before issue 14: every issued second counted as waited
    plain = fit_constants(records)
    assert plain.c_miss - plain.c_hit == pytest.approx(4e-3, rel=1e-6)
    # without prefetch every copy is waited on: the stall is the copy time, and both readings agree
    sync = cycles(None, np.random.default_rng(4))
    for r in sync:
        r.h2d_stall_seconds = r.h2d_seconds
    assert fit_constants(sync, overlap=True).c_miss == pytest.approx(fit_constants(sync).c_miss, rel=1e-9)
    assert fit_constants(sync).c_miss - C.c_hit == pytest.approx(4e-3, rel=1e-6)


def test_without_prefetch_a_measured_wait_keeps_hidden_copies_out_of_the_compute_fit() -> None:
    """Pipelined rounds hide a quarter of each cycle's copies without any prefetch. Where the host
    measured the waits (stall_measured: an emulated link) the compute constants come out exact and
    c_copy stays the copies' own time; read as before, hidden copies passed for faster compute."""
    from specfit.types.costs import fit_constants
    from specfit.types.stats import waited_copy_seconds

    records = cycles(0.75, np.random.default_rng(5))  # the pass waited 3/4 of its copies
    for r in records:
        r.stall_measured = True
    fitted = fit_constants(records)
    assert (fitted.c0, fitted.c_tok, fitted.c_hit) == (pytest.approx(C.c0, rel=1e-6), pytest.approx(C.c_tok, rel=1e-6),
                                                       pytest.approx(C.c_hit, rel=1e-6))
    assert fitted.c_miss - fitted.c_hit == pytest.approx(4e-3, rel=1e-6)  # the copies' own time
    assert waited_copy_seconds(records[0]) == records[0].h2d_stall_seconds
    for r in records:
        r.stall_measured = False
    biased = fit_constants(records)  # hidden copy time taken for compute time saved
    assert biased.c0 + biased.c_tok + biased.c_hit * 10 < C.c0 + C.c_tok + C.c_hit * 10


def test_records_say_their_copies_overlapped_and_the_online_refit_and_sink_read_the_stall() -> None:
    """A cycle of a pipelined engine (prefetch over the emulated link) is marked copies_overlap, so the
    online refit fits the visible stall as the calibration does, and the live sink's per-layer compute
    subtracts the stall, not the link time the prefetches issued; other engines' cycles are not."""
    from conftest import tiny_model

    from specfit import Engine
    from specfit.types.costs import fit_constants
    from specfit.types.stats import visible_copy_seconds
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher
    from specfit.plugins.selectors.none import NoDraftSelector

    records = cycles(0.25, np.random.default_rng(3))
    for r in records:
        r.copies_overlap = True
    assert fit_constants(records).c_miss - fit_constants(records).c_hit == pytest.approx(1e-3, rel=1e-6)
    assert visible_copy_seconds(records[0]) == records[0].h2d_stall_seconds < records[0].h2d_seconds

    def engine(copy: str, prefetch: bool) -> Engine:
        return Engine(tiny_model(), cache=LRUCache(capacity=3), selector=NoDraftSelector(), copy=copy, device="cpu",
                      prefetcher=LookaheadPrefetcher() if prefetch else None)

    pipelined = engine("emulated", True)
    out = pipelined.generate([5, 17, 99, 3], max_new_tokens=6)
    assert out.cycles and all(c.copies_overlap for c in out.cycles)
    # the stall is what the passes waited, recorded apart from the link time of every copy issued
    # (prefetches included); comparing the two sums is left to benchmarks: on a loaded host a
    # wall-clock wait overshoots its deadline by milliseconds
    assert pipelined.runtime.stats.prefetch_issued > 0
    sink, seen = pipelined.prefetch_sink, []
    sink.observe = lambda verify, copies, tokens: seen.append(copies)  # noqa: ARG005
    out = pipelined.generate([5, 17, 99, 3], max_new_tokens=6)
    assert seen == pytest.approx([c.h2d_stall_seconds for c in out.cycles])
    for copy, prefetch in (("emulated", False), ("torch", True)):
        runs = engine(copy, prefetch).generate([5, 17, 99, 3], max_new_tokens=4).cycles
        assert not any(c.copies_overlap for c in runs)
        assert all(c.stall_measured == (copy == "emulated") for c in runs)  # the emulated link's waits are the host's


def test_a_pipelined_calibration_reports_its_overlap_and_names_the_prefetcher() -> None:
    """Lookahead prefetch over the emulated link: calibration fits the stall (pipelined), reports the
    hidden share of the link time, and stores under a fingerprint naming the prefetcher; without a
    prefetcher the fingerprint is today's (no prefetch key)."""
    from conftest import tiny_model

    from specfit import Engine
    from specfit.calibrate.run import run_calibration
    from specfit.calibrate.fingerprint import setup_fingerprint
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher
    from specfit.plugins.selectors.none import NoDraftSelector

    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), selector=NoDraftSelector(), copy="emulated",
                    prefetcher=LookaheadPrefetcher(), device="cpu")
    assert engine.copies_overlap and setup_fingerprint(engine)["prefetch"] == "lookahead"
    prompts = [[5, 17, 99, 3], [42, 8, 120, 77], [9, 10, 11, 12]]
    constants, report = run_calibration(engine, prompts, max_new_tokens=6)
    # hidden share of the link time: at most all of it (below 0 only when a loaded host oversleeps)
    assert math.isfinite(report["copy_overlap"]) and report["copy_overlap"] <= 1.0
    assert all(math.isfinite(v) and v >= 0 for v in (constants.c0, constants.c_tok, constants.c_hit, constants.c_miss))
    plain = Engine(tiny_model(), cache=LRUCache(capacity=3), selector=NoDraftSelector(), copy="emulated", device="cpu")
    assert not plain.copies_overlap and "prefetch" not in setup_fingerprint(plain)
