"""No drafter: every cycle verifies only the root, which is plain autoregressive decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from specfit.config import DrafterConfig
from specfit.core.tree import DraftTree


@dataclass
class NoDrafterConfig(DrafterConfig):
    name: str = "none"


class NoDrafter:
    name = "none"
    Config = NoDrafterConfig
    depth = 0
    total_tokens = 0

    def bind(self, target: Any) -> None:
        pass

    def feature_layers(self) -> Sequence[int]:
        return ()

    def start(self, prompt_ids: Sequence[int], features: Any, next_token: int) -> None:
        pass

    def draft(self, tree: DraftTree) -> Iterator[range]:
        return iter(())

    def commit(self, tokens: Sequence[int], features: Any, next_token: int) -> None:
        pass
