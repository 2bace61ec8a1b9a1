"""a_v learned online: a model of P(v accepted | its parent accepted), multiplied down the path.

At most one child of a node is accepted (the committed tokens are one path), so siblings compete:
the model is a multinomial logit over a node's drafted children and "none of them",
P(v | parent) = e^(w.x_v) / (1 + sum of e^(w.x_u) over v and its siblings) (:func:`exclusive`).
Independent per-child logistic estimates (the model before this one) could promise two siblings
0.6 each; on the demo pair's held-out traces the competing form cut the log loss by 3-10% on
prose and 3-5% on GSM (docs/results.md, "Siblings compete"). It learns from sibling sets whose
every member the pass settled: all of them after a greedy pass, after a sampled one the sets it
verified whole (:func:`whole_sibling_sets`).

Features of node v, all known when the selector runs (before verification):

- ``log_share``: log q(v) - log(1 - the q of v and its siblings), where q(v) is v's own draft
  probability given its parent: with weight 1 and every other weight 0 the model gives exactly
  q(v), so an untrained estimator is ``path_prob``;
- ``top_sibling``: 1 when v is its parent's most likely child, and ``log_rank``: log(1 + its rank
  among its siblings by q);
- ``log_depth``: log of v's depth;
- ``parent_path``: the parent's log path probability / 10 (0 for the root's children);
- ``parent_confidence``: logit of the largest q among v's siblings (the peak of the head's
  distribution at the parent, as far as its top-k shows it);
- ``parent_entropy``: the head's entropy (nats) of its full distribution at the parent, which the
  drafter records (:meth:`DraftTree.set_entropy`); where it does not (a third-party drafter, a
  trace of format 1) its lower bound from the top-k, the min-entropy -log(largest sibling q);
- ``root_prob``: logit of the target's probability of the root token where it produced it
  (``tree.root_prob``, from the last verification): a target sure of its last token is in
  predictable text. Unknown (a trace of format 1): the running mean of the values seen;
- ``recent``: logit of the recent acceptance rate of top-ranked children (an exponential average
  over cycles, decay ``recent_decay``), which follows how predictable the current text is;
- ``context_match`` / ``context_other``: 1 when the tokens before v (the context, then v's path)
  occurred earlier in the sequence and were followed by v's token / by another token (the longest
  such n-gram, :mod:`specfit.types.context`), and ``context_match_len`` / ``context_other_len``:
  the same times the log of that n-gram's length, since a longer match repeats more surely. Where
  text repeats, these separate nodes the target accepts from those it does not far better than
  draft probabilities do. All 0 where the tree carries no context;
- ``token_rate``: how often v's token was accepted when drafted before (:class:`TokenRates`,
  learned with the weights and persisted with them): on the demo pair's held-out traces it cut
  the log loss by a quarter on prose and an eighth on GSM (docs/results.md);
- ``probe_top`` / ``probe_other``: the drafter's acceptance logit at the parent (the EAGLE-3
  head's acceptance probe, :mod:`specfit.plugins.drafters.eagle3.probe`: how likely the head's
  top-1 there is the target's token, read from its hidden state) for the parent's most likely
  child / for its other children, whose chances fall as the top one's rise. 0 where the drafter
  has no probe.

The model starts at w0 = (log_share: 1, the rest 0): a_v then equals q(v) and the path product is
P_v, so an untrained ``learned`` estimator is ``path_prob``. Learning is a Laplace-approximate
Bayesian update per verified tree: Newton steps on the tree's conditional samples (see
:func:`specfit.types.acceptance.conditional`) plus a Gaussian prior at the current
weights with precision H, then H grows by the samples' Hessian. H decays by ``forget`` per tree
towards the initial ``prior_strength * I``, so old evidence fades and new text can move the model.
Everything is numpy and deterministic; a tree costs tens of microseconds. The state (w, H, the recent
rate, the token rates) persists per setup; ``specfit fit-acceptance`` fits it offline from a trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.interfaces import (
    ROOT,
    AcceptanceConfig,
    AcceptanceEstimatorBase,
    ConfigError,
    DraftTree,
    conditional,
    integer,
    is_count,
    number,
)

FEATURES = ("bias", "log_share", "top_sibling", "log_rank", "log_depth", "parent_path", "parent_confidence",
            "parent_entropy", "root_prob", "recent", "context_match", "context_other", "context_match_len",
            "context_other_len", "token_rate", "probe_top", "probe_other")
CLIP = 1e-6


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(p, CLIP, 1 - CLIP)
    return np.log(p) - np.log1p(-p)


def features(tree: DraftTree, recent: float, root_logit: float, start: int = 0, stop: int | None = None,
             token_rate: TokenRates | None = None) -> np.ndarray:
    """float [stop - start, len(FEATURES)]: the features of nodes ``start:stop``, which must be
    whole levels (siblings are ranked among themselves; see the module docstring). ``root_logit``:
    the root probability's logit (the caller's stand-in when the tree has none); ``token_rate``:
    the drafted tokens' acceptance so far (None: that feature is 0)."""
    stop = len(tree) if stop is None else stop
    n = stop - start
    x = np.zeros((n, len(FEATURES)))
    if n <= 0:
        return x
    log_q = np.asarray(tree.log_probs[start:stop], dtype=np.float64)
    parents = np.asarray(tree.parents[start:stop], dtype=np.int64)
    group = np.where(parents == ROOT, -1, parents)  # siblings share a group
    order = np.lexsort((np.arange(n), -log_q, group))  # by parent, then q descending
    first = np.r_[0, np.flatnonzero(np.diff(group[order])) + 1]
    starts = np.repeat(first, np.diff(np.r_[first, n]))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - starts
    best = np.empty(n)
    best[order] = log_q[order][starts]
    path = np.asarray(tree.path_log_probs, dtype=np.float64)
    x[:, 0] = 1.0
    undrafted = 1.0 - np.bincount(group + 1, weights=np.exp(log_q))[group + 1]  # the parent's mass left out
    x[:, 1] = log_q - np.log(np.clip(undrafted, CLIP, 1.0))
    x[:, 2] = rank == 0
    x[:, 3] = np.log1p(rank)
    x[:, 4] = np.log(np.asarray(tree.depths[start:stop], dtype=np.float64))
    x[:, 5] = np.where(parents == ROOT, 0.0, np.maximum(path[np.maximum(parents, 0)], -30.0) / 10.0)
    x[:, 6] = _logit(np.exp(best))
    entropy = tree.parent_entropy(start, stop)
    x[:, 7] = np.where(np.isnan(entropy), -best, entropy)  # unknown: the min-entropy, its lower bound
    x[:, 8] = root_logit
    x[:, 9] = float(_logit(recent))
    found = tree.continuations(start, stop)
    if found is not None:  # no context: all 0, as for a node whose n-grams never occurred
        after, length = found
        tokens = np.asarray(tree.tokens[start:stop], dtype=np.int64)
        x[:, 10] = after == tokens
        x[:, 11] = (after >= 0) & (after != tokens)
        log_length = np.log(np.maximum(length, 1))
        x[:, 12] = x[:, 10] * log_length
        x[:, 13] = x[:, 11] * log_length
    if token_rate is not None:
        x[:, 14] = token_rate.lookup(tree.tokens[start:stop])
    probe = np.clip(np.nan_to_num(tree.parent_accept_logit(start, stop), nan=0.0), -30.0, 30.0)
    x[:, 15] = np.where(rank == 0, probe, 0.0)
    x[:, 16] = np.where(rank == 0, 0.0, probe)
    return x


class TokenRates:
    """How often each drafted token was accepted given its parent was (the conditional samples),
    for the ``token_rate`` feature: the logit of its rate, smoothed towards the overall rate by a
    Beta prior of ``strength`` samples, minus the logit of the overall rate (so 0 for a token never
    settled). A head drafts some tokens reliably (the words of a loop, punctuation) and others
    rarely right (numbers), whatever its probabilities say. Counts are kept for at most
    ``max_tokens`` distinct tokens (the first seen), so the persisted state stays small."""

    def __init__(self, strength: float = 2.0, max_tokens: int = 16384) -> None:
        self.strength, self.max_tokens = strength, max_tokens
        self.counts: dict[int, list[float]] = {}  # token -> [accepted, settled]
        self.hits = self.total = 0.0

    def lookup(self, tokens: Sequence[int]) -> np.ndarray:
        """The feature for each of ``tokens`` (one vectorised logit for all of them)."""
        out = np.zeros(len(tokens))
        if self.total <= 0 or not self.counts:
            return out
        found = [self.counts.get(int(t)) for t in tokens]
        known = np.fromiter((c is not None for c in found), bool, len(found))
        if not known.any():
            return out
        counts = np.array([c for c in found if c is not None])
        overall = (self.hits + 1.0) / (self.total + 2.0)
        rate = (counts[:, 0] + self.strength * overall) / (counts[:, 1] + self.strength)
        out[known] = _logit(rate) - float(_logit(overall))
        return out

    def add(self, tokens: Sequence[int], hit: np.ndarray) -> None:
        """Settled samples: ``hit[i]`` says whether ``tokens[i]`` was accepted."""
        for t, h in zip(tokens, hit):
            c = self.counts.get(int(t))
            if c is None:
                if len(self.counts) >= self.max_tokens or int(t) < 0:  # (a drafter's placeholder id)
                    continue
                c = self.counts[int(t)] = [0.0, 0.0]
            c[0] += float(h)
            c[1] += 1.0
        self.hits += float(np.sum(hit))
        self.total += float(len(hit))

    def state(self) -> dict[str, Any]:
        return {"counts": {str(t): c for t, c in self.counts.items()}, "hits": self.hits, "total": self.total}

    def load_state(self, state: dict[str, Any]) -> None:
        """``state`` as :meth:`state` wrote it, checked by :func:`_token_rates_problem`."""
        self.counts = {int(t): [float(a), float(n)] for t, (a, n) in state["counts"].items()}
        self.hits, self.total = float(state["hits"]), float(state["total"])


def _token_rates_problem(state: Any) -> str | None:
    """Why ``state`` is not a :class:`TokenRates` state, or None."""
    if not isinstance(state, dict) or not isinstance(state.get("counts"), dict):
        return "token_rates must hold counts, hits and total"
    if not (is_count(state.get("hits")) and is_count(state.get("total")) and state["hits"] <= state["total"]):
        return "token_rates hits and total must be counts, hits <= total"
    for token, pair in state["counts"].items():
        if not (isinstance(token, str) and token.isascii() and token.isdecimal() and isinstance(pair, list) and len(pair) == 2
                and is_count(pair[0]) and is_count(pair[1]) and pair[0] <= pair[1]):
            return f"token_rates entry {token!r}: {pair!r} must be [accepted, settled] counts of a token id"
    return None


def sibling_groups(parents: np.ndarray) -> np.ndarray:
    """int [n]: the same number for siblings (children of one node), numbered 0, 1, ... ."""
    return np.unique(np.asarray(parents, dtype=np.int64), return_inverse=True)[1].reshape(-1)


def whole_sibling_sets(parents: Sequence[int], nodes: np.ndarray) -> np.ndarray:
    """bool [len(nodes)]: whether every drafted child of the node's parent is among ``nodes``."""
    key = np.asarray(parents, dtype=np.int64) + 1  # ROOT (-1) -> 0
    drafted = np.bincount(key, minlength=len(key) + 1)
    present = np.bincount(key[nodes], minlength=len(key) + 1)
    return (present == drafted)[key[nodes]]


def exclusive(z: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """P(v accepted | parent accepted) = e^z_v / (1 + sum of e^z over v and its siblings): at most
    one child of a node is accepted, so siblings compete. ``group`` numbers the sibling groups
    (:func:`sibling_groups`); None: each node its own, which is the sigmoid of z."""
    _, e, total, _ = _group_sums(z, group)
    return e / total


def _group_sums(z: np.ndarray, group: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(m, e^(z - m), e^-m + the sum of e^(z - m) over the group), per node, where m is the
    group's largest z or 0 (the "none" outcome's score is e^0): overflow-free; and the groups
    (``group``, or each node its own where None)."""
    group = np.arange(len(z)) if group is None else group
    top = np.zeros(int(group.max(initial=-1)) + 1)
    np.maximum.at(top, group, z)
    e = np.exp(z - top[group])
    total = np.exp(-top) + np.bincount(group, weights=e, minlength=len(top))
    return top[group], e, total[group], group


def _log_partition(z: np.ndarray, group: np.ndarray | None) -> float:
    """The sum over groups of log(1 + sum of e^z in the group)."""
    top, _, total, group = _group_sums(z, group)
    first = np.unique(group, return_index=True)[1]  # one node stands for its group
    return float(np.sum(top[first] + np.log(total[first])))


def map_weights(x: np.ndarray, y: np.ndarray, w0: np.ndarray, prior: np.ndarray, steps: int,
                group: np.ndarray | None = None) -> np.ndarray:
    """argmin over w of 0.5 (w - w0)' prior (w - w0) + the negative log-likelihood of outcomes ``y``
    under :func:`exclusive` (``group`` numbers the sibling groups; None: the logistic loss): Newton
    steps from w0, each halved until the objective falls enough (Armijo). A full Newton step can
    overshoot and diverge where features nearly separate the outcomes (n-gram matches that are
    almost always accepted); the halving keeps every step a descent."""

    def objective(w: np.ndarray) -> float:
        z = x @ w
        return 0.5 * float((w - w0) @ prior @ (w - w0)) + _log_partition(z, group) - float(y @ z)

    w, value = w0.copy(), objective(w0)
    for _ in range(steps):
        gradient = prior @ (w - w0) + x.T @ (exclusive(x @ w, group) - y)
        step = np.linalg.solve(posterior_precision(x, w, prior, group), gradient)
        slope = float(gradient @ step)
        t = 1.0
        while t > 1e-6:
            candidate = w - t * step
            new_value = objective(candidate)
            if new_value <= value - 1e-4 * t * slope:
                break
            t *= 0.5
        else:
            break  # no descent left: converged to float precision
        w, value = candidate, new_value
        if np.max(np.abs(t * step)) < 1e-9:
            break
    return w


def posterior_precision(x: np.ndarray, w: np.ndarray, prior: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """The Hessian of the MAP objective at ``w``: ``prior`` plus the samples' curvature (the
    Laplace approximation's precision of the weights)."""
    _, e, total, group = _group_sums(x @ w, group)
    p = e / total  # exclusive(x @ w, group)
    mean = np.zeros((int(group.max(initial=-1)) + 1, x.shape[1]))
    np.add.at(mean, group, x * p[:, None])
    return prior + (x * p[:, None]).T @ x - mean.T @ mean


def initial_weights() -> np.ndarray:
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("log_share")] = 1.0
    return w


@dataclass
class LearnedAcceptanceConfig(AcceptanceConfig):
    name: str = "learned"
    # precision of the prior at w0 (a_v = P_v): observations needed before the data outweighs it
    prior_strength: float = 20.0
    forget: float = 0.995  # per observed tree, the evidence kept (1: never forget)
    recent_decay: float = 0.9  # per observed tree, for the recent acceptance rate
    newton_steps: int = 2  # per observed tree
    # the learned state: auto (this setup's, beside the calibration; kept as the engine learns) |
    # a file written by `specfit fit-acceptance` (loaded once; the engine's learning is not saved)
    state_file: str = "auto"

    def __post_init__(self) -> None:
        number("acceptance.prior_strength", self.prior_strength, minimum=1e-9)
        number("acceptance.forget", self.forget, minimum=0.5, maximum=1.0)
        number("acceptance.recent_decay", self.recent_decay, minimum=0.0, maximum=1.0)
        integer("acceptance.newton_steps", self.newton_steps, minimum=1)
        if not isinstance(self.state_file, str) or not self.state_file:
            raise ConfigError(f"acceptance.state_file={self.state_file!r} must be auto or a file path")


class LearnedAcceptance(AcceptanceEstimatorBase):
    """a_v = prod over v's path of P(u | parent of u): siblings compete in a multinomial logit (see the module docstring)."""

    name = "learned"
    Config = LearnedAcceptanceConfig

    def __init__(self, prior_strength: float = 20.0, forget: float = 0.995, recent_decay: float = 0.9,
                 newton_steps: int = 2, state_file: str = "auto") -> None:
        self.prior_strength, self.forget, self.recent_decay = prior_strength, forget, recent_decay
        self.newton_steps, self.state_file = newton_steps, state_file
        self.weights = initial_weights()
        self.precision = prior_strength * np.eye(len(FEATURES))
        self.recent = 0.5
        self.root_mean = 0.0  # running mean of logit(root_prob), decay recent_decay: the stand-in for unknown ones
        self.trees = 0  # trees learned from, this engine and earlier ones
        self.token_rates = TokenRates()
        # (tree, a_v so far, their features) within a cycle: observe reuses the features
        self._cache: tuple[DraftTree, np.ndarray, np.ndarray] | None = None

    def bind(self, spec: Any) -> None:
        """Load ``state_file`` when it names a file (``auto``: the setup's state is given by
        :mod:`specfit.calibrate.setup_state`, not read here)."""
        if self.state_file != "auto":
            self.load_state(load_state_file(self.state_file), strict=True)

    def conditional_estimate(self, tree: DraftTree) -> np.ndarray:
        """P(v accepted | its parent accepted) for every node."""
        z = features(tree, self.recent, self.root_logit(tree), token_rate=self.token_rates) @ self.weights
        return exclusive(z, sibling_groups(tree.parents))

    def root_logit(self, tree: DraftTree) -> float:
        """The ``root_prob`` feature of ``tree``: the logit of its root probability, or the running mean."""
        p = tree.root_prob
        return self.root_mean if p is None or not np.isfinite(p) else float(_logit(p))

    def estimate(self, tree: DraftTree) -> np.ndarray:
        """a_v = a_parent * P(v accepted | parent accepted). Within a cycle the model does not change
        and earlier levels keep their values, so each call computes only the levels added since the
        last call on the same tree."""
        cached, a, x = self._cache if self._cache is not None else (None, np.zeros(0), np.zeros((0, len(FEATURES))))
        if cached is not tree or len(a) > len(tree):
            a, x = np.zeros(0), np.zeros((0, len(FEATURES)))
        if len(a) < len(tree):
            start = len(a)
            parents = np.asarray(tree.parents[start:], dtype=np.int64)
            new_x = features(tree, self.recent, self.root_logit(tree), start, token_rate=self.token_rates)
            new = exclusive(new_x @ self.weights, sibling_groups(parents))
            a, x = np.concatenate([a, new]), np.concatenate([x, new_x])
            for d in range(tree.depths[start], tree.depth + 1):  # parents sit on the level above
                level = tree.level(d)
                p = parents[level.start - start:level.stop - start]
                a[level.start:level.stop] *= np.where(p == ROOT, 1.0, a[np.maximum(p, 0)])
        self._cache = (tree, a, x)
        return a.copy()

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        samples = self._samples(tree, verified, accepted)
        if samples is not None:
            self.update(*samples)

    def _samples(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The tree's conditional samples the weights learn from, as (x, y, sibling group), or None;
        the recent rate, the root mean and the token rates learn from them here (after their
        features were read). The model's denominator holds all drafted siblings, so the weights
        learn from whole sibling sets: a greedy pass settles every child of an accepted node; a
        sampled pass only the verified ones, and a set verified in part would teach the model that
        its unverified members do not compete."""
        nodes, hit = conditional(tree, verified, accepted)
        if not len(nodes):
            return None
        x = self._features(tree)[nodes]
        self._cache = None  # the state the features read changes now
        self._follow(tree, x, hit)
        self.token_rates.add([tree.tokens[v] for v in nodes], hit)
        whole = whole_sibling_sets(tree.parents, nodes)
        if not whole.any():
            return None
        return x[whole], hit[whole].astype(np.float64), sibling_groups(np.asarray(tree.parents)[nodes[whole]])

    def _features(self, tree: DraftTree) -> np.ndarray:
        """Every node's features: those :meth:`estimate` built for this tree in this cycle (the
        state they read changes only after the tree is observed), else computed now."""
        if self._cache is not None and self._cache[0] is tree and len(self._cache[2]) == len(tree):
            return self._cache[2]
        return features(tree, self.recent, self.root_logit(tree), token_rate=self.token_rates)

    def _follow(self, tree: DraftTree, x: np.ndarray, hit: np.ndarray) -> None:
        """After a tree's samples: the recent acceptance rate, and the running mean root probability."""
        decay = self.recent_decay
        top = x[:, FEATURES.index("top_sibling")] == 1
        if top.any():
            self.recent = decay * self.recent + (1 - decay) * float(hit[top].mean())
        if tree.root_prob is not None and np.isfinite(tree.root_prob):
            self.root_mean = decay * self.root_mean + (1 - decay) * float(_logit(tree.root_prob))

    def update(self, x: np.ndarray, y: np.ndarray, group: np.ndarray | None = None) -> None:
        """One Bayesian step: the MAP weights under a Gaussian prior at the current ones; ``group``
        numbers the samples' sibling groups (None: each sample its own)."""
        self._cache = None
        prior = self.forget * self.precision + (1 - self.forget) * self.prior_strength * np.eye(len(FEATURES))
        w = map_weights(x, y, self.weights, prior, self.newton_steps, group)
        self.weights, self.precision = w, posterior_precision(x, w, prior, group)
        self.trees += 1

    def fit_trees(self, trees: Any) -> int:
        """Offline: walk settled trees (:func:`specfit.trace.settled.trace_trees`) in
        order, collecting their conditional samples with the recent rate as it was at each, then
        :meth:`fit` them all at once. Returns the number of samples."""
        xs, ys, groups, offset = [], [], [], 0
        for item in trees:
            samples = self._samples(item.tree, item.verified, item.accepted)
            if samples is None:
                continue
            x, y, group = samples
            xs.append(x)
            ys.append(y)
            groups.append(offset + group)
            offset = int(groups[-1].max()) + 1
            self.trees += 1
        if not xs:
            return 0
        x, y = np.concatenate(xs), np.concatenate(ys)
        self.fit(x, y, group=np.concatenate(groups))
        return len(y)

    def fit(self, x: np.ndarray, y: np.ndarray, steps: int = 25, group: np.ndarray | None = None) -> None:
        """Offline: the MAP weights of all samples at once under the prior at w0 (Newton to convergence)."""
        prior = self.prior_strength * np.eye(len(FEATURES))
        w = map_weights(x, y, initial_weights(), prior, steps, group)
        self.weights, self.precision = w, posterior_precision(x, w, prior, group)
        self._cache = None

    def state(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "weights": self.weights.tolist(), "precision": self.precision.tolist(),
                "recent": self.recent, "root_mean": self.root_mean, "trees": self.trees,
                "token_rates": self.token_rates.state()}

    def load_state(self, state: dict[str, Any], strict: bool = False) -> None:
        """A state for other features (another version) or with bad values is ignored, and the
        model starts at w0; ``strict`` (a file the user named): a ConfigError instead."""
        problem = _state_problem(state)
        if problem:
            if strict:
                raise ConfigError(f"acceptance.state_file={self.state_file}: {problem}")
            return
        self.weights = np.asarray(state["weights"], dtype=np.float64)
        self.precision = np.asarray(state["precision"], dtype=np.float64)
        self.recent = float(state.get("recent", 0.5))
        self.root_mean = float(state.get("root_mean", 0.0))
        self._cache = None
        self.trees = int(state.get("trees", 0)) if isinstance(state.get("trees", 0), int) else 0
        self.token_rates = TokenRates()
        if "token_rates" in state:
            self.token_rates.load_state(state["token_rates"])


def _state_problem(state: Any) -> str | None:
    """Why ``state`` is not a learned model of these features, or None."""
    if not isinstance(state, dict) or state.get("features") != list(FEATURES):
        return f"not a learned acceptance model of the features {', '.join(FEATURES)}"
    try:
        weights = np.asarray(state.get("weights"), dtype=np.float64)
        precision = np.asarray(state.get("precision"), dtype=np.float64)
    except (TypeError, ValueError):
        return "weights and precision must be numbers"
    if weights.shape != (len(FEATURES),) or precision.shape != (len(FEATURES),) * 2:
        return f"weights must be {len(FEATURES)} numbers and precision {len(FEATURES)}x{len(FEATURES)}"
    if not (np.all(np.isfinite(weights)) and np.all(np.isfinite(precision))):
        return "weights and precision must be finite"
    recent = state.get("recent", 0.5)
    if isinstance(recent, bool) or not isinstance(recent, (int, float)) or not 0 <= recent <= 1:
        return f"recent={recent!r} must be a rate in [0, 1]"
    root_mean = state.get("root_mean", 0.0)
    if isinstance(root_mean, bool) or not isinstance(root_mean, (int, float)) or not np.isfinite(root_mean):
        return f"root_mean={root_mean!r} must be a finite number"
    if "token_rates" in state:
        return _token_rates_problem(state["token_rates"])
    return None


def load_state_file(path: str) -> dict[str, Any]:
    """The model a ``specfit fit-acceptance`` run wrote (its ``"state"`` object)."""
    from pathlib import Path

    from specfit.interfaces import read_json_object

    file = Path(path).expanduser()
    where = f"acceptance.state_file={path}"
    if file.is_dir():  # fit-acceptance's out_dir holds the file: name it
        raise ConfigError(f"{where}: is a directory, not a file (fit-acceptance writes learned.json in its out_dir: "
                          f"acceptance.state_file={file / 'learned.json'})")
    if not file.is_file():
        raise ConfigError(f"{where}: no such file (`specfit fit-acceptance trace.path=DIR` writes one)")
    data = read_json_object(file, where, ConfigError, "not a learned acceptance model")
    return data.get("state", data)
