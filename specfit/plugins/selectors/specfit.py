"""SpecFit: verify the subtree with the highest predicted throughput, found exactly, and stop
drafting when another level cannot pay (docs/method.md sections 2-3).

After every draft level the exact search (:mod:`specfit.search`) finds the ancestor-closed
subtree S maximising rho(S) = N(S) / T(S) among the nodes EAGLE's reranking keeps (the
``total_tokens`` of highest path probability). The shared machinery (problem, acceptance
estimates, the stop rule) is :class:`specfit.plugins._kit.selection.CostAwareSelector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specfit.interfaces import ConfigError, SearchProblem, solve, solve_surplus
from specfit.plugins._kit.selection import CostAwareSelector, CostAwareSelectorConfig

OBJECTIVES = ("ratio", "rate")


@dataclass
class SpecFitSelectorConfig(CostAwareSelectorConfig):
    name: str = "specfit"
    # ratio: each cycle maximises its own N / T (docs/method.md); rate: it maximises the surplus
    # N - lambda * T at lambda = the decode's recent throughput, which maximises long-run tokens per
    # second (renewal-reward); the first cycle, with no throughput yet, maximises the ratio
    objective: str = "ratio"

    def __post_init__(self) -> None:
        check_objective(self.objective)


def check_objective(objective: str) -> None:
    """``selector.objective`` is one of OBJECTIVES: else one line naming the key."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"selector.objective={objective!r} must be one of {', '.join(OBJECTIVES)}")


class SpecFitSelector(CostAwareSelector):
    name = "specfit"
    Config = SpecFitSelectorConfig

    def __init__(self, *args: Any, objective: str = "ratio", **kwargs: Any) -> None:
        check_objective(objective)
        super().__init__(*args, **kwargs)
        self.objective = objective

    def surplus_rate(self) -> float | None:
        return self.rate_tracker.rate if self.objective == "rate" else None

    def _warm_up(self) -> None:
        super()._warm_up()  # the ratio's kernel (the first cycle, with no rate yet)
        if self.objective == "rate":  # and the surplus kernel every later cycle uses: compiled now too
            from specfit.interfaces import paper_scale_problem

            problem = paper_scale_problem(np.random.default_rng(0), n_nodes=8, layers=2, experts=8, top_k=2)
            solve_surplus(problem, 1.0, np.ones(problem.n_nodes, dtype=bool))

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        rate = self.surplus_rate()
        if rate is not None:
            return solve_surplus(problem, rate, allowed).mask
        return solve(problem, allowed).mask
