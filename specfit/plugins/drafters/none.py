"""No drafter: every cycle verifies only the root, which is plain autoregressive decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from specfit.interfaces import DrafterBase, DrafterConfig, DraftTree


@dataclass
class NoDrafterConfig(DrafterConfig):
    name: str = "none"


class NoDrafter(DrafterBase):
    name = "none"
    Config = NoDrafterConfig
    depth = 0
    total_tokens = 0

    def draft(self, tree: DraftTree) -> Iterator[range]:
        return iter(())
