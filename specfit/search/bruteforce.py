"""Brute-force reference: enumerate every ancestor-closed subtree of a small tree.

Slow on purpose and independent of the fast search: it only uses `evaluate`, so the property
tests can check the exact search against the definition itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from specfit.search.problem import SearchProblem, evaluate

__all__ = ["BruteForceResult", "enumerate_subtrees", "brute_force"]

MAX_NODES = 16


@dataclass
class BruteForceResult:
    """best_rho: the maximum; optimal: every mask within `rtol` of it; count: subtrees examined;
    rhos: rho of every enumerated subtree (same order as `masks`)."""

    best_rho: float
    optimal: list[np.ndarray]
    masks: list[np.ndarray]
    rhos: np.ndarray

    @property
    def count(self) -> int:
        return len(self.masks)


def enumerate_subtrees(parents: np.ndarray,
                       allowed: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """Every ancestor-closed node set (as bool masks), the empty set first.

    Decides nodes in index order (parents come first): a node may be taken only if its parent
    is the root or was taken, and it is allowed.
    """
    parents = np.asarray(parents)
    n = len(parents)
    allowed = np.ones(n, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
    mask = np.zeros(n, dtype=bool)

    def rec(v: int) -> Iterator[np.ndarray]:
        if v == n:
            yield mask.copy()
            return
        yield from rec(v + 1)
        p = parents[v]
        if allowed[v] and (p < 0 or mask[p]):
            mask[v] = True
            yield from rec(v + 1)
            mask[v] = False

    yield from rec(0)


def brute_force(problem: SearchProblem, allowed: np.ndarray | None = None,
                rtol: float = 1e-12) -> BruteForceResult:
    """Best rho over all ancestor-closed subtrees (within `allowed`), and all optimal masks."""
    if problem.n_nodes > MAX_NODES:
        raise ValueError(f"brute force is for trees of at most {MAX_NODES} nodes")
    masks = list(enumerate_subtrees(problem.parents, allowed))
    rhos = np.array([evaluate(problem, m)[2] for m in masks])
    best = float(rhos.max())
    optimal = [m for m, r in zip(masks, rhos, strict=True) if r >= best * (1.0 - rtol)]
    return BruteForceResult(best_rho=best, optimal=optimal, masks=masks, rhos=rhos)
