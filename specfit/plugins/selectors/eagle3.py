"""Vanilla EAGLE-3 (registered as ``eagle3``): verify the nodes EAGLE's reranking keeps."""

from __future__ import annotations

from dataclasses import dataclass

from specfit.interfaces import DraftTree, Selection, SelectionContext, SelectorBase, SelectorConfig


@dataclass
class TopByPathProbSelectorConfig(SelectorConfig):
    name: str = "eagle3"


class TopByPathProbSelector(SelectorBase):
    """Ignores cost: verifies the ``total_tokens`` drafted nodes of highest path probability
    (EAGLE's reranking), re-chosen after every level until the drafter reaches its depth."""

    name = "eagle3"
    Config = TopByPathProbSelectorConfig
    chooses_among_likeliest = True

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        return Selection(nodes=tree.top_by_path_prob(ctx.max_nodes))
