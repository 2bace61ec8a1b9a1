"""Deciding which verified nodes the target accepts, without changing what it would generate.

Greedy: follow the child whose token is the target's argmax. Sampling: EAGLE's multi-draft
rejection scheme for deterministic (top-k) candidates: try each distinct child token x in turn,
accept it with probability p(x); on rejection set p(x) = 0 and renormalise; when no child is
accepted, draw the bonus token from what is left. Each step is then an exact draw from the
target's distribution p, so sampling is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfit.core.sampling import Sampler
from specfit.core.tree import VerifyBlock


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted block positions (the root, position 0, excluded), in order
    bonus: int  # the token the target produces after the accepted path


def accept(block: VerifyBlock, logits: torch.Tensor, sampler: Sampler) -> Acceptance:
    """Walk down the block from the root; ``logits`` are the target's [len(block), vocab]."""
    children = block.children()
    path: list[int] = []
    pos = 0
    while True:
        if sampler.params.greedy:
            token = int(torch.argmax(logits[pos]))
            nxt = next((c for c in children[pos] if block.tokens[c] == token), None)
            if nxt is None:
                return Acceptance(path, token)
        else:
            nxt, residual = _rejection_step(block, children[pos], sampler.probs(logits[pos]), sampler)
            if nxt is None:
                return Acceptance(path, sampler.draw(residual))
        path.append(nxt)
        pos = nxt


def _rejection_step(
    block: VerifyBlock, candidates: list[int], probs: torch.Tensor, sampler: Sampler
) -> tuple[int | None, torch.Tensor]:
    tried: set[int] = set()
    for c in candidates:
        x = block.tokens[c]
        if x in tried:
            continue
        tried.add(x)
        if sampler.uniform() < float(probs[x]):
            return c, probs
        probs = probs.clone()
        probs[x] = 0.0
        total = float(probs.sum())
        if total <= 0.0:  # only float round-off can get here: p(x) was 1 up to rounding
            probs[x] = 1.0
            return None, probs
        probs = probs / total
    return None, probs
