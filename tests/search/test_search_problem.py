"""The reference definitions: evaluate, enumeration, synthetic instances."""

from __future__ import annotations

import numpy as np
import pytest

from specfit.search import SearchProblem, evaluate, is_ancestor_closed, node_depths
from specfit.search.bruteforce import brute_force, enumerate_subtrees
from specfit.search.synthetic import (QWEN3_30B_PCIE4, child_experts, draft_tree,
                                           paper_scale_problem)


def test_evaluate_by_hand() -> None:
    # root uses expert 0 in layer 0 (resident) and expert 1 in layer 1 (not resident)
    p = SearchProblem(parents=[-1, 0], accept=[0.5, 0.25],
                      node_experts=[[[0, 2], [1, -1]], [[3, 2], [0, 0]]],
                      root_experts=[[0, -1], [1, -1]],
                      resident=[[True, False, False, True], [False, False, False, False]],
                      c0=1.0, c_tok=0.1, c_miss=10.0, c_hit=1.0, draft_time=0.5)
    n, t, rho = evaluate(p, [False, False])
    assert (n, t) == (1.0, pytest.approx(1.0 + 0.1 + 1.0 + 10.0 + 0.5))
    # node 0 adds expert 2 in layer 0 (miss); expert 1 in layer 1 is the root's
    n, t, _ = evaluate(p, [True, False])
    assert (n, t) == (1.5, pytest.approx(1.0 + 0.2 + 1.0 + 20.0 + 0.5))
    # node 1 adds expert 3 in layer 0 (hit) and expert 0 in layer 1 once (miss)
    n, t, rho = evaluate(p, [True, True])
    assert (n, t) == (1.75, pytest.approx(1.0 + 0.3 + 2.0 + 30.0 + 0.5))
    assert rho == pytest.approx(1.75 / 33.8)


def test_depths_and_closure() -> None:
    parents = np.array([-1, 0, 0, 1, -1])
    assert node_depths(parents).tolist() == [1, 2, 2, 3, 1]
    assert is_ancestor_closed(parents, [True, True, False, True, False])
    assert not is_ancestor_closed(parents, [False, True, False, False, False])
    assert is_ancestor_closed(parents, np.zeros(5, bool))


def test_enumeration_counts() -> None:
    assert len(list(enumerate_subtrees(np.arange(-1, 5)))) == 7  # a path of 6: 7 prefixes
    assert len(list(enumerate_subtrees(np.full(6, -1)))) == 64  # a star: every subset
    # node 0 with children 1, 2: {} + {0} x (2^2 subsets of the children) = 5
    assert len(list(enumerate_subtrees(np.array([-1, 0, 0])))) == 5
    assert len(list(enumerate_subtrees(np.array([-1, 0, 0]), np.array([True, False, True])))) == 3
    for m in enumerate_subtrees(np.array([-1, 0, 1, 0, -1])):
        assert is_ancestor_closed(np.array([-1, 0, 1, 0, -1]), m)


def test_brute_force_reports_all_optima() -> None:
    p = SearchProblem(parents=[-1, -1], accept=[1.0, 1.0], node_experts=[[[0]], [[1]]],
                      root_experts=[[-1]], resident=[[False, False]], c0=1.0, c_tok=0.0,
                      c_miss=1.0, c_hit=0.0)
    bf = brute_force(p)  # every subset has rho 1
    assert bf.best_rho == pytest.approx(1.0) and len(bf.optimal) == 4 and bf.count == 4


def test_paper_scale_instance_shape() -> None:
    rng = np.random.default_rng(0)
    p = paper_scale_problem(rng)
    assert (p.n_nodes, p.n_layers, p.n_experts) == (64, 48, 128)
    assert p.node_experts.shape == (64, 48, 8) and p.root_experts.shape == (48, 8)
    assert np.all(p.parents < np.arange(64))
    assert np.all(p.resident.sum(axis=1) == round(0.3 * 128))
    # every node's experts are distinct per layer; a_v never rises along a path
    assert all(len(set(row)) == 8 for row in p.node_experts.reshape(-1, 8).tolist())
    has_parent = p.parents >= 0
    assert np.all(p.accept[has_parent] <= p.accept[p.parents[has_parent]])
    assert p.c_miss == pytest.approx(QWEN3_30B_PCIE4["c_miss"]) and 1e-3 <= p.draft_time <= 3e-3
    assert 1 <= node_depths(p.parents).max() <= 7


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_child_overlap(overlap: float) -> None:
    rng = np.random.default_rng(1)
    parent = np.argsort(rng.random((48, 128)), axis=1)[:, :8].astype(np.int32)
    child = child_experts(rng, parent, 128, overlap)
    shared = [len(set(a) & set(b)) for a, b in zip(parent.tolist(), child.tolist(), strict=True)]
    assert min(shared) >= round(overlap * 8)
    assert all(len(set(row)) == 8 for row in child.tolist())


def test_draft_tree_is_topological_and_top_n() -> None:
    rng = np.random.default_rng(2)
    parents, prob = draft_tree(rng, n_nodes=64)
    assert len(parents) == 64 and np.all(parents < np.arange(64))
    assert np.all(np.diff(node_depths(parents)) >= 0)
    assert prob.max() <= 1.0 and prob.min() > 0.0
