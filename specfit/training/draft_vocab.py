"""The EAGLE-3 draft vocabulary: the most frequent target tokens, and its ``d2t`` / ``t2d`` maps.

A head that predicts over a few thousand frequent tokens instead of the whole target vocabulary
spends far less on its ``lm_head`` and softmax (for a 150k-token target, most of its compute),
while losing little: the rare tokens it cannot propose are rarely the target's choice.

The maps follow the public layout (EAGLE-3, SpecForge, SGLang, vLLM): the draft ids are the chosen
target ids in increasing order, ``d2t[i]`` is the *offset* such that ``target id = i + d2t[i]``,
and ``t2d`` is a boolean mask over the target vocabulary marking the chosen ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from specfit.errors import ConfigError


@dataclass
class DraftVocab:
    """A draft vocabulary over a target vocabulary of ``len(t2d)`` tokens."""

    draft_ids: np.ndarray  # [draft_vocab] target ids, increasing
    d2t: np.ndarray  # [draft_vocab] int64 offsets: target id = draft id + d2t[draft id]
    t2d: np.ndarray  # [target_vocab] bool: the target id is in the draft vocabulary

    @property
    def size(self) -> int:
        return len(self.draft_ids)

    @property
    def full(self) -> bool:
        """True when the draft vocabulary is the whole target vocabulary (``d2t`` all zero)."""
        return self.size == len(self.t2d)

    def coverage(self, counts: np.ndarray) -> float:
        """Share of the counted token occurrences that the draft vocabulary covers."""
        total = float(counts.sum())
        return float(counts[self.draft_ids].sum()) / total if total else 1.0


def token_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Occurrences of each target id in ``tokens`` (ids outside the vocabulary are an error)."""
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ConfigError(f"token ids outside the target vocabulary [0, {vocab_size}) in the training data")
    return np.bincount(tokens.astype(np.int64, copy=False), minlength=vocab_size).astype(np.int64)


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int,
                      always_include: Iterable[int] = ()) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids of ``counts`` plus every id in ``always_include``.

    ``always_include`` holds special tokens (EOS, padding): a head that cannot propose EOS never
    lets a draft end a sequence. They take the places of the least frequent picks. Ties break
    towards the lower id, and ids never seen fill any places left (lowest id first), so the result
    is a pure function of the counts. A size of at least the target vocabulary gives the full
    vocabulary with all-zero ``d2t``.
    """
    vocab = len(counts)
    if draft_vocab_size < 1:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} must be >= 1")
    if draft_vocab_size >= vocab:
        ids = np.arange(vocab, dtype=np.int64)
    else:
        forced = sorted({int(i) for i in always_include if 0 <= int(i) < vocab})
        if len(forced) > draft_vocab_size:
            raise ConfigError(f"draft_vocab_size={draft_vocab_size} cannot hold the {len(forced)} special tokens")
        order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then lower id
        order = order[~np.isin(order, forced)][: draft_vocab_size - len(forced)]
        ids = np.sort(np.concatenate([np.asarray(forced, dtype=np.int64), order.astype(np.int64)]))
    d2t = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    return DraftVocab(draft_ids=ids, d2t=d2t, t2d=t2d)
