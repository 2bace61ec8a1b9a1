"""a_v = P_v: the drafter's own path probability, trusted as it is (the default estimator)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.interfaces import AcceptanceConfig, AcceptanceEstimatorBase, DraftTree


@dataclass
class PathProbAcceptanceConfig(AcceptanceConfig):
    name: str = "path_prob"


class PathProbAcceptance(AcceptanceEstimatorBase):
    """Learns nothing and keeps nothing: the estimate of EAGLE's own reranking."""

    name = "path_prob"
    Config = PathProbAcceptanceConfig

    def estimate(self, tree: DraftTree) -> np.ndarray:
        return tree.path_probs()
