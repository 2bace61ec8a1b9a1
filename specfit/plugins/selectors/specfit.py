"""SpecFit: verify the subtree with the highest predicted throughput, found exactly, and stop
drafting when another level cannot pay (docs/method.md sections 2-3).

After every draft level the exact search (:mod:`specfit.core.search`) finds the ancestor-closed
subtree S maximising rho(S) = N(S) / T(S) among the nodes EAGLE's reranking keeps (the
``total_tokens`` of highest path probability). The shared machinery (problem, acceptance
estimates, the stop rule) is :class:`specfit.core.selection.CostAwareSelector`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.core.search import SearchProblem, solve
from specfit.core.selection import CostAwareSelector, CostAwareSelectorConfig


@dataclass
class SpecFitSelectorConfig(CostAwareSelectorConfig):
    name: str = "specfit"


class SpecFitSelector(CostAwareSelector):
    name = "specfit"
    Config = SpecFitSelectorConfig

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        return solve(problem, allowed).mask
