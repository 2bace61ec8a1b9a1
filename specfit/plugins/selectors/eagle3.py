"""Vanilla EAGLE-3: verify every node the drafter kept after its reranking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specfit.config import SelectorConfig
from specfit.core.tree import DraftTree
from specfit.interfaces import Selection, SelectionContext


@dataclass
class VerifyAllConfig(SelectorConfig):
    name: str = "eagle3"


class VerifyAllSelector:
    """Ignores cost: verifies the ``total_tokens`` drafted nodes of highest path probability
    (EAGLE's reranking) once the drafter has reached its depth."""

    name = "eagle3"
    Config = VerifyAllConfig

    def bind(self, spec: Any) -> None:
        pass

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        return Selection(nodes=tree.top_by_path_prob(ctx.max_nodes))

    def observe(self, tree: DraftTree, verified: Any, accepted: Any) -> None:
        pass
