"""What cost-aware selectors share: the selection problem of a tree, acceptance estimates, and the
draft-stop rule. Each selector only decides how to pick a subtree from the problem.

Subclasses implement ``choose(problem, allowed) -> mask``; the exact search (``specfit``), a
marginal-ratio greedy (EcoSpec-style) and a best prefix by path probability (EVICT-style) differ
only there, so they are compared on equal terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.core.search import SearchProblem, evaluate
from specfit.core.tree import DraftTree, greedy_outcomes
from specfit.errors import ConfigError
from specfit.interfaces import Selection, SelectionContext, SelectorBase, SelectorConfig


class CalibratedAcceptance:
    """a_v = f(P_v, d(v)) from observed acceptances: binned by depth and log path probability,
    shrunk towards P_v while a bin has few observations."""

    def __init__(self, prior_weight: float = 8.0, bins_per_decade: int = 4, max_depth: int = 16) -> None:
        self.prior_weight, self.per_decade = prior_weight, bins_per_decade
        shape = (max_depth + 1, 12 * bins_per_decade + 1)
        self.accepted = np.zeros(shape)
        self.seen = np.zeros(shape)

    def _bins(self, tree: DraftTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        depth = np.minimum(np.asarray(tree.depths)[nodes], self.seen.shape[0] - 1)
        logp = np.asarray(tree.path_log_probs)[nodes] / np.log(10)
        b = np.clip((-logp * self.per_decade).astype(int), 0, self.seen.shape[1] - 1)
        return depth, b

    def estimate(self, tree: DraftTree) -> np.ndarray:
        nodes = np.arange(len(tree))
        d, b = self._bins(tree, nodes)
        return (self.accepted[d, b] + self.prior_weight * tree.path_probs()) / (self.seen[d, b] + self.prior_weight)

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """Learn from the verified nodes, or, after a greedy pass (``tree.greedy_next`` set), from
        every drafted node whose outcome the pass settled (:func:`greedy_outcomes`)."""
        if tree.greedy_next is not None:
            outcome = greedy_outcomes(tree, accepted)
            nodes = np.flatnonzero(outcome >= 0)
            hit = outcome[nodes] == 1
        else:
            nodes = np.asarray(verified, dtype=int)
            hit = np.isin(nodes, np.asarray(accepted, dtype=int))
        if not len(nodes):
            return
        d, b = self._bins(tree, nodes)
        np.add.at(self.seen, (d, b), 1.0)
        np.add.at(self.accepted, (d[hit], b[hit]), 1.0)


class DraftGate:
    """The draft-stop rule at level 0: draft in a cycle only while drafting pays.

    Two decayed streams (recent cycles count most): drafted cycles, with the tokens they committed
    and their seconds, and plain passes (root only, no drafting), with their seconds. After each
    drafted cycle the gate compares tokens per second drafting with passes per second plain; while
    drafting loses, the cycles that follow skip drafting and verify the root alone (an
    autoregressive step), and the gate probes again after 1, 2, 4, ... ``max_backoff`` skipped
    cycles. Committed tokens are always the measured ones, so an overconfident acceptance
    estimate cannot keep a losing speculation going; seconds are measured or predicted (see
    :meth:`CostAwareSelector.observe_time`).
    """

    def __init__(self, max_backoff: int = 32, decay: float = 0.7) -> None:
        if max_backoff < 1:
            raise ConfigError(f"selector.gate_max_backoff={max_backoff} must be >= 1")
        self.max_backoff, self.decay = max_backoff, decay
        self.spec_tokens = self.spec_seconds = self.plain_passes = self.plain_seconds = 0.0
        self.backoff, self.skip_left = 1, 0

    def should_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def plain(self, seconds: float) -> None:
        """A plain pass took (or would take) ``seconds``."""
        self.plain_passes = self.decay * self.plain_passes + 1.0
        self.plain_seconds = self.decay * self.plain_seconds + seconds

    def speculated(self, committed: int, seconds: float) -> None:
        """A drafted cycle committed ``committed`` tokens in ``seconds``; decide the next cycles."""
        self.spec_tokens = self.decay * self.spec_tokens + committed
        self.spec_seconds = self.decay * self.spec_seconds + seconds
        # cross-multiplied: tokens/s drafting >= passes/s plain (a cost model of zeros never gates)
        if self.spec_tokens * self.plain_seconds >= self.plain_passes * self.spec_seconds:
            self.backoff, self.skip_left = 1, 0
        else:
            self.skip_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)


@dataclass
class CostAwareSelectorConfig(SelectorConfig):
    """Settings shared by the cost-aware selectors (specfit, greedy, prefix)."""

    acceptance: str = "path_prob"  # path_prob (a_v = P_v) | calibrated (a_v = f(P_v, depth), learned online)
    early_stop: bool = True  # the draft-stop rule; false drafts every level and selects at the end
    # D in T(S): the time the cycle has spent (measured) or the cost model's c_draft0 + c_level * depth
    # (modelled: decisions then depend on no clock, so a replay of a trace reproduces them exactly)
    draft_time: str = "measured"
    # skip drafting (verify the root alone) while drafted cycles commit fewer tokens per second than
    # plain passes would; probe again after up to gate_max_backoff skipped cycles
    draft_gate: bool = True
    gate_max_backoff: int = 32


class CostAwareSelector(SelectorBase):
    """Picks the subtree that maximises predicted throughput N/T by ``choose``, after each level."""

    name = "cost_aware"
    requires = ("cost_model", "predictor")  # the engine checks these are configured

    def __init__(self, acceptance: str = "path_prob", early_stop: bool = True, draft_time: str = "measured",
                 draft_gate: bool = True, gate_max_backoff: int = 32) -> None:
        if acceptance not in ("path_prob", "calibrated"):
            raise ConfigError(f"selector.acceptance={acceptance!r} must be path_prob or calibrated")
        if draft_time not in ("measured", "modelled"):
            raise ConfigError(f"selector.draft_time={draft_time!r} must be measured or modelled")
        self.acceptance, self.early_stop, self.draft_time = acceptance, early_stop, draft_time
        self.calibrator = CalibratedAcceptance() if acceptance == "calibrated" else None
        self.gate = DraftGate(gate_max_backoff) if draft_gate else None
        self._previous_rho = self._plain_seconds = 0.0
        self._last: tuple[float, float] | None = None  # (T(S*), C(root only) without drafting) of the last selection

    def bind(self, spec: Any) -> None:
        self.spec = spec
        self._warm_up()

    def _warm_up(self) -> None:
        """Solve one small problem now, so JIT compilation (or loading its cache) is paid when the
        engine is built, not by the first decoding cycle."""
        from specfit.core.search.synthetic import paper_scale_problem

        problem = paper_scale_problem(np.random.default_rng(0), n_nodes=8, layers=2, experts=8, top_k=2)
        self.choose(problem, np.ones(problem.n_nodes, dtype=bool))

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def accept_estimates(self, tree: DraftTree) -> np.ndarray:
        return self.calibrator.estimate(tree) if self.calibrator is not None else tree.path_probs()

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        cost_model = ctx.cost_model
        if cost_model is None or not hasattr(cost_model, "problem"):
            raise ConfigError(f"selector={self.name} needs a cost model that builds selection problems: set cost_model=union")
        spent = ctx.draft_seconds
        if self.draft_time == "modelled":
            c = cost_model.constants
            spent = c.c_draft0 + c.c_level * tree.depth
        problem = cost_model.problem(tree, self.accept_estimates(tree), ctx.resident, spent)
        allowed = np.zeros(len(tree), dtype=bool)
        allowed[tree.top_by_path_prob(ctx.max_nodes)] = True
        mask = self.choose(problem, allowed)
        n_expected, seconds, rho = evaluate(problem, mask)
        depth = tree.depth
        if depth == 1:  # the root alone: the rho to beat, and a plain pass's seconds (the same at every level)
            _, root_only, self._previous_rho = evaluate(problem, np.zeros(len(tree), dtype=bool))
            self._plain_seconds = root_only - problem.draft_time
        stop = depth >= ctx.max_depth
        if self.early_stop and not stop:
            uses_newest = bool(mask[list(tree.level(depth))].any())
            loss_of_one_more_level = rho - n_expected / (seconds + cost_model.constants.c_level)
            stop = not uses_newest or (rho - self._previous_rho) <= loss_of_one_more_level
        self._previous_rho = rho
        self._last = (seconds, self._plain_seconds)
        return Selection(nodes=np.flatnonzero(mask).tolist(), stop=stop,
                         predicted={"rho": rho, "expected_tokens": n_expected, "seconds": seconds})

    def should_draft(self) -> bool:
        """Asked by the decode loop before a cycle drafts; False: verify the root alone."""
        return self.gate is None or self.gate.should_draft()

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        if self.calibrator is not None:
            self.calibrator.observe(tree, verified, accepted)

    def observe_time(self, drafted: bool, committed: int, seconds: float) -> None:
        """A finished cycle, for the draft gate: whether it drafted, the tokens it committed and the
        seconds it took (measured live; the cost model's charge in a trace replay).

        With ``draft_time=modelled`` the gate uses the cost model's predictions instead of
        ``seconds`` (decisions then depend on no clock). Otherwise plain passes are timed when the
        gate skips drafting; until one has been, the cost model's C(root only) stands in."""
        if self.gate is None:
            return
        predicted, self._last = self._last, None
        if not drafted:
            if self.draft_time == "measured":
                self.gate.plain(seconds)
            return
        if predicted is None:  # drafted, but no selection was made (cannot happen in the decode loop)
            return
        predicted_seconds, predicted_plain = predicted
        if self.draft_time == "modelled" or self.gate.plain_passes == 0.0:
            self.gate.plain(predicted_plain)
        self.gate.speculated(committed, predicted_seconds if self.draft_time == "modelled" else seconds)
