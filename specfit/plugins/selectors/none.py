"""Never speculate: every cycle verifies the root alone, an autoregressive step.

With ``drafter=none`` it changes nothing; with a real drafter it keeps the drafter bound but never
asks it to draft. Trace replay uses it for autoregressive methods (``ar``): the recorded trees go
unused and each cycle commits the target's next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specfit.config import SelectorConfig
from specfit.core.tree import DraftTree
from specfit.interfaces import Selection, SelectionContext


@dataclass
class NoDraftConfig(SelectorConfig):
    name: str = "none"


class NoDraftSelector:
    name = "none"
    Config = NoDraftConfig

    def bind(self, spec: Any) -> None:
        pass

    def should_draft(self) -> bool:
        return False

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        return Selection(nodes=[], stop=True)

    def observe(self, tree: DraftTree, verified: Any, accepted: Any) -> None:
        pass
