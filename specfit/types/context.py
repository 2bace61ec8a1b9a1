"""The sequence so far, indexed by n-gram: which token followed the last earlier occurrence of the
tokens that precede a drafted node.

Where the text repeats itself (a target that loops, code, a quoted prompt), the token after an
n-gram's last occurrence is very likely the next one: the signal prompt-lookup decoding and vLLM's
``ngram`` drafter draft from. Here it tells acceptance estimators which drafted nodes the target
will accept. Measured on the demo pair's held-out traces (nodes whose parent the target accepted):
on prose, nodes of draft probability 0.05-0.2 were accepted 26-34% of the time, 91-93% when the
node's token was the trigram's continuation and 14-18% when another token was; even below 0.05,
78% on a match against 2%. On GSM matches are rarer and weaker (63-76% against 12-34%).

:class:`TokenContext` grows with the committed tokens (append only); :meth:`TokenContext.view`
fixes its length, so a tree's view answers as the context stood when the tree was drafted, however
far the decode has gone since. :func:`context_continuations` gives each drafted node's continuation
and the length of the n-gram it continues.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, Sequence

import numpy as np

ORDERS = (2, 3, 4, 6, 8)
"""n-gram lengths indexed; a node's continuation is that of the longest one that occurred. How long
a match is tells how far the text repeats: on the demo's held-out prose a match of 6-8 tokens
was accepted 96% of the time, one of 2-3 tokens 52-59%."""


class TokenContext:
    """The prompt and the committed tokens, with the positions that follow every n-gram of ORDERS."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the token after it
        self._indexed = 0  # tokens indexed so far: the index is built when first asked, not before
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens. Cheap: a decode whose parts never look anything up (a long prompt with
        the path_prob estimator) pays no indexing."""
        self.tokens.extend(int(t) for t in tokens)

    def _index(self) -> None:
        toks, after = self.tokens, self._after
        for k in range(self._indexed, len(toks)):
            for n in ORDERS:
                if k >= n:
                    after.setdefault(tuple(toks[k - n:k]), []).append(k)
        self._indexed = len(toks)

    def view(self) -> ContextView:
        """The context as it stands now; later tokens do not change what the view answers."""
        return ContextView(self, len(self.tokens))


class ContextView:
    """The first ``length`` tokens of a :class:`TokenContext`."""

    __slots__ = ("context", "length")

    def __init__(self, context: TokenContext, length: int) -> None:
        self.context, self.length = context, length

    def tail(self, n: int) -> tuple[int, ...]:
        return tuple(self.context.tokens[max(self.length - n, 0):self.length])

    def longest(self, before: tuple[int, ...], min_order: int = ORDERS[0]) -> tuple[int, int]:
        """(the continuation, the n-gram's length) of the longest n-gram of ORDERS (at least
        ``min_order`` long) ending ``before`` that occurred in the view; (-1, 0) if none did."""
        found, length = -1, 0
        for n in ORDERS:  # shortest first: an n-gram never seen has no longer one seen either
            if n < min_order:
                continue
            after = self.continuation(before[-n:]) if len(before) >= n else None
            if after is None:
                break
            found, length = after, n
        return found, length

    def continuation(self, gram: tuple[int, ...]) -> int | None:
        """The token after the last occurrence of ``gram`` that ends before the view's last token
        (an n-gram ending at the view's end has no continuation yet), or None."""
        context = self.context
        if context._indexed < len(context.tokens):
            context._index()
        positions = context._after.get(gram)
        if not positions:
            return None
        i = bisect_left(positions, self.length) - 1  # continuations inside the view
        return context.tokens[positions[i]] if i >= 0 else None


def context_continuations(view: ContextView, tokens: Sequence[int], parents: Sequence[int],
                          tails: list[tuple[int, ...]], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """For drafted nodes ``start:stop``: int64 arrays of the token that followed the last earlier
    occurrence of the longest n-gram (ORDERS) ending at the node's parent (the context, then the
    path through the tree), and that n-gram's length; -1 and 0 where none occurred.

    ``tails`` caches, per node, the last max(ORDERS) tokens of context + path including the node;
    it is grown in place to ``stop`` (nodes come in creation order, parents first)."""
    width = max(ORDERS)
    root = view.tail(width)
    for v in range(len(tails), stop):
        p = parents[v]
        tails.append(((root if p < 0 else tails[p]) + (tokens[v],))[-width:])
    after = np.full(stop - start, -1, dtype=np.int64)
    length = np.zeros(stop - start, dtype=np.int64)
    found: dict[int, tuple[int, int]] = {}  # per parent: siblings continue the same n-gram
    for i, v in enumerate(range(start, stop)):
        p = parents[v]
        if p not in found:
            found[p] = view.longest(root if p < 0 else tails[p])
        after[i], length[i] = found[p]
    return after, length
