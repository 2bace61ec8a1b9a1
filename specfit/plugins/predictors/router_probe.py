"""Predict a node's experts with the target's own routers applied to its token's embedding
(see :mod:`specfit.plugins._kit.router_probe`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


from specfit.plugins._kit.router_probe import RouterProbe
from specfit.interfaces import DraftTree, ExpertPredictorBase, PredictorConfig


@dataclass
class RouterProbePredictorConfig(PredictorConfig):
    name: str = "router_probe"


class RouterProbePredictor(ExpertPredictorBase):
    name = "router_probe"
    Config = RouterProbePredictorConfig

    def bind(self, target: Any) -> None:
        spec = target.runtime.spec
        self.layers, self.k = spec.num_layers, spec.top_k
        self.probe = RouterProbe(target.model, spec)

    def predict(self, tree: DraftTree, nodes: Sequence[int]) -> None:
        rows = tree.expert_rows(self.layers, self.k)
        if tree.root_experts is None:
            tree.root_experts = self.probe.experts([tree.root_token])[0]
        for v, experts in zip(nodes, self.probe.experts([tree.tokens[v] for v in nodes])):
            rows[v] = experts
