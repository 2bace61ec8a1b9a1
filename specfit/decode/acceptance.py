"""Deciding which verified nodes the target accepts, without changing what it would generate.

At every block position the target's own next token is decided first (greedy: its argmax;
sampling: an exact draw from its distribution, with the uniform number of that output position,
see :class:`specfit.decode.sampling.Sampler`); the child that drafted this token is accepted, and
when none did, the token is the bonus. Each committed token is thus exactly the token the target
would produce at its position, whatever was drafted. For sampling this accepts a drafted token x
with probability p(x), and, after rejecting it, another x' with p(x') / (1 - p(x)): the acceptance
rates of EAGLE's multi-draft rejection scheme for deterministic (top-k) candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specfit.decode.sampling import Sampler
from specfit.types.tree import VerifyBlock


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted block positions (the root, position 0, excluded), in order
    bonus: int  # the token the target produces after the accepted path


def accept(block: VerifyBlock, logits: torch.Tensor, sampler: Sampler) -> Acceptance:
    """Walk down the block from the root; ``logits`` are the target's [len(block), vocab].

    The token after block position ``pos`` is output token ``sampler.position + depth(pos)``."""
    return walk(block, lambda pos: sampler.token(logits[pos], sampler.position + block.depths[pos]))


def walk(block: VerifyBlock, token_after: Callable[[int], int]) -> Acceptance:
    """Accept down the block: ``token_after(pos)`` is the target's token after block position ``pos``
    (sampled or greedy live; the recorded argmax in a trace replay)."""
    children = block.children()
    path: list[int] = []
    pos = 0
    while True:
        token = token_after(pos)
        nxt = _drafted(block, children[pos], token)
        if nxt is None:
            return Acceptance(path, token)
        path.append(nxt)
        pos = nxt


def _drafted(block: VerifyBlock, candidates: list[int], token: int) -> int | None:
    """The first candidate block position that drafted ``token``, if any."""
    return next((c for c in candidates if block.tokens[c] == token), None)
