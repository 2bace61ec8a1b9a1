"""A test drafter that knows the target's greedy continuation, to exercise acceptance paths.

It builds full trees of ``branching`` children per node up to ``depth``; a child on the true path
is proposed at a random rank (and sometimes left out), the others are random tokens. With a
random EAGLE head nothing is ever accepted; this drafter makes acceptance, KV compaction of
non-first branches, stop tokens and max-token cut-offs inside accepted paths actually happen.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

from specfit.types.tree import ROOT, DraftTree


class ScriptedDrafter:
    name = "scripted"
    path = None  # no weights (what the setup's fingerprint reads)
    top_k = None
    probe_left_unused = False

    def __init__(self, reference: Sequence[int], vocab: int, branching: int = 2, depth: int = 3,
                 total_tokens: int = 1000, miss: float = 0.2, seed: int = 0) -> None:
        self.reference = list(reference)  # prompt + greedy continuation
        self.vocab, self.branching, self.depth, self.total_tokens = vocab, branching, depth, total_tokens
        self.miss = miss
        self.rng = random.Random(seed)

    def bind(self, target: Any) -> None:
        pass

    def feature_layers(self) -> Sequence[int]:
        return ()

    def start(self, prompt_ids: Sequence[int], features: Any, next_token: int) -> None:
        self.sequence = list(prompt_ids) + [next_token]

    def commit(self, tokens: Sequence[int], features: Any, next_token: int) -> None:
        self.sequence += list(tokens[1:]) + [next_token]

    def _truth(self, path: list[int]) -> int | None:
        """The reference token after the committed sequence plus ``path``, if it is on the true path."""
        pos = len(self.sequence)
        if self.sequence != self.reference[:pos]:
            return None
        if path != self.reference[pos : pos + len(path)]:
            return None
        nxt = pos + len(path)
        return self.reference[nxt] if nxt < len(self.reference) else None

    def draft(self, tree: DraftTree) -> Iterator[range]:
        frontier = [ROOT]
        for _ in range(self.depth):
            parents, tokens, logps = [], [], []
            for node in frontier:
                path = [] if node == ROOT else [tree.tokens[v] for v in tree.path_to(node)]
                truth = self._truth(path)
                kids = self.rng.sample(range(self.vocab), self.branching)
                if truth is not None and self.rng.random() > self.miss:
                    kids = [t for t in kids if t != truth][: self.branching - 1]
                    kids.insert(self.rng.randrange(self.branching), truth)
                for rank, t in enumerate(kids):
                    parents.append(node)
                    tokens.append(t)
                    logps.append(-0.1 - rank - self.rng.random() * 0.01)
            level = tree.add_level(parents, tokens, logps)
            frontier = list(level)
            yield level


def first_tree(engine: Any, drafter: Any, prompt: Sequence[int]) -> tuple[Any, int, DraftTree]:
    """``(prefill, root, tree)``: the engine's prefill of ``prompt``, its greedy next token (the
    root) and the tree ``drafter`` (the engine's) drafts from it, every level."""
    import torch

    with torch.inference_mode():
        prefill = engine.target.prefill(prompt)
        root = int(prefill.logits[-1].argmax())
        drafter.start(prompt, prefill.features, root)
        tree = DraftTree(root_token=root)
        for _ in drafter.draft(tree):
            pass
    return prefill, root, tree
