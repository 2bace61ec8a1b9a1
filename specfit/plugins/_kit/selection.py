"""What cost-aware selectors share: the selection problem of a tree, acceptance estimates, and the
draft-stop rule. Each selector only decides how to pick a subtree from the problem.

Subclasses implement ``choose(problem, allowed) -> mask``; the exact search (``specfit``), a
marginal-ratio greedy (EcoSpec-style) and a best prefix by path probability (EVICT-style) differ
only there, so they are compared on equal terms.

The acceptance estimates a_v come from an acceptance estimator, a plug-in kind of its own
(``acceptance=path_prob|calibrated|learned``, :mod:`specfit.plugins.acceptance`); the selector
owns it, asks it for estimates and tells it each verification's outcome, and scores its forecasts
as it goes (``acceptance_score``). What the estimator and the draft gate learned persists per
setup (:mod:`specfit.calibrate.setup_state`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specfit.interfaces import (
    AcceptanceEstimator,
    AcceptanceScore,
    ConfigError,
    DraftTree,
    PluginError,
    SearchProblem,
    Selection,
    SelectionContext,
    SelectorBase,
    SelectorConfig,
    check_plugin_instance,
    evaluate,
    is_count,
    settled,
)


RETIME_EVERY = 32
"""While drafting wins, one cycle in this many (at most gate_max_backoff) is a plain pass that
re-times the alternative."""


class DraftGate:
    """The draft-stop rule at level 0: draft in a cycle only while drafting pays.

    Two decayed streams (recent cycles count most): drafted cycles, with the tokens they committed
    and their seconds, and plain passes (root only, no drafting), with their seconds. After each
    drafted cycle the gate compares tokens per second drafting with passes per second plain; while
    drafting loses, the cycles that follow skip drafting and verify the root alone (an
    autoregressive step), and the gate probes again after 1, 2, 4, ... skipped cycles, up to
    ``max_backoff``, but no longer than the probes' cost calls for: a losing probe gives up what
    plain passes would have committed in its time less what it committed (decayed means), and the
    gate skips just enough cycles between probes to keep that within ``probe_budget`` of the
    decode's tokens. A probe that barely loses is cheap and repeated soon; one that loses a whole
    pass waits 1 / probe_budget cycles. A winning drafted cycle halves the back-off rather than
    resetting it: one draft cycle's tokens vary a lot (1 to 8 on the demo pair), so a probe that
    wins by luck would otherwise restart the ladder 1, 2, 4, ... of losing probes. Measured on the
    demo pair (issue 15's live check, 8 GSM prompts x 3 on a calibrated setup, CPU): 60-72 drafted
    cycles with the reset, 12-32 with the halving. Drafting that keeps winning is back at back-off
    1 after log2(max_backoff) wins. Committed tokens are always the measured ones, so an
    overconfident acceptance estimate cannot keep a losing speculation going; seconds are
    measured or predicted (see :meth:`CostAwareSelector.observe_time`).
    """

    def __init__(self, max_backoff: int = 256, decay: float = 0.7, probe_budget: float = 0.01) -> None:
        if max_backoff < 1:
            raise ConfigError(f"selector.gate_max_backoff={max_backoff} must be >= 1")
        if not 0.0 < probe_budget <= 1.0:
            raise ConfigError(f"selector.gate_probe_budget={probe_budget} must be in (0, 1]")
        self.max_backoff, self.decay, self.probe_budget = max_backoff, decay, probe_budget
        self.spec_tokens = self.spec_seconds = self.spec_cycles = self.plain_passes = self.plain_seconds = 0.0
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
        self.spec_cycles = self.decay * self.spec_cycles + 1.0
        # cross-multiplied: tokens/s drafting >= passes/s plain (a cost model of zeros never gates)
        if self.spec_tokens * self.plain_seconds >= self.plain_passes * self.spec_seconds:
            # keep drafting, but earn the short back-off back one win at a time: a lucky probe
            # followed by a loss skips about as long as before it, instead of restarting at 1
            self.backoff, self.skip_left = max(self.backoff // 2, 1), 0
        else:
            self.skip_left = min(self.backoff, self._affordable_skip())
            self.backoff = min(2 * self.backoff, self.max_backoff)

    def _affordable_skip(self) -> int:
        """Skipped cycles per probe that keep the losing probes' cost within ``probe_budget``; a
        probe loses (its seconds x plain passes per second) - (its tokens), in tokens."""
        if self.plain_seconds <= 0.0:  # plain passes cost nothing: any probe loses all it spends
            return self.max_backoff
        loss = (self.spec_seconds * self.plain_passes / self.plain_seconds - self.spec_tokens) / self.spec_cycles
        return int(min(max(math.ceil(loss / self.probe_budget), 1), self.max_backoff))

    STATE = ("spec_tokens", "spec_seconds", "spec_cycles", "plain_passes", "plain_seconds", "backoff", "skip_left")

    def state(self) -> dict[str, float]:
        """The decayed streams and the back-off: a new engine of this setup starts where this one is."""
        return {k: getattr(self, k) for k in self.STATE}

    def load_state(self, state: dict[str, Any]) -> None:
        """Values that are not finite numbers >= 0 (a damaged file) leave the gate as it is."""
        values = {k: state.get(k) for k in self.STATE}
        if values["spec_cycles"] is None and isinstance(values["spec_tokens"], (int, float)):
            # saved before the gate counted its drafted cycles: each committed >= 1 token and the
            # decayed count stays below 1 / (1 - decay), so this is at least the true count (a
            # probe's loss per cycle may be underestimated: the first probes may come sooner)
            values["spec_cycles"] = max(min(float(values["spec_tokens"]), 1.0 / (1.0 - self.decay)), 1.0)
        if not all(is_count(v) for v in values.values()):
            return
        for k in ("spec_tokens", "spec_seconds", "spec_cycles", "plain_passes", "plain_seconds"):
            setattr(self, k, float(values[k]))
        self.backoff = int(min(max(values["backoff"], 1), self.max_backoff))
        self.skip_left = int(min(values["skip_left"], self.max_backoff))


STOP_RULES = ("method", "projected")


def builtin_estimator(name: str) -> AcceptanceEstimator:
    """The built-in acceptance estimator ``name`` with its default settings, for a selector built in
    code without an ``estimator=``; another (a third-party one) is passed in, or named in the
    config's ``acceptance`` group, which ``specfit.build`` resolves through the registry."""
    from specfit.plugins.acceptance.calibrated import CalibratedAcceptance
    from specfit.plugins.acceptance.learned import LearnedAcceptance
    from specfit.plugins.acceptance.oracle import OracleAcceptance
    from specfit.plugins.acceptance.path_prob import PathProbAcceptance

    builtins = {cls.name: cls for cls in (CalibratedAcceptance, LearnedAcceptance, OracleAcceptance, PathProbAcceptance)}
    if name not in builtins:
        raise ConfigError(f"selector.acceptance={name!r}: not a built-in estimator (built in: "
                          f"{', '.join(sorted(builtins))}); pass another as estimator=..., or name it "
                          "in the config's acceptance group")
    return builtins[name]()


@dataclass
class CostAwareSelectorConfig(SelectorConfig):
    """Settings shared by the cost-aware selectors (specfit, greedy, prefix)."""

    # the earlier spelling of the acceptance group: selector.acceptance=calibrated is acceptance=calibrated
    # (with that estimator's default settings); prefer acceptance=NAME, whose settings are acceptance.*
    acceptance: str = "path_prob"
    early_stop: bool = True  # the draft-stop rule; false drafts every level and selects at the end
    # which stop rule (docs/method.md 3.7): method: stop when the last level's net gain in rho is no
    # more than one more level would take away; projected: when the gain the next level is projected
    # to bring (the last level's gross gain, scaled by how its expected tokens compare with the
    # level before's) is no more than that
    stop_rule: str = "method"
    # D in T(S): the time the cycle has spent (measured) or the cost model's c_draft0 + c_level * depth
    # (modelled: decisions then depend on no clock, so a replay of a trace reproduces them exactly)
    draft_time: str = "measured"
    # skip drafting (verify the root alone) while drafted cycles commit fewer tokens per second than
    # plain passes would; probe again after up to gate_max_backoff skipped cycles, and no more often
    # than keeps the losing probes' cost within gate_probe_budget of the decode's tokens
    draft_gate: bool = True
    gate_max_backoff: int = 256
    gate_probe_budget: float = 0.01


class CostAwareSelector(SelectorBase):
    """Picks the subtree that maximises predicted throughput N/T by ``choose``, after each level."""

    name = "cost_aware"
    requires = ("cost_model", "predictor")  # the engine checks these are configured
    chooses_among_likeliest = True  # ``choose`` gets allowed = the ctx.max_nodes likeliest
    takes_estimator = True

    def __init__(self, acceptance: str = "path_prob", early_stop: bool = True, draft_time: str = "measured",
                 draft_gate: bool = True, gate_max_backoff: int = 256, gate_probe_budget: float = 0.01,
                 stop_rule: str = "method", estimator: AcceptanceEstimator | None = None) -> None:
        """``estimator``: the acceptance estimator to own (``specfit.build`` passes the one the
        config's ``acceptance`` group names); without one, the built-in estimator ``acceptance``
        names, with its default settings."""
        if draft_time not in ("measured", "modelled"):
            raise ConfigError(f"selector.draft_time={draft_time!r} must be measured or modelled")
        if stop_rule not in STOP_RULES:
            raise ConfigError(f"selector.stop_rule={stop_rule!r} must be one of {', '.join(STOP_RULES)}")
        self.acceptance, self.early_stop, self.draft_time = acceptance, early_stop, draft_time
        self.stop_rule = stop_rule
        if estimator is None:
            estimator = builtin_estimator(acceptance)
        check_plugin_instance("acceptance", estimator)
        self.estimator = estimator
        self.acceptance_score = AcceptanceScore(estimator=self.estimator.name)
        gate = DraftGate(gate_max_backoff, probe_budget=gate_probe_budget)  # checks the settings either way
        self.gate = gate if draft_gate else None
        self._drafted_since_plain = 0  # drafted cycles since a plain pass was last timed
        self._estimates: np.ndarray | None = None  # the last selection's a_v, scored once the outcome is known
        self._previous_value = self._plain_seconds = 0.0
        self._previous_mask = np.zeros(0, dtype=bool)  # the last level's selection (stop_rule=projected)
        self._previous_added = 1.0  # the expected tokens the last level's selection added
        self.rate_tracker = RateTracker()  # the decode's throughput so far: lambda of objective=rate
        self._last: tuple[float, float] | None = None  # (T(S*), C(root only) without drafting) of the last selection

    def bind(self, spec: Any) -> None:
        self.spec = spec
        self.estimator.bind(spec)
        self._warm_up()

    def _warm_up(self) -> None:
        """Solve one small problem now, so JIT compilation (or loading its cache) is paid when the
        engine is built, not by the first decoding cycle."""
        from specfit.interfaces import paper_scale_problem

        problem = paper_scale_problem(np.random.default_rng(0), n_nodes=8, layers=2, experts=8, top_k=2)
        self.choose(problem, np.ones(problem.n_nodes, dtype=bool))

    def choose(self, problem: SearchProblem, allowed: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def surplus_rate(self) -> float | None:
        """lambda when ``choose`` maximises the surplus N - lambda * T (the draft-stop rule then
        compares surpluses too); None: it maximises the ratio N / T."""
        return None

    def accept_estimates(self, tree: DraftTree) -> np.ndarray:
        """a_v of every node, from the estimator; a wrong shape or a value outside [0, 1] names it."""
        estimates = np.asarray(self.estimator.estimate(tree), dtype=np.float64)
        if estimates.shape != (len(tree),) or not np.all((estimates >= 0) & (estimates <= 1)):
            shown = f"values in [{np.nanmin(estimates):.3g}, {np.nanmax(estimates):.3g}]" if estimates.size else "nothing"
            raise PluginError(f"acceptance '{self.estimator.name}' (estimate) returned {estimates.shape} {shown}; "
                              f"expected {len(tree)} probabilities in [0, 1]")
        self._estimates = estimates
        return estimates

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        cost_model = ctx.cost_model
        if cost_model is None:
            raise ConfigError(f"selector={self.name} needs a cost model that builds selection problems: set cost_model=union")
        spent = ctx.draft_seconds
        if self.draft_time == "modelled":
            c = cost_model.constants
            spent = c.c_draft0 + c.c_level * tree.depth
        # ctx.arriving: experts in flight (issue 14); None: not pipelined
        problem = cost_model.problem(tree, self.accept_estimates(tree), ctx.resident, spent, arriving=ctx.arriving)
        allowed = np.zeros(len(tree), dtype=bool)
        allowed[tree.top_by_path_prob(ctx.max_nodes)] = True
        rate = self.surplus_rate()
        mask = self.choose(problem, allowed)
        n_expected, seconds, rho = evaluate(problem, mask)
        value = _objective(rate)
        depth = tree.depth
        if depth == 1:  # the root alone: the value to beat, and a plain pass's seconds (the same at every level)
            n_root, root_only, _ = evaluate(problem, np.zeros(len(tree), dtype=bool))
            self._previous_value = value(n_root, root_only)
            self._plain_seconds = root_only - problem.draft_time
        stop = depth >= ctx.max_depth
        current = value(n_expected, seconds)
        if depth == 1:
            self._previous_mask, self._previous_added = np.zeros(0, dtype=bool), 1.0  # the root's own token
        if self.early_stop and not stop:
            uses_newest = bool(mask[list(tree.level(depth))].any())
            loss_of_one_more_level = current - value(n_expected, seconds + cost_model.constants.c_level)
            gain = (current - self._previous_value if self.stop_rule == "method"
                    else self._projected_gain(problem, mask, value, n_expected, current))
            stop = not uses_newest or gain <= loss_of_one_more_level
        self._previous_value, self._previous_mask = current, mask
        self._last = (seconds, self._plain_seconds)
        return Selection(nodes=np.flatnonzero(mask).tolist(), stop=stop,
                         predicted={"rho": rho, "expected_tokens": n_expected, "seconds": seconds})

    def _projected_gain(self, problem: SearchProblem, mask: np.ndarray, value: Any, n_expected: float,
                        current: float) -> float:
        """What the next level is projected to add to the objective before its own time: this level's
        gross gain (over keeping the last level's selection, at the draft time spent now) times the
        ratio of the expected tokens this level added to those the level before added (1 for the
        root's own token), at most 1: acceptance only falls with depth."""
        stay = np.zeros(len(mask), dtype=bool)
        stay[: len(self._previous_mask)] = self._previous_mask
        n_stay, t_stay, _ = evaluate(problem, stay)
        added = max(n_expected - n_stay, 0.0)
        trend = min(added / self._previous_added, 1.0) if self._previous_added > 0.0 else 0.0
        self._previous_added = added
        return trend * max(current - value(n_stay, t_stay), 0.0)

    def should_draft(self) -> bool:
        """Asked by the decode loop before a cycle drafts; False: verify the root alone."""
        return self.gate is None or self.gate.should_draft()

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """Score the last selection's estimates against the settled outcomes, then let the
        estimator learn from them."""
        estimates, self._estimates = self._estimates, None
        if not len(tree):
            return
        if estimates is not None and len(estimates) == len(tree):
            nodes, hit = settled(tree, verified, accepted)
            self.acceptance_score.add(estimates[nodes], hit)
        self.estimator.observe(tree, verified, accepted)

    def observe_time(self, drafted: bool, committed: int, seconds: float) -> None:
        """A finished cycle, for the draft gate: whether it drafted, the tokens it committed and the
        seconds it took (measured live; the cost model's charge in a trace replay).

        With ``draft_time=modelled`` the gate uses the cost model's predictions instead of
        ``seconds`` (decisions then depend on no clock). Otherwise plain passes are timed when the
        gate skips drafting; until one has been, the cost model's C(root only) stands in."""
        predicted, self._last = self._last, None
        if self.draft_time == "measured":
            self.rate_tracker.add(committed, seconds)
        elif drafted and predicted is not None:  # no clock: the predicted T(S*) ...
            self.rate_tracker.add(committed, predicted[0])
        elif not drafted:  # ... or the predicted plain pass (nothing before the first selection: 0.0)
            self.rate_tracker.add(committed, self._plain_seconds)
        if self.gate is None:
            return
        if not drafted:
            if self.draft_time == "measured":
                self.gate.plain(seconds)
                self._drafted_since_plain = 0
            return
        if predicted is None:  # drafted, but no selection was made (cannot happen in the decode loop)
            return
        predicted_seconds, predicted_plain = predicted
        if self.draft_time == "modelled" or self.gate.plain_passes == 0.0:
            self.gate.plain(predicted_plain)
        self.gate.speculated(committed, predicted_seconds if self.draft_time == "modelled" else seconds)
        if self.draft_time == "measured":
            # A plain pass timed long ago (under other load, or in an earlier run: the gate's state
            # persists per setup) must not decide for ever: while drafting wins, one cycle in
            # min(gate_max_backoff, RETIME_EVERY) verifies the root alone and re-times the alternative.
            self._drafted_since_plain += 1
            if self._drafted_since_plain >= min(self.gate.max_backoff, RETIME_EVERY) and self.gate.skip_left == 0:
                self.gate.skip_left = 1
                self._drafted_since_plain = 0


class RateTracker:
    """A decode's throughput in committed tokens per second, over recent cycles (decayed sums):
    the lambda at which ``selector.objective=rate`` maximises N - lambda * T."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay, self.tokens, self.seconds = decay, 0.0, 0.0

    def add(self, committed: int, seconds: float) -> None:
        if seconds > 0.0 and np.isfinite(seconds):
            self.tokens = self.decay * self.tokens + committed
            self.seconds = self.decay * self.seconds + seconds

    @property
    def rate(self) -> float | None:
        """Tokens per second, or None before a cycle with a positive time was seen."""
        return self.tokens / self.seconds if self.seconds > 0.0 and self.tokens > 0.0 else None


def _objective(rate: float | None) -> Any:
    """value(N, T) of the selector's objective: the ratio N / T, or the surplus N - rate * T."""
    if rate is None:
        return lambda n, t: n / t
    return lambda n, t: n - rate * t
