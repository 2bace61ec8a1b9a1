"""The oracle estimator: a_v = 1 on the path the target accepts, 0 elsewhere (trace replay only).

For analysis, as ``predictor=oracle`` is for experts: with it a cost-aware selector knows exactly
which drafted nodes the target accepts, and still has to choose them, pay for their experts and
decide how deep to draft with its own cost model, predictor and stop rule. So
``specfit replay ... acceptance=oracle`` measures how far from the oracle selector the acceptance
estimates alone keep SpecFit (docs/results.md). It reads the accepted path from the replay's
target, which a live target does not have: it refuses to bind there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specfit.interfaces import AcceptanceConfig, AcceptanceEstimatorBase, ConfigError, DraftTree


@dataclass
class OracleAcceptanceConfig(AcceptanceConfig):
    name: str = "oracle"


class OracleAcceptance(AcceptanceEstimatorBase):
    name = "oracle"
    Config = OracleAcceptanceConfig

    def __init__(self) -> None:
        self.routing: Any = None

    def bind_target(self, target: Any) -> None:
        """Read the recorded outcomes through the replay's target (``trace_routing.position``)."""
        self.routing = getattr(target, "trace_routing", None)
        if self.routing is None:
            raise ConfigError("acceptance=oracle reads what the target accepts from a recorded trace: use it with "
                              "`specfit replay trace.path=DIR acceptance=oracle`, not in a live run")

    def estimate(self, tree: DraftTree) -> np.ndarray:
        if self.routing is None:
            raise ConfigError("acceptance=oracle was not bound to a trace replay's target (bind_target)")
        estimates = np.zeros(len(tree))
        estimates[[v for v in self.routing.position.accepted_path() if v < len(tree)]] = 1.0
        return estimates
