"""The most cost-effective prefix of EAGLE's ranking (in the style of EVICT): verify the k nodes of
highest path probability, for the k that maximises predicted throughput.

A prefix of the ranking by path probability is ancestor-closed (path probabilities never rise
with depth); with calibrated acceptance estimates a node brings its missing ancestors along.
This searches k = 0 .. total_tokens instead of all subtrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.interfaces import SearchProblem, evaluate
from specfit.plugins._kit.selection import CostAwareSelector, CostAwareSelectorConfig


@dataclass
class PrefixSelectorConfig(CostAwareSelectorConfig):
    name: str = "prefix"


class PrefixSelector(CostAwareSelector):
    name = "prefix"
    Config = PrefixSelectorConfig

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        candidates = np.flatnonzero(allowed)
        ranking = candidates[np.lexsort((candidates, -problem.accept[candidates]))]
        best, best_rho = np.zeros(problem.n_nodes, dtype=bool), evaluate(problem, np.zeros(problem.n_nodes, bool))[2]
        mask = np.zeros(problem.n_nodes, dtype=bool)
        for v in ranking:
            while v >= 0 and not mask[v]:
                mask[v] = True
                v = problem.parents[v]
            rho = evaluate(problem, mask)[2]
            if rho > best_rho:
                best, best_rho = mask.copy(), rho
        return best
