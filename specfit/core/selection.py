"""What cost-aware selectors share: the selection problem of a tree, acceptance estimates, and the
draft-stop rule. Each selector only decides how to pick a subtree from the problem.

Subclasses implement ``choose(problem, allowed) -> mask``; the exact search (``specfit``), a
marginal-ratio greedy (EcoSpec-style) and a best prefix by path probability (EVICT-style) differ
only there, so they are compared on equal terms.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specfit.core.search import SearchProblem, evaluate
from specfit.core.tree import DraftTree
from specfit.errors import ConfigError
from specfit.interfaces import Selection, SelectionContext


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
        d, b = self._bins(tree, nodes)
        return (self.accepted[d, b] + self.prior_weight * tree.path_probs()) / (self.seen[d, b] + self.prior_weight)

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        if not verified:
            return
        nodes = np.asarray(verified)
        d, b = self._bins(tree, nodes)
        np.add.at(self.seen, (d, b), 1.0)
        hit = np.isin(nodes, np.asarray(accepted, dtype=int))
        np.add.at(self.accepted, (d[hit], b[hit]), 1.0)


class CostAwareSelector:
    """Picks the subtree that maximises predicted throughput N/T by ``choose``, after each level."""

    name = "cost_aware"
    requires = ("cost_model", "predictor")  # the engine checks these are configured

    def __init__(self, acceptance: str = "path_prob", early_stop: bool = True, draft_time: str = "measured") -> None:
        if acceptance not in ("path_prob", "calibrated"):
            raise ConfigError(f"selector.acceptance={acceptance!r} must be path_prob or calibrated")
        if draft_time not in ("measured", "modelled"):
            raise ConfigError(f"selector.draft_time={draft_time!r} must be measured or modelled")
        self.acceptance, self.early_stop, self.draft_time = acceptance, early_stop, draft_time
        self.calibrator = CalibratedAcceptance() if acceptance == "calibrated" else None
        self._previous_rho = 0.0

    def bind(self, spec: Any) -> None:
        self.spec = spec

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def accept_estimates(self, tree: DraftTree) -> np.ndarray:
        return self.calibrator.estimate(tree) if self.calibrator is not None else tree.path_probs()

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        cost_model = ctx.cost_model
        if cost_model is None or not hasattr(cost_model, "problem"):
            raise ConfigError(f"selector={self.name} needs a cost model that builds selection problems: set cost_model=union")
        spent = ctx.draft_seconds
        if self.draft_time == "modelled":
            c = cost_model.constants
            spent = c.c_draft0 + c.c_level * tree.depth
        problem = cost_model.problem(tree, self.accept_estimates(tree), ctx.resident, spent)
        allowed = np.zeros(len(tree), dtype=bool)
        allowed[tree.top_by_path_prob(ctx.max_nodes)] = True
        mask = self.choose(problem, allowed)
        n_expected, seconds, rho = evaluate(problem, mask)
        depth = tree.depth
        if depth == 1:
            self._previous_rho = evaluate(problem, np.zeros(len(tree), dtype=bool))[2]
        stop = depth >= ctx.max_depth
        if self.early_stop and not stop:
            uses_newest = bool(mask[list(tree.level(depth))].any())
            loss_of_one_more_level = rho - n_expected / (seconds + cost_model.constants.c_level)
            stop = not uses_newest or (rho - self._previous_rho) <= loss_of_one_more_level
        self._previous_rho = rho
        return Selection(nodes=np.flatnonzero(mask).tolist(), stop=stop,
                         predicted={"rho": rho, "expected_tokens": n_expected, "seconds": seconds})

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        if self.calibrator is not None:
            self.calibrator.observe(tree, verified, accepted)
