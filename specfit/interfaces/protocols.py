"""The contracts of specfit's pluggable parts, one Protocol per kind.

Each Protocol lists every method and attribute the core (the engine, the trace replay, the
calibration and ``specfit.build``) uses of that kind; the registry refuses a class that lacks one,
naming it. The base classes in :mod:`specfit.interfaces.bases` implement the optional hooks as
documented no-ops, so a plug-in that subclasses its kind's base writes only what it needs.

A plugin class also provides ``name`` (its registry and config-group name) and ``Config`` (a
dataclass subclassing its kind's base config in :mod:`specfit.interfaces.configs`); the registry
passes every field of the config to its constructor. Objects built in code are used as they are,
after the same member check.

Lifecycle: the engine calls ``bind`` once with the target's shape before the first generation,
then the per-cycle methods. All of this runs on the host; tensors stay on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from specfit.interfaces.exchange import Admission, Selection, SelectionContext
from specfit.types.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from specfit.types.costs import CostConstants
    from specfit.types.moe import MoESpec
    from specfit.search import SearchProblem


@runtime_checkable
class ExpertCache(Protocol):
    """Residency policy: which experts of each MoE layer stay in device slots between passes.

    The offload runtime owns the slots and the copies; the policy only decides. Within one pass
    a layer asks ``admit`` repeatedly with the experts it still has to compute until all are done,
    so a policy may admit fewer experts than asked (when the union exceeds its slots) but at
    least one, and must never evict an expert it admitted in the same round.
    Optional (defaults in ``ExpertCacheBase``): ``preload``, ``begin_pass``, ``can_prefetch``
    (False) and ``admit_prefetch``.

    ``admit_prefetch(layer, candidates: list[int], protected: frozenset[int]) -> Admission`` admits
    some of ``candidates`` (experts of ``layer`` in no slot, best first) to be copied ahead of need;
    ``slots`` and ``loads`` list the same (expert, slot) pairs. It is told this is a prefetch, so it
    may rank them differently (LRU puts them at the most-recently-used end); it must never evict an
    expert in ``protected`` (in flight, or needed by the layer now computing) and should drop a
    candidate rather than do so. The runtime checks this. A cache that admits prefetches says so
    with ``can_prefetch = True``; ``ExpertCacheBase``'s defaults admit nothing and say False.
    """

    name: ClassVar[str]
    # True when admit_prefetch admits anything: prefetchers then copy ahead through it
    can_prefetch: ClassVar[bool]

    def admit_prefetch(self, layer: int, candidates: list[int], protected: frozenset[int]) -> Admission:
        """Some of ``candidates`` to copy ahead of need (see above)."""

    def bind(self, spec: MoESpec) -> int:
        """Prepare for a model; return the number of device slots per layer to allocate."""

    def preload(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) copies to make once before the first pass (not counted as misses)."""

    def begin_pass(self) -> None:
        """A new forward pass of the target starts."""

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        """Admit some of ``wanted`` (distinct expert ids, ascending) for computation now."""

    def resident(self) -> np.ndarray:
        """bool [layers, experts]: experts resident now (the R_l of the cost model)."""


# --------------------------------------------------------------------------- drafting


@runtime_checkable
class Drafter(Protocol):
    """Proposes a draft tree after the last committed token, one level per step.

    ``depth`` bounds the tree's levels; ``total_tokens`` bounds the nodes a cycle may verify (EAGLE's
    reranking keeps the ``total_tokens`` nodes of highest path probability). Both are read every
    cycle (instance attributes, ints >= 0). Optional (defaults in ``DrafterBase``): ``bind``,
    ``feature_layers`` (none), ``start``, ``commit``, and the settings the setup's fingerprint
    (:func:`specfit.calibrate.fingerprint.setup_fingerprint`, which names the stored calibration and
    the selector's learned state) records: ``path`` (None), ``top_k`` (None), ``probe_left_unused``
    (False).
    """

    name: ClassVar[str]
    depth: int
    total_tokens: int
    # the directory of the drafter's weights (an EAGLE-3 head), whose weight files' digest enters the
    # fingerprint; None: it has none ("random": a random head, no files)
    path: str | None
    # the beam width (EAGLE-3's top_k) where the drafter has one; None: it has none
    top_k: int | None
    # True when the weights' directory holds an acceptance probe the drafter does not use (its
    # acceptance differs: another setup for the state stored per setup)
    probe_left_unused: bool

    def bind(self, target: Any) -> None:
        """Attach to the target (:class:`specfit.model.target.Target`): shapes, embeddings."""

    def feature_layers(self) -> Sequence[int]:
        """Hidden-state indices (HF ``hidden_states`` numbering) the drafter needs from the target."""

    def start(self, prompt_ids: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        """A new sequence: the prompt, the target's features at its positions, and the first
        generated token (the root of the first draft tree)."""

    def draft(self, tree: DraftTree) -> Iterator[range]:
        """Grow ``tree`` one level per iteration (``tree.add_level``), yielding each new level's node
        range; the engine may stop after any level (closing the generator)."""

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        """The target verified and kept ``tokens`` (the root, then the accepted path; ``features``
        are the target's at their positions) and produced ``next_token``, the next root."""


@runtime_checkable
class Selector(Protocol):
    """Chooses the subtree to verify; ``select`` is called after every draft level.

    Optional (defaults in ``SelectorBase``): ``requires`` (none), ``chooses_among_likeliest``
    (False), ``takes_estimator`` (False) and ``estimator`` (None), ``draft_time`` (None), ``gate``
    (None), ``acceptance_score`` (None), ``bind``, ``should_draft`` (always), ``observe``,
    ``observe_time``.
    """

    name: ClassVar[str]
    # the other parts this selector needs configured, among "cost_model" and "predictor"; the engine
    # and the replay refuse to run without them
    requires: ClassVar[Sequence[str]]
    # True when it only ever chooses among the tree's ``ctx.max_nodes`` likeliest nodes by path
    # probability (``tree.top_by_path_prob``), so experts are predicted for those alone (checked
    # after each ``select``)
    chooses_among_likeliest: ClassVar[bool]
    # True when its constructor takes ``estimator=`` (an AcceptanceEstimator): ``specfit.build`` then
    # builds the one the config's ``acceptance`` group names and passes it in
    takes_estimator: ClassVar[bool]
    # the acceptance estimator it owns (None: it uses none); the engine binds it to the target
    estimator: AcceptanceEstimator | None
    # how it counts D, the draft time spent: "measured" (the clock) or "modelled" (the cost model's
    # c_draft0 + c_level * depth); None: it reads no draft time. What a selector with an estimator
    # learned is kept per setup (specfit.calibrate.setup_state) only under "measured"
    draft_time: str | None
    # its draft gate, whose state is kept per setup with the estimator's: an object with
    # ``state() -> dict`` and ``load_state(dict)`` (specfit.plugins._kit.selection.DraftGate); None: none
    gate: Any
    # how well its estimator's a_v forecast the settled outcomes so far
    # (:class:`specfit.types.acceptance.AcceptanceScore`), reported by a trace replay; None: not scored
    acceptance_score: Any

    def bind(self, spec: MoESpec) -> None:
        """Prepare for a model (``spec``: layers, experts, top-k)."""

    def should_draft(self) -> bool:
        """Asked before each cycle drafts; False verifies the root alone (a plain autoregressive
        step), e.g. while speculation does not pay. Must return a bool."""

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        """The nodes to verify so far, and whether to stop drafting."""

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """After verification: the nodes verified and those accepted (for learned acceptance)."""

    def observe_time(self, drafted: bool, committed: int, seconds: float) -> None:
        """After each cycle: whether it drafted, the tokens it committed and its seconds (measured
        live; in a trace replay, the seconds the cost model charged)."""


# --------------------------------------------------------------------------- acceptance estimators


@runtime_checkable
class AcceptanceEstimator(Protocol):
    """Estimates a_v, the probability that the target accepts drafted node v, for the cost-aware
    selectors' N(S) = sum of a_v (docs/method.md section 3).

    The selector that owns it calls ``estimate`` after each draft level and ``observe`` after each
    verification; ``state`` / ``load_state`` carry what it learned from one engine to the next of
    the same setup (stored beside the calibration). Optional (defaults in
    ``AcceptanceEstimatorBase``): ``state_file`` (``"auto"``), ``bind``, ``bind_target`` (nothing),
    ``observe``, ``state`` (nothing to keep), ``load_state``.
    """

    name: ClassVar[str]
    # where its state comes from: "auto", the setup's stored state (specfit.build loads it and saves
    # what it learns); a file the user named (``acceptance.state_file=FILE``), which it reads itself
    # and which is never overwritten
    state_file: str

    def bind(self, spec: MoESpec) -> None:
        """Prepare for a model (``spec``: layers, experts, top-k)."""

    def bind_target(self, target: Any) -> None:
        """Called once the engine's or the replay's target exists, for an estimator that reads it
        (the built-in ``oracle`` reads a replay's recorded outcomes)."""

    def estimate(self, tree: DraftTree) -> np.ndarray:
        """float [len(tree)]: a_v in [0, 1] for every drafted node, known before verification."""

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """After verification: the nodes verified and those accepted; after a greedy pass
        ``tree.greedy_next`` is set and :func:`specfit.types.tree.greedy_outcomes` settles most
        unverified nodes too."""

    def state(self) -> dict[str, Any] | None:
        """What to keep for the next engine of this setup (JSON-able), or None."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Start from what an earlier engine of this setup kept (``state()``'s value)."""


# --------------------------------------------------------------------------- cost models


@runtime_checkable
class CostModel(Protocol):
    """Predicts the seconds of a cycle: constants (:class:`specfit.types.costs.CostConstants`)
    measured by ``specfit calibrate`` and a selection problem built from them.

    ``specfit.build`` loads or measures the constants of an uncalibrated model (``calibrated`` false)
    from ``calibration`` (``"auto"``: the stored calibration of this setup) and hands them to
    ``set_constants``, the one hook through which a part is changed after it is built (a replay
    does the same with its trace's or profile's constants); the trace replay charges each cycle
    ``constants.cycle_seconds(...)``; the cost-aware selectors call ``problem``. Optional (defaults
    in ``CostModelBase``): all but ``problem``, which the default refuses with a message naming the
    model.
    """

    name: ClassVar[str]
    calibration: str | None  # "auto" | a calibration file | None (the constants come from elsewhere)

    def bind(self, spec: MoESpec) -> None:
        """Prepare for a model (``spec``: layers, experts, top-k)."""

    @property
    def calibrated(self) -> bool:
        """The constants are known (set, loaded or given in the config)."""

    @property
    def constants(self) -> CostConstants:
        """The constants in use; raises :class:`specfit.errors.ConfigError` while uncalibrated."""

    def set_constants(self, constants: CostConstants) -> None:
        """Use ``constants`` from now on (measured, or loaded from a calibration file)."""

    def problem(self, tree: DraftTree, accept: np.ndarray, resident: np.ndarray,
                draft_seconds: float, arriving: np.ndarray | None = None) -> SearchProblem:
        """The selection instance of ``tree``: ``accept`` holds each node's acceptance estimate,
        ``resident`` the cache's residency, ``draft_seconds`` the time already spent (D),
        ``arriving`` the seconds until each expert is usable (:attr:`SelectionContext.arriving`:
        experts in flight; None where nothing is known), always passed: a model that does not
        price copies in flight ignores it."""

    def observe(self, record: Any) -> None:
        """A measured cycle (:class:`specfit.types.stats.CycleRecord`), for online calibration."""


# --------------------------------------------------------------------------- expert predictors


@runtime_checkable
class ExpertPredictor(Protocol):
    """Predicts, before verification, the experts each draft node will activate in each layer.

    Optional (defaults in ``ExpertPredictorBase``): ``bind``, ``observe``.
    """

    name: ClassVar[str]

    def bind(self, target: Any) -> None:
        """Attach to the target (:class:`specfit.model.target.Target`; ``target.runtime.spec``)."""

    def predict(self, tree: DraftTree, nodes: Sequence[int]) -> None:
        """Fill ``tree.experts`` for ``nodes``, node ids of the newest level in ascending order: all of
        them, or where the selector chooses among the tree's likeliest nodes
        (``chooses_among_likeliest``) those among them, possibly none
        (``tree.expert_rows(layers, top_k)`` grows it to every node, new rows -1) and,
        on the first call of a cycle, ``tree.root_experts``. Optionally also how likely each expert
        is, ``tree.expert_probs`` (``tree.expert_prob_rows(layers, experts)``) and
        ``tree.root_expert_probs``: the draft prefetcher then weighs each copy by it."""

    def observe(self, tokens: Sequence[int], routing: np.ndarray) -> None:
        """Actual routing of the prompt (after prefill) and of verified tokens: int [tokens, layers, top_k]."""


# --------------------------------------------------------------------------- prefetchers


@runtime_checkable
class PrefetchSink(Protocol):
    """What a prefetcher's ``bind`` receives: the one way it issues expert copies. The runtime's sink
    (live) and the trace replay's (a modelled link) both check every request before anything
    moves; a layer or expert out of range is a PluginError naming the prefetcher and its hook."""

    live: bool  # False in a trace replay (no target passes to hook into)

    def prefetch(self, layer: int, experts: Sequence[int], keep: Sequence[int] = ()) -> int:
        """Ask for ``experts`` of ``layer`` (most wanted first); returns the copies issued. ``keep``:
        experts worth keeping but not worth a copy: those resident are protected from this
        request's evictions."""

    def arriving(self) -> np.ndarray | None:
        """float [layers, experts]: seconds until each expert is usable (0 resident, inf absent); None: unknown."""

    def expert_seconds(self) -> float:
        """Link seconds of one expert copy (0.0: unknown)."""

    def prefetches_used(self) -> int:
        """Prefetched experts that a pass computed with, so far."""

    def saved_per_use(self) -> float:
        """At most the seconds a used prefetch takes off the passes' critical path (0.0: unknown)."""

    def capacity(self) -> int:
        """Device slots per layer."""

    def layer_seconds(self, tokens: int) -> float:
        """Compute seconds of one MoE layer in a pass of ``tokens`` tokens (0.0: unknown)."""

    def link_free_in(self) -> float:
        """Seconds until the link has delivered everything queued (0.0 idle or unknown)."""

    def now(self) -> float:
        """The sink's clock (live: wall time; replay: the modelled time of the cycle)."""

    def note(self, message: str) -> None:
        """A one-time remark for the run's output."""

    def run(self, hook: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` as the prefetcher's ``hook``: its requests and errors name that hook."""


@runtime_checkable
class Prefetcher(Protocol):
    """Issues expert copies ahead of need, so transfers overlap drafting and compute.

    ``bind`` hands it the target and a :class:`PrefetchSink`; it prefetches
    only through ``sink.prefetch(layer, experts)`` (checked: a layer or expert out of range is a
    PluginError naming the prefetcher), from ``after_level`` during drafting or from hooks it sets
    on the target's layers in ``bind`` (live runs only). The cache policy decides what is admitted
    (``ExpertCache.admit_prefetch``); a prefetch never changes the output. Optional (defaults in
    ``PrefetcherBase``): ``bind`` (keeps the sink), ``after_level`` (nothing),
    ``needs_predictions`` (True), ``counters`` (none).
    """

    name: ClassVar[str]

    def bind(self, target: Any, sink: Any) -> None:
        """Attach to the target (live: :class:`specfit.model.target.Target`; replay: a stand-in with
        ``runtime.spec`` and no passes) and keep ``sink`` to prefetch through."""

    def after_level(self, tree: DraftTree, predicted: Sequence[int], resident: np.ndarray) -> None:
        """After each draft level (predictor and selector have run): ``predicted`` are the nodes the
        selector would verify now (its current best subtree; their experts are in ``tree.experts``
        and the root's in ``tree.root_experts`` when a predictor is configured), ``resident`` the
        cache's residency (bool [layers, experts])."""

    def needs_predictions(self, tree: DraftTree) -> bool:
        """Whether the rest of this cycle's draft levels need expert predictions for it (asked
        after each level). Where the selector reads none (``eagle3``), a prefetcher that says False
        spares the predictor the cycle's remaining levels (EAGLE-3's trees: hundreds of nodes)."""

    def counters(self) -> dict[str, int]:
        """Counts kept since ``bind``, whose growth over a run goes into its results as
        ``prefetch_<name>`` (the look-ahead's passes run and paused); checked: names to ints."""


KINDS: dict[str, type] = {
    "drafter": Drafter,
    "selector": Selector,
    "cost_model": CostModel,
    "cache": ExpertCache,
    "predictor": ExpertPredictor,
    "acceptance": AcceptanceEstimator,
    "prefetch": Prefetcher,
}


