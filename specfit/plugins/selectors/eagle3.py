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
    """Ignores cost: the drafter's own depth and total-token limits decide the tree."""

    name = "eagle3"
    Config = VerifyAllConfig

    def bind(self, spec: Any) -> None:
        pass

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        return Selection(nodes=list(range(len(tree))))
