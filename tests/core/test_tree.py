"""Greedy outcomes of drafted nodes: what one verification settles about the rest of the tree."""

import numpy as np

from specfit.types.tree import ROOT, DraftTree, greedy_outcomes


def test_greedy_outcomes_settle_every_node_the_pass_decides():
    tree = DraftTree(root_token=0)
    a, b = tree.add_level([ROOT, ROOT], [10, 11], [-0.1, -2.0])  # root's children
    c, d, e = tree.add_level([a, a, b], [20, 21, 22], [-0.1, -2.0, -0.5])
    f, g = tree.add_level([c, e], [30, 31], [-0.1, -0.1])
    # verified {a}; accepted [a]; the target's token after a is 20 (node c matches, unverified)
    tree.greedy_next = 20
    out = greedy_outcomes(tree, [a])
    assert out.tolist() == [1, 0, 1, 0, 0, -1, 0]  # f lies below c: unknown; g below rejected b
    tree.greedy_next = 99  # nothing after a matches
    assert greedy_outcomes(tree, [a]).tolist() == [1, 0, 0, 0, 0, 0, 0]
    tree.greedy_next = 11  # nothing accepted: the root's argmax is 11 (node b)
    assert greedy_outcomes(tree, []).tolist() == [0, 1, 0, 0, -1, 0, -1]


def test_top_by_path_prob_ranks_by_path_probability_then_index():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tree = DraftTree(root_token=0)
        level = tree.add_level([ROOT] * 4, [1, 2, 3, 4], np.log(rng.choice([0.1, 0.2, 0.4], 4)).tolist())
        for _ in range(3):  # repeated probabilities: ties are broken by the earlier node
            parents = rng.choice(list(level), 6).tolist()
            level = tree.add_level(parents, list(range(6)), np.log(rng.choice([0.1, 0.5, 1.0], 6)).tolist())
            order = sorted(range(len(tree)), key=lambda i: (-tree.path_log_probs[i], i))
            assert tree.top_by_path_prob(5) == sorted(order[:5])  # asked again after each level
        for k in (0, 1, 5, len(tree), len(tree) + 3):  # the last level's order, for every k
            assert tree.top_by_path_prob(k) == sorted(order[:k])
        tree.top_by_path_prob(5).clear()  # each caller gets its own list
        assert len(tree.top_by_path_prob(5)) == 5
