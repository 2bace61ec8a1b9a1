"""SpecFit: verify the subtree with the highest predicted throughput, and stop drafting when
another level cannot pay (method.md sections 2-3).

After every draft level the exact search finds the ancestor-closed subtree S maximising
rho(S) = N(S) / T(S) among the nodes EAGLE's reranking keeps (the ``total_tokens`` of highest
path probability). Drafting stops when that subtree uses no node of the newest level, or when the
newest level raised rho by no more than one more level's drafting time would take away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.config import SelectorConfig
from specfit.core.search import evaluate, solve
from specfit.core.tree import DraftTree
from specfit.errors import ConfigError
from specfit.interfaces import Selection, SelectionContext


@dataclass
class SpecFitConfig(SelectorConfig):
    name: str = "specfit"
    acceptance: str = "path_prob"  # path_prob (a_v = P_v) | calibrated (a_v = f(P_v, depth), learned online)
    early_stop: bool = True  # the draft-stop rule; false drafts every level and selects at the end
    # D in T(S): the time the cycle has spent (measured) or the cost model's c_draft0 + c_level * depth
    # (modelled: decisions then depend on no clock, so a replay of a trace reproduces them exactly)
    draft_time: str = "measured"


class CalibratedAcceptance:
    """a_v = f(P_v, d(v)) from observed acceptances: binned by depth and log path probability,
    shrunk towards P_v while a bin has few observations."""

    def __init__(self, prior_weight: float = 8.0, bins_per_decade: int = 4, max_depth: int = 16) -> None:
        self.prior_weight, self.per_decade = prior_weight, bins_per_decade
        shape = (max_depth + 1, 12 * bins_per_decade + 1)
        self.accepted = np.zeros(shape)
        self.seen = np.zeros(shape)

    def _bins(self, tree: DraftTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        depth = np.minimum(np.asarray(tree.depths)[nodes], self.seen.shape[0] - 1)
        logp = np.asarray(tree.path_log_probs)[nodes] / np.log(10)
        b = np.clip((-logp * self.per_decade).astype(int), 0, self.seen.shape[1] - 1)
        return depth, b

    def estimate(self, tree: DraftTree) -> np.ndarray:
        nodes = np.arange(len(tree))
        p = tree.path_probs()
        d, b = self._bins(tree, nodes)
        return (self.accepted[d, b] + self.prior_weight * p) / (self.seen[d, b] + self.prior_weight)

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        if not verified:
            return
        nodes = np.asarray(verified)
        d, b = self._bins(tree, nodes)
        np.add.at(self.seen, (d, b), 1.0)
        hit = np.isin(nodes, np.asarray(accepted, dtype=int))
        np.add.at(self.accepted, (d[hit], b[hit]), 1.0)


class SpecFitSelector:
    name = "specfit"
    Config = SpecFitConfig

    def __init__(self, acceptance: str = "path_prob", early_stop: bool = True, draft_time: str = "measured") -> None:
        if acceptance not in ("path_prob", "calibrated"):
            raise ConfigError(f"selector.acceptance={acceptance!r} must be path_prob or calibrated")
        if draft_time not in ("measured", "modelled"):
            raise ConfigError(f"selector.draft_time={draft_time!r} must be measured or modelled")
        self.draft_time = draft_time
        self.acceptance = acceptance
        self.early_stop = early_stop
        self.calibrator = CalibratedAcceptance() if acceptance == "calibrated" else None
        self._previous_rho = 0.0

    def bind(self, spec: Any) -> None:
        self.spec = spec

    def accept_estimates(self, tree: DraftTree) -> np.ndarray:
        return self.calibrator.estimate(tree) if self.calibrator is not None else tree.path_probs()

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        cost_model = ctx.cost_model
        if cost_model is None or not hasattr(cost_model, "problem"):
            raise ConfigError("selector=specfit needs a cost model that builds selection problems: set cost_model=union")
        spent = ctx.draft_seconds
        if self.draft_time == "modelled":
            c = cost_model.constants
            spent = c.c_draft0 + c.c_level * tree.depth
        problem = cost_model.problem(tree, self.accept_estimates(tree), ctx.resident, spent)
        allowed = np.zeros(len(tree), dtype=bool)
        allowed[tree.top_by_path_prob(ctx.max_nodes)] = True
        result = solve(problem, allowed)
        depth = tree.depth
        if depth == 1:
            self._previous_rho = evaluate(problem, np.zeros(len(tree), dtype=bool))[2]
        stop = depth >= ctx.max_depth
        if self.early_stop and not stop:
            uses_newest = depth < len(result.depth_counts) and result.depth_counts[depth] > 0
            c_level = cost_model.constants.c_level
            loss_of_one_more_level = result.rho - result.n_expected / (result.time_cost + c_level)
            stop = not uses_newest or (result.rho - self._previous_rho) <= loss_of_one_more_level
        self._previous_rho = result.rho
        return Selection(
            nodes=np.flatnonzero(result.mask).tolist(),
            stop=stop,
            predicted={"rho": result.rho, "expected_tokens": result.n_expected, "seconds": result.time_cost},
        )

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        if self.calibrator is not None:
            self.calibrator.observe(tree, verified, accepted)
