"""``auto``: the draft's look-ahead while drafting, hidden-state look-ahead in every pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.interfaces import DraftTree, PrefetcherBase, PrefetcherConfig
from specfit.plugins.prefetchers.draft import DraftPrefetcher, check_draft_settings
from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher, check_lookahead_settings


@dataclass
class AutoPrefetcherConfig(PrefetcherConfig):
    name: str = "auto"
    source: str = "fitted"  # lookahead's: fitted | own | next | both
    per_layer: int | None = None  # lookahead's cap per layer and pass
    picks: int | None = None  # lookahead's experts per token (null: the model's top-k)
    keep: int | None = None  # lookahead's next-ranked experts kept where resident (null: the top-k)
    min_benefit: float = 0.2  # draft's: skip experts used with a lower probability
    max_per_layer: int | None = None  # draft's cap per layer and level
    gate: bool = True  # lookahead's: pause it while the stall it removes does not pay for its host time
    token_table: int = 2  # lookahead's: the first layers that may take their picks from a per-token table

    def __post_init__(self) -> None:
        check_lookahead_settings(self.source, self.per_layer, self.picks, self.keep, self.token_table)
        check_draft_settings(self.min_benefit, self.max_per_layer)


class AutoPrefetcher(PrefetcherBase):
    """``draft`` when drafting and ``lookahead`` always (in a replay: ``draft`` alone)."""

    name = "auto"
    Config = AutoPrefetcherConfig

    def __init__(self, source: str = "fitted", per_layer: int | None = None, min_benefit: float = 0.2,
                 max_per_layer: int | None = None, picks: int | None = None, keep: int | None = None,
                 gate: bool = True, token_table: int = 2) -> None:
        self.lookahead = LookaheadPrefetcher(source=source, per_layer=per_layer, picks=picks, keep=keep, gate=gate,
                                             token_table=token_table)
        self.draft = DraftPrefetcher(min_benefit=min_benefit, max_per_layer=max_per_layer)

    def bind(self, target: Any, sink: Any) -> None:
        super().bind(target, sink)
        self.lookahead.bind(target, sink)
        self.draft.bind(target, sink)

    def after_level(self, tree: DraftTree, predicted: Sequence[int], resident: np.ndarray) -> None:
        self.draft.after_level(tree, predicted, resident)

    def counters(self) -> dict[str, int]:
        return self.lookahead.counters()

    def needs_predictions(self, tree: DraftTree) -> bool:
        return self.draft.needs_predictions(tree)  # the look-ahead reads hidden states, not predictions
