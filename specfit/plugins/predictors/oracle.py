"""The oracle expert predictor: each node's true routing, read from a recorded trace.

For analysis only (precision and recall 1, the upper bound of what a predictor can give a
selector). It binds to a trace replay's target, which exposes the recorded routing of the position
being replayed; a live target has none, so it refuses to bind there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


from specfit.interfaces import ConfigError, DraftTree, ExpertPredictorBase, PredictorConfig


@dataclass
class OraclePredictorConfig(PredictorConfig):
    name: str = "oracle"


class OraclePredictor(ExpertPredictorBase):
    name = "oracle"
    Config = OraclePredictorConfig

    def bind(self, target: Any) -> None:
        self.routing = getattr(target, "trace_routing", None)
        if self.routing is None:
            raise ConfigError("predictor=oracle reads the true routing from a recorded trace: use it with "
                              "`specfit replay trace.path=DIR predictor=oracle`, not in a live run")
        spec = target.runtime.spec
        self.layers, self.k = spec.num_layers, spec.top_k

    def predict(self, tree: DraftTree, nodes: Sequence[int]) -> None:
        rows = tree.expert_rows(self.layers, self.k)
        if tree.root_experts is None:
            tree.root_experts = self.routing.root()
        if len(nodes):
            rows[list(nodes)] = self.routing.nodes(nodes)
