"""a_v = f(P_v, d(v)) from observed acceptances: a table binned by depth and log path probability."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.interfaces import AcceptanceConfig, AcceptanceEstimatorBase, DraftTree, integer, number, settled


@dataclass
class CalibratedAcceptanceConfig(AcceptanceConfig):
    name: str = "calibrated"
    prior_weight: float = 8.0  # observations a bin needs before it outweighs P_v
    bins_per_decade: int = 4  # log10 path-probability bins per factor of ten
    max_depth: int = 16  # deeper nodes share the last depth's bins

    def __post_init__(self) -> None:
        number("acceptance.prior_weight", self.prior_weight, minimum=0)
        integer("acceptance.bins_per_decade", self.bins_per_decade, minimum=1)
        integer("acceptance.max_depth", self.max_depth, minimum=1)


class CalibratedAcceptance(AcceptanceEstimatorBase):
    """a_v = f(P_v, d(v)) from observed acceptances: binned by depth and log path probability,
    shrunk towards P_v while a bin has few observations."""

    name = "calibrated"
    Config = CalibratedAcceptanceConfig

    def __init__(self, prior_weight: float = 8.0, bins_per_decade: int = 4, max_depth: int = 16) -> None:
        self.prior_weight, self.per_decade = prior_weight, bins_per_decade
        shape = (max_depth + 1, 12 * bins_per_decade + 1)
        self.accepted = np.zeros(shape)
        self.seen = np.zeros(shape)

    def _bins(self, tree: DraftTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        depth = np.minimum(np.asarray(tree.depths, dtype=np.int64)[nodes], self.seen.shape[0] - 1)  # [] stays int
        logp = np.asarray(tree.path_log_probs)[nodes] / np.log(10)
        b = np.clip((-logp * self.per_decade).astype(int), 0, self.seen.shape[1] - 1)
        return depth, b

    def estimate(self, tree: DraftTree) -> np.ndarray:
        nodes = np.arange(len(tree))
        d, b = self._bins(tree, nodes)
        return (self.accepted[d, b] + self.prior_weight * tree.path_probs()) / (self.seen[d, b] + self.prior_weight)

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """Learn from the verified nodes, or, after a greedy pass (``tree.greedy_next`` set), from
        every drafted node whose outcome the pass settled (:func:`specfit.types.tree.greedy_outcomes`)."""
        nodes, hit = settled(tree, verified, accepted)
        if not len(nodes):
            return
        d, b = self._bins(tree, nodes)
        np.add.at(self.seen, (d, b), 1.0)
        np.add.at(self.accepted, (d[hit], b[hit]), 1.0)

    def state(self) -> dict[str, Any]:
        return {"bins_per_decade": self.per_decade, "accepted": self.accepted.tolist(), "seen": self.seen.tolist()}

    def load_state(self, state: dict[str, Any]) -> None:
        """A table of another shape (other settings) is not this one's: it is ignored."""
        accepted, seen = np.asarray(state.get("accepted", []), float), np.asarray(state.get("seen", []), float)
        if state.get("bins_per_decade") == self.per_decade and accepted.shape == seen.shape == self.seen.shape:
            self.accepted, self.seen = accepted, seen
