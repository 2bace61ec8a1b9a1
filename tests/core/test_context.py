"""The sequence's n-gram index (specfit.types.context) and the learned estimator's context features."""

from __future__ import annotations

import numpy as np
import pytest

from specfit.types.context import TokenContext, context_continuations
from specfit.types.tree import ROOT, DraftTree
from specfit.plugins.acceptance.learned import FEATURES, features


def brute_continuation(tokens: list[int], gram: tuple[int, ...]) -> int | None:
    """The token after the last occurrence of ``gram`` that has a token after it."""
    n = len(gram)
    for j in range(len(tokens) - n - 1, -1, -1):
        if tuple(tokens[j:j + n]) == gram:
            return tokens[j + n]
    return None


def test_continuation_is_the_token_after_the_last_earlier_occurrence():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, size=300).tolist()
    context = TokenContext(tokens[:1])
    for k in range(1, len(tokens)):
        context.extend(tokens[k:k + 1])
        view = context.view()
        for n in (2, 3):
            for gram in {tuple(tokens[j:j + n]) for j in range(max(0, k - 20), k - n + 2)}:
                assert view.continuation(gram) == brute_continuation(tokens[:k + 1], gram)


def test_a_view_answers_as_the_context_stood():
    context = TokenContext([1, 2, 3, 9, 1, 2])
    view = context.view()
    assert view.continuation((1, 2)) == 3 and view.tail(3) == (9, 1, 2)
    context.extend([7, 1, 2])  # later occurrences: the old view does not see them
    assert view.continuation((1, 2)) == 3
    assert context.view().continuation((1, 2)) == 7  # (1, 2) at the end has no continuation yet
    assert view.continuation((4, 4)) is None and TokenContext().view().continuation((1, 2)) is None


def test_tree_nodes_look_up_the_tokens_before_them_through_their_path():
    context = TokenContext([5, 6, 7, 8, 0, 5, 6])  # the root, 6, is the context's last token
    tree = DraftTree(root_token=6, context=context.view())
    tree.add_level([ROOT, ROOT], [7, 1], [-0.1, -0.2])  # after (0, 5, 6): unseen; (5, 6) -> 7
    tree.add_level([0, 1], [8, 2], [-0.1, -0.1])  # after (5, 6, 7) -> 8; after (5, 6, 1): nothing
    after, length = tree.continuations()
    assert after.tolist() == [7, 7, 8, -1] and length.tolist() == [2, 2, 3, 0]
    assert tree.continuations(2, 4)[0].tolist() == [8, -1]  # a level asked for on its own agrees
    assert DraftTree(root_token=6).continuations() is None


def test_continuations_prefer_the_longer_gram():
    context = TokenContext([1, 2, 3, 4, 9, 2, 3, 5, 8, 2, 3])  # (2, 3) -> 5 last; (9, 2, 3) -> 5; (1, 2, 3) -> 4
    tails: list[tuple[int, ...]] = []
    view = context.view()
    after, length = context_continuations(view, [0], [ROOT], tails, 0, 1)
    assert after.tolist() == [5] and length.tolist() == [2]  # (8, 2, 3) unseen: the bigram (2, 3)'s
    context2 = TokenContext([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    after, length = context_continuations(context2.view(), [0], [ROOT], [], 0, 1)
    assert after.tolist() == [4] and length.tolist() == [3]  # the trigram (1, 2, 3) wins
    loop = TokenContext([4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8])
    after, length = context_continuations(loop.view(), [9], [ROOT], [], 0, 1)
    assert after.tolist() == [9] and length.tolist() == [8]  # a loop: the longest order indexed


def test_learned_features_mark_matches_and_other_continuations():
    context = TokenContext([10, 11, 12, 13, 10, 11, 12])  # ends with the root
    tree = DraftTree(root_token=12, context=context.view())  # after (10, 11, 12): 13
    tree.add_level([ROOT, ROOT], [13, 14], [-0.5, -1.0])
    x = features(tree, recent=0.5, root_logit=0.0)
    match, other = FEATURES.index("context_match"), FEATURES.index("context_other")
    assert x[:, match].tolist() == [1.0, 0.0] and x[:, other].tolist() == [0.0, 1.0]
    match_len, other_len = FEATURES.index("context_match_len"), FEATURES.index("context_other_len")
    assert x[:, match_len] == pytest.approx([np.log(3), 0.0]) and x[:, other_len] == pytest.approx([0.0, np.log(3)])
    bare = DraftTree(root_token=12)
    bare.add_level([ROOT], [13], [-0.5])
    assert features(bare, 0.5, 0.0)[0, match] == 0 and features(bare, 0.5, 0.0)[0, other] == 0


def test_the_index_is_built_only_when_asked():
    context = TokenContext(range(5000))  # a long prompt, read by nothing: no index
    context.extend([1, 2, 3])
    assert context._indexed == 0 and not context._after
    view = context.view()
    assert view.continuation((1, 2)) == 3
    assert context._indexed == len(context)
    context.extend([1, 2])  # indexed again only when looked up again
    assert context.view().continuation((1, 2)) == 3 and context._indexed == len(context)
