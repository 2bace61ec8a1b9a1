"""The draft tree: candidate tokens after the last committed token, grown one level at a time.

Node indices are assigned in creation order, so a parent always has a smaller index than its
children (topological order). The root is implicit: it is the last committed token, which the
target has not processed yet; ``parent == -1`` marks a child of the root.

Besides the nodes, a tree may carry what acceptance estimators learn from and that only the
drafter or the verifier knows: the draft head's entropy at each node it expanded (and at the
root) and its acceptance probe's logit there, the target's probability of the root token, and the
sequence the tree continues. All are optional: NaN / None when the drafter or verifier does not
provide them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specfit.types.context import ContextView, context_continuations

ROOT = -1


@dataclass
class DraftTree:
    root_token: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # log q(token | parent path), draft model
    path_log_probs: list[float] = field(default_factory=list)  # sum of log_probs from the root
    level_starts: list[int] = field(default_factory=list)  # first node index of each level
    # Predicted experts, filled by the expert predictor (-1 = none): per node [n, layers, top_k],
    # and for the root, which every pass verifies [layers, top_k].
    experts: np.ndarray | None = None
    root_experts: np.ndarray | None = None
    # Optionally, how likely each expert is to be used, float32 per node [n, layers, experts] and for
    # the root [layers, experts] (rows of nodes not predicted are NaN): a predictor that knows how
    # sure it is says so here, for plug-ins that weigh expected use (the draft prefetcher). None:
    # the picks above are all that is known.
    expert_probs: np.ndarray | None = None
    root_expert_probs: np.ndarray | None = None
    # After a greedy verification: the target's token after the accepted path (the bonus). With the
    # accepted path it settles the acceptance of most unverified nodes too (see greedy_outcomes).
    greedy_next: int | None = None
    # The draft head's entropy (nats) of its full next-token distribution at each node it expanded,
    # float32 per node (NaN: not expanded, or a drafter that does not tell; grown by set_entropy),
    # and at the root (NaN: unknown).
    entropy: np.ndarray | None = None
    root_entropy: float = float("nan")
    # The drafter's own estimate, as a logit, that the head's top-1 child of each node it expanded
    # (and of the root) is accepted given the node is: its acceptance probe's output, laid out as
    # ``entropy`` (grown by set_accept_logit; NaN: not expanded, or no probe).
    accept_logit: np.ndarray | None = None
    root_accept_logit: float = float("nan")
    # The target's probability of the root token where it produced it (the last verification's
    # bonus, or the prefill's first token): greedy, the softmax of its argmax; sampling, the sampled
    # token's under the processed distribution. None: the verifier did not tell.
    root_prob: float | None = None
    # The sequence the tree continues (prompt and committed tokens, a specfit.types.context.ContextView),
    # for estimators that look drafted tokens up in it (:meth:`continuations`). None: not told.
    context: ContextView | None = None
    _tails: list = field(default_factory=list, repr=False, compare=False)  # continuations' cache
    # top_by_path_prob's last answer, (nodes in the tree, k, nodes): the cycle and the selector both
    # ask after each level, and nodes are only ever added
    _likeliest: tuple = field(default=(0, 0, ()), repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return len(self.level_starts)

    def level(self, d: int) -> range:
        """Node indices of level ``d`` (1-based: level 1 holds the root's children)."""
        start = self.level_starts[d - 1]
        stop = self.level_starts[d] if d < len(self.level_starts) else len(self.tokens)
        return range(start, stop)

    def add_level(self, parents: Sequence[int], tokens: Sequence[int], log_probs: Sequence[float]) -> range:
        """Append one level of nodes; each parent must be the root or a node of the previous level."""
        if not (len(parents) == len(tokens) == len(log_probs)):
            raise ValueError("add_level: parents, tokens and log_probs must have the same length")
        prev = self.level(self.depth) if self.depth else None
        parents = [int(p) for p in parents]
        if prev is None and any(p != ROOT for p in parents):
            raise ValueError("the first level must hang from the root (parent -1)")
        if prev is not None and parents and not (prev.start <= min(parents) and max(parents) < prev.stop):
            bad = next(p for p in parents if p not in prev)
            raise ValueError(f"parent {bad} is not a node of the previous level")
        start = len(self.tokens)
        self.level_starts.append(start)
        log_probs = [float(lp) for lp in log_probs]
        path = self.path_log_probs
        bases = [0.0] * len(parents) if prev is None else [path[p] for p in parents]
        self.tokens.extend(int(t) for t in tokens)
        self.parents.extend(parents)
        self.depths.extend([self.depth] * len(parents))
        self.log_probs.extend(log_probs)
        path.extend(b + lp for b, lp in zip(bases, log_probs))
        return range(start, len(self.tokens))

    def expert_rows(self, layers: int, top_k: int) -> np.ndarray:
        """``experts`` grown to one row per node (new rows -1), for a predictor to fill in place."""
        n = len(self.tokens)
        if self.experts is None or self.experts.shape[1:] != (layers, top_k):
            self.experts = np.full((n, layers, top_k), -1, dtype=np.int32)
        elif self.experts.shape[0] < n:
            pad = np.full((n - self.experts.shape[0], layers, top_k), -1, dtype=np.int32)
            self.experts = np.concatenate([self.experts, pad])
        return self.experts

    def expert_prob_rows(self, layers: int, experts: int) -> np.ndarray:
        """``expert_probs`` grown to at least one row per node (new rows NaN), for a predictor to fill
        in place; it may hold more rows than nodes (at real dims a 610-node tree's is 15 MB, so it
        doubles rather than being copied at every level)."""
        n = len(self.tokens)
        if self.expert_probs is None or self.expert_probs.shape[1:] != (layers, experts):
            self.expert_probs = np.full((n, layers, experts), np.nan, dtype=np.float32)
        elif self.expert_probs.shape[0] < n:  # grown by doubling: a level's copy of every row costs
            old = self.expert_probs.shape[0]
            grown = np.empty((max(n, 2 * old), layers, experts), dtype=np.float32)
            grown[:old] = self.expert_probs
            grown[old:] = np.nan  # each byte written once
            self.expert_probs = grown
        return self.expert_probs

    def set_entropy(self, nodes: Sequence[int], values: Sequence[float]) -> None:
        """Record the head's entropy at the expanded ``nodes`` (``ROOT`` for the root)."""
        self._record("entropy", nodes, values)

    def set_accept_logit(self, nodes: Sequence[int], values: Sequence[float]) -> None:
        """Record the drafter's acceptance logit at the expanded ``nodes`` (``ROOT`` for the root)."""
        self._record("accept_logit", nodes, values)

    def _record(self, name: str, nodes: Sequence[int], values: Sequence[float]) -> None:
        """Set the per-expanded-node array ``name`` (and ``root_<name>``), grown to the tree's size."""
        nodes, values = np.asarray(nodes, dtype=np.int64), np.asarray(values, dtype=np.float32)
        if nodes.shape != values.shape:
            raise ValueError(f"set_{name}: nodes and values must have the same length")
        at_root = nodes == ROOT
        if at_root.any():
            setattr(self, f"root_{name}", float(values[at_root][-1]))
        nodes, values = nodes[~at_root], values[~at_root]
        if not len(nodes):
            return
        if int(nodes.min()) < 0 or int(nodes.max()) >= len(self.tokens):
            raise ValueError(f"set_{name}: node ids must be ROOT or 0..{len(self.tokens) - 1}")
        known = getattr(self, name)
        if known is None or len(known) < len(self.tokens):
            grown = np.full(len(self.tokens), np.nan, dtype=np.float32)
            if known is not None:
                grown[: len(known)] = known
            setattr(self, name, grown)
        getattr(self, name)[nodes] = values

    def node_entropy(self) -> np.ndarray:
        """float32 [len(tree)]: the head's entropy at each node (NaN where it did not expand it or
        did not tell; ``entropy`` may be shorter than the tree: levels added after the last record)."""
        return self._per_node(self.entropy)

    def node_accept_logit(self) -> np.ndarray:
        """float32 [len(tree)]: the drafter's acceptance logit at each node (NaN: not known)."""
        return self._per_node(self.accept_logit)

    def _per_node(self, known: np.ndarray | None) -> np.ndarray:
        out = np.full(len(self.tokens), np.nan, dtype=np.float32)
        if known is not None:
            n = min(len(known), len(self.tokens))
            out[:n] = known[:n]
        return out

    def parent_entropy(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float64 [stop - start]: the head's entropy at the parent of each of nodes ``start:stop``
        (NaN where it is not known)."""
        return self._at_parent(self.node_entropy(), self.root_entropy, start, stop)

    def parent_accept_logit(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float64 [stop - start]: the drafter's acceptance logit at the parent of each of nodes
        ``start:stop`` (NaN where it is not known)."""
        return self._at_parent(self.node_accept_logit(), self.root_accept_logit, start, stop)

    def _at_parent(self, per_node: np.ndarray, at_root: float, start: int, stop: int | None) -> np.ndarray:
        stop = len(self.tokens) if stop is None else stop
        parents = np.asarray(self.parents[start:stop], dtype=np.int64)
        known = np.append(per_node.astype(np.float64), at_root)  # the last: the root
        return known[np.where(parents == ROOT, len(self.tokens), parents)]

    def continuations(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """For nodes ``start:stop``: the token that followed the last earlier occurrence, in the
        context, of the longest n-gram just before the node (-1: none did) and that n-gram's length
        (0); None when the tree has no context (:func:`specfit.types.context.context_continuations`)."""
        if self.context is None:
            return None
        stop = len(self.tokens) if stop is None else stop
        return context_continuations(self.context, self.tokens, self.parents, self._tails, start, stop)

    def path_probs(self) -> np.ndarray:
        return np.exp(np.asarray(self.path_log_probs, dtype=np.float64))

    def parents_array(self) -> np.ndarray:
        return np.asarray(self.parents, dtype=np.int32)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def is_ancestor_closed(self, nodes: Sequence[int]) -> bool:
        """Whether ``nodes`` are valid node ids whose ancestors are all among them."""
        return subtree_problem(self, nodes) is None

    def top_by_path_prob(self, k: int) -> list[int]:
        """The ``k`` nodes with the highest path probability (ties to the earlier node), ascending.

        Ancestor-closed whenever path probabilities never rise with depth, which holds for a
        draft model's log-probabilities (each is <= 0). A node left out stays out as the tree
        grows: a new node ranks after every node at least as likely, so the nodes ahead of one
        only grow in number."""
        if k <= 0 or not self.tokens:
            return []
        if k >= len(self.tokens):
            return list(range(len(self.tokens)))
        if self._likeliest[:2] != (len(self.tokens), k):
            path = np.asarray(self.path_log_probs, dtype=np.float64)
            order = np.lexsort((np.arange(len(path)), -path))  # by path probability, then index
            self._likeliest = (len(self.tokens), k, tuple(np.sort(order[:k]).tolist()))
        return list(self._likeliest[2])  # the caller's own list


@dataclass(frozen=True)
class VerifyBlock:
    """The tokens one verification pass feeds the target: the root, then the chosen nodes.

    ``parents`` index into the block (0 is the root; the root's own parent is -1) and ``nodes``
    maps block positions 1.. back to tree node indices.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    nodes: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> np.ndarray:
        """bool [T, T]: row i may attend to column j (j is i or an ancestor of i)."""
        t = len(self.tokens)
        mask = np.zeros((t, t), dtype=bool)
        for i in range(t):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        return kids


def subtree_problem(tree: DraftTree, nodes: Sequence[int]) -> str | None:
    """Why ``nodes`` are not a verifiable subtree of ``tree``, or None when they are: each must be an
    int node id in ``0..len(tree)-1`` (a negative one would silently index from the end) whose
    parent is the root or chosen too. Duplicates are allowed. Vectorised: selectors call it per level."""
    n = len(tree)
    try:
        ids = np.asarray(nodes)
    except (TypeError, ValueError):  # ragged or otherwise not an array of ids
        return f"nodes must be a list of node ids (ints), got {type(nodes).__name__}"
    if ids.size == 0:
        return None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        return f"nodes must be a flat list of node ids (ints), got {ids.dtype} values of shape {ids.shape}"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= n:
        return f"node id {low if low < 0 else high} is out of range (tree has {n} nodes)"
    parents = np.asarray(tree.parents, dtype=np.int64)[ids]
    chosen = np.zeros(n + 1, dtype=bool)  # the last entry stands for the root (parent -1)
    chosen[ids] = True
    chosen[n] = True
    orphans = ~chosen[np.where(parents < 0, n, parents)]
    if orphans.any():
        v = int(ids[np.argmax(orphans)])
        return f"nodes are not closed under ancestors (node {v} is chosen, its parent {tree.parents[v]} is not)"
    return None


def verify_block(tree: DraftTree, nodes: Sequence[int]) -> VerifyBlock:
    """The root plus the chosen ``nodes`` (must be ancestor-closed), in topological order."""
    problem = subtree_problem(tree, nodes)
    if problem:
        raise ValueError(problem)
    chosen = sorted(set(int(v) for v in nodes))
    position = {v: i + 1 for i, v in enumerate(chosen)}
    parents = [-1] + [0 if tree.parents[v] == ROOT else position[tree.parents[v]] for v in chosen]
    return VerifyBlock(
        tokens=[tree.root_token] + [tree.tokens[v] for v in chosen],
        parents=parents,
        depths=[0] + [tree.depths[v] for v in chosen],
        nodes=chosen,
    )


def greedy_outcomes(tree: DraftTree, accepted: Sequence[int]) -> np.ndarray:
    """Under greedy decoding, whether each drafted node would have been accepted had it been
    verified: 1 yes, 0 no, -1 unknown. Needs ``tree.greedy_next``.

    The target's argmax is known after the root and after every accepted node (the next accepted
    token, or the bonus after the last), so every child of those is settled, and so is everything
    below a rejected node. Only what lies below the one unverified child that matches the bonus
    stays unknown. Learning acceptance from all drafted nodes, not just verified ones, keeps a
    selector that verifies little from never learning what it skipped.
    """
    if tree.greedy_next is None:
        raise ValueError("greedy_outcomes needs tree.greedy_next (set after a greedy verification)")
    path = list(accepted)
    on_path = set(path)
    argmax_after = {ROOT: tree.tokens[path[0]] if path else tree.greedy_next}
    for i, v in enumerate(path):
        argmax_after[v] = tree.tokens[path[i + 1]] if i + 1 < len(path) else tree.greedy_next
    out = np.full(len(tree), -1, dtype=np.int8)
    for v, parent in enumerate(tree.parents):
        if parent == ROOT or parent in on_path:
            out[v] = int(tree.tokens[v] == argmax_after[parent])
        elif out[parent] == 0:
            out[v] = 0
    return out
