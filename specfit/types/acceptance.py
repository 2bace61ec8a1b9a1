"""What every acceptance estimator shares: the outcomes it learns from and how it is scored.

Outcomes. After a greedy pass (``tree.greedy_next`` set) :func:`specfit.types.tree.greedy_outcomes`
settles most drafted nodes, verified or not; after a sampled pass only the verified nodes are
settled, by the acceptance rule's own outcome (accepted: on the committed path). :func:`settled`
gives the unconditional outcomes (is v on the accepted path?), :func:`conditional` the outcomes of
nodes whose parent was accepted (is v accepted, given its parent was?), the samples a model of
a_v / a_parent learns from.

Scores. An estimate a_v is a probability forecast of an outcome, so it is scored as one
(:class:`AcceptanceScore`): the Brier score (mean squared error, 0 is perfect, 0.25 is a coin's
forecast of a fair coin), the log loss (mean negative log-likelihood, clipped at 1e-6), and the
reliability table (mean forecast against the observed frequency, per forecast bin). Forecasts are
scored before the estimator learns from the same tree (prequential), as a live run uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from specfit.types.tree import ROOT, DraftTree, greedy_outcomes

EPS = 1e-6  # forecasts are clipped to [EPS, 1 - EPS] for the log loss
BINS = 10  # reliability bins over [0, 1]


def settled(tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, hit): every node whose acceptance the pass settled, and whether it was accepted.

    Greedy: every node :func:`greedy_outcomes` settles; sampling: the verified nodes."""
    if tree.greedy_next is not None:
        outcome = greedy_settled(tree, accepted)
        nodes = np.flatnonzero(outcome >= 0)
        return nodes, outcome[nodes] == 1
    nodes = np.asarray(verified, dtype=int)
    return nodes, np.isin(nodes, np.asarray(accepted, dtype=int))


def greedy_settled(tree: DraftTree, accepted: Sequence[int]) -> np.ndarray:
    """:func:`specfit.types.tree.greedy_outcomes`, one level at a time in numpy (the selectors score
    and learn after every cycle): 1 accepted, 0 rejected, -1 unknown."""
    if tree.greedy_next is None:
        return greedy_outcomes(tree, accepted)  # its error
    n = len(tree)
    tokens = np.asarray(tree.tokens, dtype=np.int64)
    parents = np.asarray(tree.parents, dtype=np.int64)
    path = np.asarray(list(accepted), dtype=np.int64)
    on_path = np.zeros(n + 1, dtype=bool)  # index n stands for the root
    on_path[path] = True
    on_path[n] = True
    after = np.full(n + 1, -1, dtype=np.int64)  # the target's argmax after each node of the path
    after[n] = tokens[path[0]] if len(path) else tree.greedy_next
    if len(path):
        after[path] = np.r_[tokens[path[1:]], tree.greedy_next]
    out = np.full(n + 1, -1, dtype=np.int8)
    for d in range(1, tree.depth + 1):
        level = tree.level(d)
        p = np.where(parents[level.start:level.stop] == ROOT, n, parents[level.start:level.stop])
        known = on_path[p]
        out[level.start:level.stop] = np.where(known, tokens[level.start:level.stop] == after[p],
                                               np.where(out[p] == 0, 0, -1))
    return out[:n]


def conditional(tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, hit) of the settled nodes whose parent is the root or accepted: the samples of
    P(v accepted | parent accepted)."""
    nodes, hit = settled(tree, verified, accepted)
    on_path = np.zeros(len(tree) + 1, dtype=bool)  # the last entry stands for the root
    on_path[np.asarray(list(accepted), dtype=int)] = True
    on_path[len(tree)] = True
    parents = np.asarray(tree.parents, dtype=int)[nodes] if len(nodes) else np.zeros(0, dtype=int)
    keep = on_path[np.where(parents == ROOT, len(tree), parents)]
    return nodes[keep], hit[keep]


@dataclass
class AcceptanceScore:
    """Brier score, log loss and reliability of acceptance forecasts, accumulated over trees."""

    estimator: str = ""
    nodes: int = 0
    squared: float = 0.0
    log_loss_sum: float = 0.0
    bin_forecast: list[float] = field(default_factory=lambda: [0.0] * BINS)
    bin_hits: list[float] = field(default_factory=lambda: [0.0] * BINS)
    bin_count: list[int] = field(default_factory=lambda: [0] * BINS)

    def add(self, forecast: np.ndarray, hit: np.ndarray) -> None:
        p = np.clip(np.asarray(forecast, dtype=np.float64), 0.0, 1.0)
        y = np.asarray(hit, dtype=np.float64)
        if not len(p):
            return
        self.nodes += len(p)
        self.squared += float(np.sum((p - y) ** 2))
        q = np.clip(p, EPS, 1 - EPS)
        self.log_loss_sum += float(-np.sum(y * np.log(q) + (1 - y) * np.log(1 - q)))
        b = np.minimum((p * BINS).astype(int), BINS - 1)
        for i in range(BINS):
            sel = b == i
            self.bin_forecast[i] += float(p[sel].sum())
            self.bin_hits[i] += float(y[sel].sum())
            self.bin_count[i] += int(sel.sum())

    @property
    def brier(self) -> float:
        return self.squared / self.nodes if self.nodes else 0.0

    @property
    def log_loss(self) -> float:
        return self.log_loss_sum / self.nodes if self.nodes else 0.0

    def reliability(self) -> list[list[float]]:
        """[mean forecast, observed frequency, count] per non-empty bin."""
        return [[f / n, h / n, n] for f, h, n in zip(self.bin_forecast, self.bin_hits, self.bin_count) if n]

    def as_dict(self) -> dict[str, Any]:
        """The keys results rows carry (``specfit report`` plots the reliability)."""
        return {"acceptance_estimator": self.estimator, "acceptance_brier": self.brier,
                "acceptance_log_loss": self.log_loss, "acceptance_nodes": self.nodes,
                "acceptance_reliability": self.reliability()}


# --------------------------------------------------------------------------- settled trees, scored


@dataclass
class SettledTree:
    """One position of a trace as a greedy pass that verified every recorded candidate left it."""

    tree: DraftTree  # greedy_next set
    verified: list[int]
    accepted: list[int]


def score(estimator: Any, trees: Sequence[SettledTree] | Iterator[SettledTree], learn: bool = True) -> AcceptanceScore:
    """The estimator's forecasts over ``trees``, each scored before it learns from that tree
    (``learn=False``: it does not learn, e.g. a model fitted offline on other traces)."""
    result = AcceptanceScore(estimator=str(getattr(estimator, "name", type(estimator).__name__)))
    for item in trees:
        forecast = np.asarray(estimator.estimate(item.tree), dtype=np.float64)
        nodes, hit = settled(item.tree, item.verified, item.accepted)
        result.add(forecast[nodes], hit)
        if learn:
            estimator.observe(item.tree, item.verified, item.accepted)
    return result
