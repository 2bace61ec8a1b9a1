"""A trace's positions as settled trees: what the learned acceptance estimator is fitted and scored on
offline (``specfit fit-acceptance``)."""

from __future__ import annotations

from typing import Iterator

from specfit.trace.format import Trace
from specfit.types.acceptance import SettledTree
from specfit.types.context import TokenContext
from specfit.types.tree import DraftTree


def trace_trees(trace: Trace) -> Iterator[SettledTree]:
    """Every position of every sequence of ``trace``, in recording order: the drafted tree, and the
    accepted path had the recording's candidates all been verified, with the target's token after
    it (``greedy_next``), so :func:`settled` knows every outcome the target's argmaxes decide."""
    for seq in trace.sequences:
        context = TokenContext([*seq.prompt.tolist(), int(seq.output[0])])
        for pos in range(len(seq)):
            if pos:
                context.extend([int(seq.output[pos])])
            rec = seq.position(pos)
            tree = DraftTree(root_token=int(rec.root), context=context.view())
            for _ in rec.draft(tree):  # with the recorded entropies and root probability
                pass
            path = rec.accepted_path()
            tree.greedy_next = int(rec.argmax[rec.rows([path[-1]])[0]]) if path else int(rec.root_argmax)
            yield SettledTree(tree, rec.verified.tolist(), path)
