"""A marginal-ratio greedy (in the style of EcoSpec): from the root alone, add the frontier node
with the best expected tokens per marginal second while that raises predicted throughput.

Same cost model, predictors and stop rule as ``specfit``; only the search differs, so comparing
the two measures what exactness buys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.interfaces import SearchProblem, greedy
from specfit.plugins._kit.selection import CostAwareSelector, CostAwareSelectorConfig


@dataclass
class GreedySelectorConfig(CostAwareSelectorConfig):
    name: str = "greedy"


class GreedySelector(CostAwareSelector):
    name = "greedy"
    Config = GreedySelectorConfig

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        return greedy(problem, allowed)
