"""Exact replay of a trace: any selector, cache policy and cost model, without the target's passes.

Under greedy decoding the committed sequence is fixed; only the cycle boundaries depend on the
selector (docs/method.md section 7). The replay runs the engine's own cycle
(:class:`specfit.decode.cycle.Cycle`) against a :class:`TraceVerifier`, a verifier that answers from
the trace: at the current position it rebuilds the recorded tree level by level (the cycle runs
the predictor and the selector after each, with the simulated cache's residency and the measured
or modelled draft time), reads the target's tokens off the recorded argmaxes, counts the cache
hits and misses that the real cache policy (driven through
:func:`specfit.offload.admission.admission_rounds`) has on the recorded routing, and charges the cost
model's time for them, less the copy time a layer's pipelined rounds hide behind its compute
(:func:`hidden_copy_seconds`, the live runtime's schedule); the cycle feeds the selector and
predictor what the engine would, and the replay moves on by the tokens committed.

The replayed tree is the drafted tree, node for node, so selectors and predictors see what they
saw live. The target's verdict is known for the recorded candidates (every level's ``total_tokens``
best nodes and the chain, see :mod:`specfit.trace.record`): the ones the built-in selectors choose
from. A selection outside them cannot be replayed and is a clear error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Generator, Sequence

import numpy as np

from specfit.interfaces import guard
from specfit.decode.cycle import bind_estimator_target
from specfit.types.costs import CostConstants, load_constants
from specfit.types.context import TokenContext
from specfit.decode.cycle import Cycle, CycleTimes, Verdict
from specfit.interfaces.contracts import check_parts
from specfit.offload.admission import Round, admission_rounds, bind_cache, cache_preload, cache_resident
from specfit.offload.prefetch import ModelledSink
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.types.stats import CycleRecord, cycle_summary
from specfit.types.tree import DraftTree, VerifyBlock
from specfit.errors import ConfigError, SpecfitError
from specfit.trace.format import ACCEPTED_KEY, Trace, TraceError, TracePosition, TraceSequence

# ``replay.draft_time``, the selector's vocabulary: D measured (the recorded drafting time plus the
# predictor and selector time measured here) or modelled (the calibration's c_draft0 + c_level d).
DRAFT_TIMES = ("measured", "modelled")
DRAFT_TIME_ALIASES = {"recorded": "measured"}  # the earlier name, still accepted


def draft_time_mode(value: str) -> str:
    """``replay.draft_time`` in the current vocabulary (``recorded`` is ``measured``); one line otherwise."""
    mode = DRAFT_TIME_ALIASES.get(value, value)
    if mode not in DRAFT_TIMES:
        raise ConfigError(f"replay.draft_time={value!r} must be one of {', '.join(DRAFT_TIMES)} "
                          f"(recorded: the earlier name of measured)")
    return mode


@dataclass
class ReplayCycle(CycleRecord):
    """One replayed cycle: the engine's :class:`CycleRecord` (its times charged by the cost model:
    ``draft_seconds`` is D, drafting and selection; ``total_seconds`` the cycle) and where it ran."""

    sequence: int = 0
    position: int = 0  # index of the root in the sequence's output
    diverged: bool = False  # a tree pass disagreed with the recorded output: the path was cut there

    @property
    def seconds(self) -> float:
        """The cost model's cycle time."""
        return self.total_seconds


@dataclass
class ReplayResult:
    """Every replayed cycle of one method over a trace, with its summary."""

    method: str
    selector: str
    predictor: str | None
    cache: str
    slots_per_layer: int
    draft_time: str
    cycles: list[ReplayCycle]
    positions: int
    wall_seconds: float
    constants: dict[str, Any] = field(default_factory=dict)  # the CostConstants charged
    # a cost-aware selector's acceptance estimator, scored on the settled nodes (Brier, log loss, reliability)
    acceptance: dict[str, Any] = field(default_factory=dict)
    # the prefetcher's counts on the modelled link (empty without one), and what it could not replay
    prefetch: dict[str, Any] = field(default_factory=dict)

    def committed(self, sequence: int = 0) -> list[int]:
        """Tokens committed per cycle of one sequence (the agreement test's exact comparison)."""
        return [c.committed for c in self.cycles if c.sequence == sequence]

    def summary(self) -> dict[str, Any]:
        """:func:`specfit.types.stats.cycle_summary` (the keys a live run reports, same meanings) and
        the replay's own: the cost model's seconds, divergences, the replay's speed."""
        cycles = self.cycles
        seconds = sum(c.total_seconds for c in cycles)
        tokens = sum(c.committed for c in cycles)
        return {
            "method": self.method,
            "selector": self.selector,
            "predictor": self.predictor,
            "cache": self.cache,
            "cache_slots_per_layer": self.slots_per_layer,
            "draft_time": self.draft_time,
            "positions": self.positions,
            **cycle_summary(cycles),
            "predicted_seconds": seconds,
            "predicted_tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "divergences": sum(c.diverged for c in cycles),
            "replay_seconds": self.wall_seconds,
            "replay_positions_per_second": self.positions / self.wall_seconds if self.wall_seconds > 0 else 0.0,
            **self.acceptance,
            **self.prefetch,
        }


class RecordedRouting:
    """The recorded routing of the position being replayed, for ``predictor=oracle``.

    Node indices are the replayed tree's, which are the recorded nodes' local indices.
    """

    def __init__(self) -> None:
        self.position: TracePosition | None = None

    def root(self) -> np.ndarray:
        return self.position.root_routing.astype(np.int32)

    def nodes(self, nodes: Any) -> np.ndarray:
        """[len(nodes), layers, top_k]; -1 rows for nodes never verified (their routing is unknown,
        and no replayed selection can include them)."""
        pos = self.position
        rows = pos.rows(list(nodes))
        out = np.full((len(rows), *pos.root_routing.shape), -1, dtype=np.int32)
        out[rows >= 0] = pos.routing[rows[rows >= 0]]
        return out


class _Runtime:
    def __init__(self, spec: Any) -> None:
        self.spec = spec


class ReplayTarget:
    """What predictors bind to in a replay: the model's shape, its weights on first use (the router
    probe reads routers and embeddings; nothing runs the model), and the recorded routing."""

    def __init__(self, spec: Any, model: Any = None) -> None:
        import torch

        self.runtime = _Runtime(spec)
        self.device = torch.device("cpu")
        self.trace_routing = RecordedRouting()
        self._model = model

    @property
    def model(self) -> Any:
        if callable(self._model) and not hasattr(self._model, "parameters"):
            self._model = self._model()
        if self._model is None:
            raise ConfigError("this predictor needs the target model's weights, and the trace names no model to load")
        return self._model


def model_loader(trace: Trace, model_cfg: Any = None) -> Callable[[], Any]:
    """Load the trace's target (or ``model_cfg``'s) on first call, once: predictors share it."""
    cache: list[Any] = []

    def load() -> Any:
        if not cache:
            from specfit.model.config import ModelConfig
            from specfit.model.loading import load_target

            cfg = model_cfg
            if cfg is None:
                recorded = (trace.meta.config or {}).get("model")
                if not recorded:
                    raise ConfigError("the trace's config names no model: give model.path=DIR (or model=tiny)")
                cfg = ModelConfig(**{k: v for k, v in recorded.items() if k in ModelConfig.__dataclass_fields__})
            try:
                model = load_target(cfg).model.eval()
            except SpecfitError as exc:
                if model_cfg is not None:
                    raise
                # the user set no model key: say where this one came from
                raise type(exc)(f"{exc} (the model the trace was recorded with, from its meta.json; give "
                                "model=NAME or model.path=DIR to replay with it from elsewhere)") from None
            _check_model_matches(trace, model, given=model_cfg is not None)
            cache.append(model)
        return cache[0]

    return load


def _check_model_matches(trace: Trace, model: Any, given: bool) -> None:
    """A predictor reading another model's routers would fail deep inside, or predict nonsense."""
    from specfit.offload.discovery import moe_spec

    def shape(spec: Any) -> tuple[int, ...]:
        return tuple(int(getattr(spec, k)) for k in ("num_layers", "num_experts", "top_k", "hidden_size"))

    loaded, recorded = shape(moe_spec(model)), shape(trace.meta.moe_spec())
    which = "the model given (model=...)" if given else "the model the trace's config names"
    if loaded != recorded:
        raise ConfigError(f"the trace was recorded with a model of {_describe(recorded)}, but {which} has "
                          f"{_describe(loaded)}; replay with the model the trace was recorded with")
    vocab = getattr(model.config, "vocab_size", None)
    tokens = ("prompt", "output", "node_token", "verified_argmax", "root_argmax")
    highest = max((int(getattr(seq, k).max()) for seq in trace.sequences for k in tokens if getattr(seq, k).size),
                  default=-1)
    if vocab is not None and highest >= vocab:  # the predictors index the model's embeddings with them
        raise ConfigError(f"the trace holds token id {highest}, outside the vocabulary of {which} (size {vocab}): "
                          "a trace of another model, or a damaged one; replay with the model it was recorded with")


def _describe(shape: tuple[int, ...]) -> str:
    return "{} MoE layers, {} experts, top-{}, hidden size {}".format(*shape)


def replay(trace: Trace, selector: Any, cache: Any, cost_model: Any, predictor: Any = None, *,
           draft_time: str = "measured", model: Any = None, method: str | None = None,
           max_cycles: int | None = None, prefetcher: Any = None) -> ReplayResult:
    """Replay ``trace`` with these plugin instances (fresh ones: they are bound and keep state).

    ``draft_time``: ``measured`` (``recorded``, its earlier name, is accepted) charges each cycle
    the recorded drafting time up to the level it stopped at plus the predictor and selector time
    measured here; ``modelled`` charges the calibration's ``c_draft0 + c_level * levels`` (and hands
    selectors that value), so the whole replay depends on no clock. ``model`` is the target (or a
    function loading it) for predictors that read its weights; by default the trace's model is
    loaded when first needed. ``max_cycles`` stops early (a warm-up: the first selection in a
    process may compile code, and a measured-time replay would charge that as selection time).
    ``prefetcher``: its draft-time prefetches go to a modelled link (:class:`ModelledSink`): the
    cache admits them, a layer that needs one still in flight is charged the wait; prefetching from
    live hidden states (``lookahead``) cannot be replayed and says so in the summary.
    """
    mode = draft_time_mode(draft_time)
    check_parts({"selector": selector, "cache": cache, "cost_model": cost_model, "predictor": predictor})
    if cost_model is None:
        raise ConfigError("replay charges each cycle the cost model's time: set cost_model=union")
    spec = trace.meta.moe_spec()
    # Plug-ins are called through specfit.interfaces.guard, in the engine's order: selector, cost model, predictor, cache.
    guard.call("selector", selector, "bind", spec)
    guard.call("cost_model", cost_model, "bind", spec)
    verifier = TraceVerifier(trace, cache, _constants(cost_model, trace), mode,
                             model if model is not None else model_loader(trace))
    if predictor is not None:
        guard.call("predictor", predictor, "bind", verifier.target)
    bind_estimator_target(selector, verifier.target)
    verifier.bind_cache()
    verifier.selector_name = guard.plugin_name(selector)
    sink = None
    if prefetcher is not None and guard.plugin_name(prefetcher) != "none":
        check_parts({"prefetch": prefetcher})
        sink = verifier.sink = ModelledSink(prefetcher, spec, cache, verifier.slot_expert, verifier.constants)
        sink.call("bind", verifier.target, sink)
    cycle = Cycle(verifier, spec, selector, predictor, cost_model, prefetcher=prefetcher if sink else None, sink=sink)
    start = time.perf_counter()
    cycles = verifier.run(cycle, max_cycles)
    return ReplayResult(
        method=method or selector.name,
        selector=selector.name,
        predictor=predictor.name if predictor is not None else None,
        cache=cache.name,
        slots_per_layer=verifier.slots,
        draft_time=mode,
        cycles=cycles,
        positions=trace.positions,
        wall_seconds=time.perf_counter() - start,
        constants=verifier.constants.to_json(),
        acceptance=_acceptance_score(selector),
        prefetch=_prefetch_summary(prefetcher, sink),
    )


class TraceVerifier:
    """The cycle's verifier for a replay: the recorded tree is the drafter, the recorded argmaxes
    are the target's verdict, the real cache policy runs on the recorded routing, and each cycle
    is charged the cost model's time."""

    measured = False  # charged times: a cost model does not learn from them

    def __init__(self, trace: Trace, cache: Any, constants: CostConstants, draft_time: str, model: Any) -> None:
        self.trace, self.cache, self.constants, self.draft_time = trace, cache, constants, draft_time
        self.spec = trace.meta.moe_spec()
        self.max_depth = int(trace.meta.drafter.get("depth", 0))
        self.max_nodes = int(trace.meta.drafter.get("total_tokens", 0))
        self.target = ReplayTarget(self.spec, model)
        self.now = time.perf_counter
        self.extra: dict[str, Any] = {}
        self.slots = 0
        self.slot_expert = np.zeros((0, 0), dtype=np.int64)
        self.where = ""
        self.selector_name = ""  # for errors
        self.rec: TracePosition | None = None
        self.seq: TraceSequence | None = None
        self.output: np.ndarray = np.zeros(0, dtype=np.int32)
        self.start = 0
        self._rows = np.zeros(0, dtype=np.int64)
        self.diverged = False
        self.sink: ModelledSink | None = None  # the modelled link of a prefetcher, if any
        self._stall = 0.0  # the last pass's modelled wait for prefetches in flight
        self._hidden = 0.0  # the last pass's copy time its pipelined rounds hid behind compute

    def bind_cache(self) -> None:
        """Bind the cache policy and apply its preload, checked as the offload runtime checks it."""
        spec = self.spec
        self.slots = bind_cache(self.cache, spec)
        self.slot_expert = np.full((spec.num_layers, self.slots), -1, dtype=np.int64)
        for layer, loads in cache_preload(self.cache, spec, self.slots).items():
            for expert, slot in loads:
                self.slot_expert[layer, slot] = expert

    # ------------------------------------------------------------------ the replayed decode

    def run(self, cycle: Cycle, max_cycles: int | None) -> list[ReplayCycle]:
        """Every sequence of the trace through ``cycle``; stops after ``max_cycles`` cycles."""
        sampler = Sampler(SamplingParams())  # traces are greedy: the tokens come from the recorded argmaxes
        done: list[ReplayCycle] = []
        for index, seq in enumerate(self.trace.sequences):
            self._pass(seq.prefill_routing)  # the prefill goes through the cache too (not counted)
            if cycle.predictor is not None:  # as the engine does: the prompt's routing is a free warm start
                guard.call("predictor", cycle.predictor, "observe", seq.prompt.tolist(),
                           seq.prefill_routing.astype(np.int64))
            self.output = output = seq.output
            pos = 0  # the root's index in the output (the first token comes from the prefill)
            while pos + 1 < len(output):
                if max_cycles is not None and len(done) >= max_cycles:
                    return done
                self._at(index, seq, pos)
                if pos == 0:  # the prefill's first token; later roots come from token_prob
                    cycle.root_prob = self.rec.known_root_prob
                if pos == 0 or self.diverged:  # the sequence up to the root: the output's, not a diverged commit
                    cycle.context = TokenContext([*seq.prompt.tolist(), *output[:pos + 1].tolist()])
                if self.sink is not None:
                    self.sink.begin_cycle()
                sampler.position = pos + 1
                record, tokens = cycle.run(self.rec.root, sampler, self.max_depth, self.max_nodes,
                                           max_commit=len(output) - pos - 1)
                done.append(ReplayCycle(**vars(record), sequence=index, position=pos, diverged=self.diverged))
                pos += len(tokens)
        return done

    def _at(self, index: int, seq: TraceSequence, pos: int) -> None:
        self.seq, self.rec = seq, seq.position(pos)
        rec = self.rec
        self.target.trace_routing.position = rec
        self.extra = {ACCEPTED_KEY: rec.accepted_path()}  # for the oracle selector
        self.where, self.start = f"position {pos} of sequence {index}", pos + 1

    # ------------------------------------------------------------------ the Verifier protocol

    def levels(self, tree: DraftTree) -> Generator[range, None, None]:
        return self.rec.draft(tree)

    def draft_seconds(self, levels: int, elapsed: float, overhead: float) -> float:
        """D after ``levels`` levels: recorded drafting plus the time measured here, or modelled."""
        if self.draft_time == "modelled":
            return self.constants.c_draft0 + self.constants.c_level * levels
        return (float(self.rec.level_seconds[levels - 1]) if levels else 0.0) + overhead

    def resident(self) -> np.ndarray:
        return cache_resident(self.cache, self.spec)

    def arriving(self) -> np.ndarray | None:
        """The modelled link's view (None without a prefetcher: the selector sees today's context)."""
        return self.sink.arriving() if self.sink is not None else None

    def verify(self, block: VerifyBlock) -> Verdict:
        rec = self.rec
        rows = rec.rows(block.nodes)
        if np.any(rows < 0):
            unknown = [v for v, r in zip(block.nodes, rows) if r < 0]
            raise TraceError(
                f"selector '{self.selector_name}' chose nodes {unknown[:5]} at {self.where}, which the recording did not verify "
                f"(it verifies each level's {self.max_nodes} best nodes by path probability and the most likely "
                f"chain): this selection cannot be replayed")
        self._rows = rows
        routing = np.concatenate([rec.root_routing[None], rec.routing[rows]]).astype(np.int64)
        if self.sink is not None:  # the pass starts when drafting ended; prefetches may still be landing
            self._stall = self.sink.settle(routing, len(routing), self.sink.now())
        misses, hits, union = self._pass(routing)
        if self.sink is not None:
            self.sink.sweep()
        return Verdict(routing, misses, hits, union)

    def token_after(self, block: VerifyBlock, pos: int, sampler: Sampler) -> int:
        return self.rec.root_argmax if pos == 0 else int(self.rec.argmax[self._rows[pos - 1]])

    def token_prob(self, block: VerifyBlock, pos: int, token: int, sampler: Sampler) -> float | None:
        """The recorded probability of the root at the output index of the token after ``pos``."""
        index = self.start + block.depths[pos]
        seq = self.seq
        if index >= len(seq) or int(self.output[index]) != token or math.isnan(seq.root_prob[index]):
            return None
        return float(seq.root_prob[index])

    def keep(self, block: VerifyBlock, path: list[int], bonus: int) -> list[int]:
        """The greedy output is the ground truth of the sequence: a path that leaves it (tree-pass
        numerics) is cut where it does, and the cycle is marked diverged."""
        output, start = self.output, self.start
        for j, p in enumerate(path):
            if start + j < len(output) and block.tokens[p] != output[start + j]:
                self.diverged = True
                return path[:j]
        self.diverged = start + len(path) < len(output) and bonus != int(output[start + len(path)])
        return path

    def commit(self, tokens: list[int], kept: list[int], bonus: int) -> None:
        pass  # the recorded tree needs no drafter state

    def argmax(self) -> list[int]:
        return [int(self.rec.root_argmax)] + [int(self.rec.argmax[r]) for r in self._rows]

    def times(self, measured: CycleTimes, levels: int, verified: int, verdict: Verdict, overhead: float) -> CycleTimes:
        """The cost model's charge: D (recorded or modelled) plus the pass's time for its hits and misses."""
        draft = self.draft_seconds(levels, 0.0, overhead)
        stall, self._stall = self._stall, 0.0  # a modelled prefetch's wait (0.0 without one)
        charged = self.constants.cycle_seconds(verified, verdict.misses, verdict.hits, draft) - self._hidden
        return CycleTimes(draft, 0.0, 0.0, charged + stall)

    def _pass(self, routing: np.ndarray) -> tuple[int, int, list[int]]:
        """One target pass through the cache policy: (misses, hits, experts per layer). Sets the
        copy time its layers' pipelined rounds hide (:func:`hidden_copy_seconds`)."""
        guard.call("cache", self.cache, "begin_pass")
        misses = hits = 0
        union: list[int] = []
        self._hidden = 0.0
        c = self.constants
        for layer in range(self.spec.num_layers):
            needed = np.unique(routing[:, layer, :]).tolist()  # ascending, as the runtime asks
            union.append(len(needed))
            rounds = list(admission_rounds(self.cache, self.slot_expert, layer, needed))
            for admission in rounds:
                misses += len(admission.loads)
                hits += len(admission.slots) - len(admission.loads)
            if len(rounds) > 1:
                self._hidden += hidden_copy_seconds(rounds, max(c.c_miss - c.c_hit, 0.0), c.c_hit)
        return misses, hits, union


def hidden_copy_seconds(rounds: Sequence[Round], copy_s: float, compute_s: float) -> float:
    """The copy time a layer's rounds hide behind compute, against the cost model's linear charge
    (``copy_s`` per copy plus ``compute_s`` per expert, one after the other).

    The schedule is the live runtime's (:meth:`specfit.offload.runtime.OffloadRuntime.run_layer`) on
    one FIFO link: a round issues its own held-back copies (``fresh``) and then the next round's
    (``ahead``), waits until the copies into its slots have landed, and computes ``compute_s`` per
    expert; a copy starts when the link is free and not before it is issued."""
    now = link = 0.0
    lands: dict[int, float] = {}  # slot -> when its copy lands
    for rnd in rounds:
        for _, slot in (*rnd.fresh, *rnd.ahead):
            link = max(link, now) + copy_s
            lands[slot] = link
        now = max([now, *(lands.pop(slot) for slot in rnd.slots.values() if slot in lands)])
        now += compute_s * len(rnd.slots)
    linear = copy_s * sum(len(rnd.loads) for rnd in rounds) + compute_s * sum(len(rnd.slots) for rnd in rounds)
    return max(linear - now, 0.0)


def _prefetch_summary(prefetcher: Any, sink: ModelledSink | None) -> dict[str, Any]:
    """The prefetcher's counts on the modelled link, and a note on what was not replayed."""
    if prefetcher is None or sink is None:
        return {}
    modelled = "prefetch modelled on the replay's link (expert_seconds = c_miss - c_hit per copy, FIFO)"
    # the look-ahead alone replays nothing (it reads live hidden states): its own note says so
    notes = list(sink.notes) if guard.plugin_name(prefetcher) == "lookahead" else [modelled, *sink.notes]
    return {
        "prefetch": guard.plugin_name(prefetcher),
        "prefetch_time": "modelled",
        "prefetch_issued": sink.counts.issued,
        "prefetch_used": sink.used,
        "prefetch_wasted": sink.wasted,
        "h2d_stall_seconds": sink.stall_seconds,
        "prefetch_note": "; ".join(notes),
    }


def _acceptance_score(selector: Any) -> dict[str, Any]:
    """The selector's acceptance score (:class:`specfit.types.acceptance.AcceptanceScore`), if it keeps one."""
    score = selector.acceptance_score
    return score.as_dict() if score is not None and score.nodes else {}


def _constants(cost_model: Any, trace: Trace) -> CostConstants:
    """The constants to charge: the cost model's own file or explicit values, else the trace's
    (handed to its ``set_constants``, the hook a replay, like ``specfit.build``, sets them through)."""
    if not cost_model.calibrated:
        source = cost_model.calibration
        if source not in ("auto", None):
            guard.call("cost_model", cost_model, "set_constants", load_constants(source))
        elif trace.meta.constants:
            recorded = {**trace.meta.constants, "provisional": False}  # a replay's costs are fixed: never refined
            guard.call("cost_model", cost_model, "set_constants", CostConstants.from_json(recorded))
    try:
        constants = cost_model.constants
    except ConfigError as exc:
        raise ConfigError("the trace carries no cost constants (it was recorded without cost_model=union): give "
                          "cost_model.calibration=FILE or cost_model.c0/c_tok/c_miss/c_hit") from exc
    except SpecfitError:
        raise
    except Exception as exc:
        raise guard.failure("cost_model", cost_model, "constants", exc) from exc
    if not isinstance(constants, CostConstants):
        raise guard.violation("cost_model", cost_model, "constants",
                              f"must be a specfit.types.costs.CostConstants, got {type(constants).__name__}")
    values = {k: getattr(constants, k) for k in ("c0", "c_tok", "c_miss", "c_hit", "c_level", "c_draft0")}
    broken = {k: v for k, v in values.items() if not (isinstance(v, Real) and math.isfinite(v))}
    if broken:
        raise guard.violation("cost_model", cost_model, "constants", f"non-finite or non-numeric constants {broken}")
    return constants
