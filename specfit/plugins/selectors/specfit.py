"""SpecFit: verify the subtree with the highest predicted throughput, found exactly, and stop
drafting when another level cannot pay (method.md sections 2-3).

After every draft level the exact search (:mod:`specfit.core.search`) finds the ancestor-closed
subtree S maximising rho(S) = N(S) / T(S) among the nodes EAGLE's reranking keeps (the
``total_tokens`` of highest path probability). The shared machinery (problem, acceptance
estimates, the stop rule) is :class:`specfit.core.selection.CostAwareSelector`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.config import SelectorConfig
from specfit.core.search import SearchProblem, solve
from specfit.core.selection import CostAwareSelector


@dataclass
class SpecFitConfig(SelectorConfig):
    name: str = "specfit"
    acceptance: str = "path_prob"  # path_prob (a_v = P_v) | calibrated (a_v = f(P_v, depth), learned online)
    early_stop: bool = True  # the draft-stop rule; false drafts every level and selects at the end
    # D in T(S): the time the cycle has spent (measured) or the cost model's c_draft0 + c_level * depth
    # (modelled: decisions then depend on no clock, so a replay of a trace reproduces them exactly)
    draft_time: str = "measured"


class SpecFitSelector(CostAwareSelector):
    name = "specfit"
    Config = SpecFitConfig

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        return solve(problem, allowed).mask
