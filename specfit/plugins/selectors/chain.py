"""A chain: the single most likely path of the draft tree (classic speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass

from specfit.interfaces import ROOT, DraftTree, Selection, SelectionContext, SelectorBase, SelectorConfig


@dataclass
class ChainSelectorConfig(SelectorConfig):
    name: str = "chain"


class ChainSelector(SelectorBase):
    """At each level, the child with the highest draft probability (ties to the earlier node)."""

    name = "chain"
    Config = ChainSelectorConfig

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        path: list[int] = []
        parent = ROOT
        while True:
            kids = [v for v in range(len(tree)) if tree.parents[v] == parent]
            if not kids:
                return Selection(nodes=path)
            parent = max(kids, key=lambda v: (tree.log_probs[v], -v))
            path.append(parent)
