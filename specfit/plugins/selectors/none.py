"""Never speculate: every cycle verifies the root alone, an autoregressive step.

With ``drafter=none`` it changes nothing; with a real drafter it keeps the drafter bound but never
asks it to draft. Trace replay uses it for autoregressive methods (``ar``): the recorded trees go
unused and each cycle commits the target's next token.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfit.interfaces import DraftTree, Selection, SelectionContext, SelectorBase, SelectorConfig


@dataclass
class NoDraftSelectorConfig(SelectorConfig):
    name: str = "none"


class NoDraftSelector(SelectorBase):
    name = "none"
    Config = NoDraftSelectorConfig

    def should_draft(self) -> bool:
        return False

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        return Selection(nodes=[], stop=True)
