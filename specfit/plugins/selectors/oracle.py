"""The oracle: verify exactly the path the target will accept (trace replay only).

It reads the accepted path from ``SelectionContext.extra`` (put there by
:mod:`specfit.trace.replay`, which knows the recorded argmaxes), verifies those nodes and nothing
else, and stops drafting as soon as the whole path is drafted. It commits the most tokens any
selector can at each position of a trace, with no wasted verification: the reference every replayed
selector is reported against. A live run has no future knowledge, so it refuses to run there.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfit.interfaces import (
    ACCEPTED_KEY,
    ConfigError,
    DraftTree,
    Selection,
    SelectionContext,
    SelectorBase,
    SelectorConfig,
)


@dataclass
class OracleSelectorConfig(SelectorConfig):
    name: str = "oracle"


class OracleSelector(SelectorBase):
    name = "oracle"
    Config = OracleSelectorConfig

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        path = ctx.extra.get(ACCEPTED_KEY)
        if path is None:
            raise ConfigError("selector=oracle needs to know what the target will accept, which only a trace "
                              "replay knows: use it with `specfit replay trace.path=DIR selector=oracle`")
        drafted = [v for v in path if v < len(tree)]
        return Selection(nodes=drafted, stop=len(drafted) == len(path))
