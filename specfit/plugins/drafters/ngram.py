"""The n-gram drafter (prompt lookup): drafts what followed the last earlier occurrence of the
latest tokens, with no model pass.

The prompt and the committed tokens are indexed by n-gram (:mod:`specfit.types.context`). A draft is
the continuation of the longest n-gram (``min_match`` to 8 tokens) that ends at the root, extended
one token per level by the same lookup on the tokens drafted so far, up to ``depth`` tokens: a
chain, as vLLM's ``ngram`` method and transformers' prompt-lookup decoding draft. It pays where text
repeats (a prompt that is quoted or edited, code, a target that loops) and costs next to nothing
where it does not (no match: no draft, and the cycle is a plain pass).

Each node's probability is the drafter's running estimate of how often a continuation found by an
n-gram of that length is accepted, learned from what the target committed (the first token that
differs from the chain, which the target itself produced, settles each proposal; start 1/2), so
path probabilities are calibrated for cost-aware selectors and the ``learned`` estimator sees the
match through its context features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from specfit.interfaces import ORDERS, ROOT, ConfigError, DrafterBase, DrafterConfig, DraftTree, TokenContext, integer
from specfit.plugins.drafters.eagle3.drafter import TREE_LIMITS


@dataclass
class NgramDrafterConfig(DrafterConfig):
    name: str = "ngram"
    depth: int = 5  # tokens drafted per cycle, at most (vLLM: num_speculative_tokens)
    min_match: int = 2  # the shortest n-gram matched (vLLM: prompt_lookup_min); the longest is 8

    def __post_init__(self) -> None:
        check_ngram_settings(self.depth, self.min_match)


def check_ngram_settings(depth: int, min_match: int) -> None:
    """``drafter.depth`` in [1, TREE_LIMITS], ``drafter.min_match`` one of ORDERS (2, 3, 4, 6, 8:
    the n-gram lengths indexed): one line naming the key."""
    for key, value, low, high in (("depth", depth, 1, TREE_LIMITS["depth"]),
                                  ("min_match", min_match, ORDERS[0], ORDERS[-1])):
        if integer(f"drafter.{key}", value, minimum=low) > high:
            raise ConfigError(f"drafter.{key}={value} exceeds {high}")
    if min_match not in ORDERS:  # 5 or 7 would silently match only from 6 or 8 tokens
        raise ConfigError(f"drafter.min_match={min_match} must be one of {', '.join(map(str, ORDERS))}"
                          " (the n-gram lengths indexed)")


class NgramDrafter(DrafterBase):
    name = "ngram"
    Config = NgramDrafterConfig

    def __init__(self, depth: int = 5, min_match: int = 2) -> None:
        check_ngram_settings(depth, min_match)
        self.depth = self.total_tokens = depth
        self.min_match = min_match
        self.context = TokenContext()
        self._chain: list[tuple[int, int]] = []  # (token, matched length) drafted in the current cycle
        self._tried = {n: 0.0 for n in ORDERS}
        self._accepted = {n: 0.0 for n in ORDERS}

    def acceptance(self, length: int) -> float:
        """The running acceptance rate of continuations found by an n-gram of ``length`` tokens."""
        return (self._accepted[length] + 1.0) / (self._tried[length] + 2.0)

    def start(self, prompt_ids: Sequence[int], features: Any, next_token: int) -> None:
        self.context = TokenContext([*prompt_ids, next_token])
        self._chain = []

    def draft(self, tree: DraftTree) -> Iterator[range]:
        self._chain = []
        view = self.context.view()
        before, parent = view.tail(ORDERS[-1]), ROOT
        for _ in range(self.depth):
            token, length = view.longest(before, self.min_match)
            if length == 0:
                return
            level = tree.add_level([parent], [token], [math.log(self.acceptance(length))])
            self._chain.append((token, length))
            before, parent = (before + (token,))[-ORDERS[-1]:], level.start
            yield level

    def commit(self, tokens: Sequence[int], features: Any, next_token: int) -> None:
        """``tokens``: the root and the accepted path; ``next_token`` the target's token after them.
        Each drafted token up to the first that differs from what was committed is settled."""
        committed = [*tokens[1:], next_token]
        for (token, length), actual in zip(self._chain, committed):
            self._tried[length] += 1.0
            if token != actual:
                break
            self._accepted[length] += 1.0
        self._chain = []
        self.context.extend(committed)
