"""Exact replay of a trace: any selector, cache policy and cost model, without the target's passes.

Under greedy decoding the committed sequence is fixed; only the cycle boundaries depend on the
selector (docs/method.md section 7). The replay walks a recorded sequence as the engine would: at the
current position it rebuilds the recorded tree level by level, runs the predictor and the selector
after each level (with the simulated cache's residency and the recorded or modelled draft time),
reads the accepted path off the recorded argmaxes, charges the cost model's time for the cache
hits and misses that the real cache policy (driven through
:func:`specfit.core.offload.admission_rounds`) has on the recorded routing, feeds the selector and
predictor what the engine would, and moves on by accepted + 1 tokens.

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
from typing import Any, Callable

import numpy as np

from specfit.core import guard
from specfit.core.calibration import CostConstants, load_constants
from specfit.core.engine import report_time, should_draft
from specfit.core.offload import admission_rounds, bind_cache, cache_preload, cache_resident
from specfit.core.stats import prediction_overlap
from specfit.core.tree import DraftTree, VerifyBlock, verify_block
from specfit.errors import ConfigError, SpecfitError
from specfit.interfaces import Selection, SelectionContext
from specfit.registry import check_plugin_instance
from specfit.trace.format import ACCEPTED_KEY, Trace, TraceError, TracePosition, TraceSequence

DRAFT_TIMES = ("recorded", "modelled")


@dataclass
class ReplayCycle:
    """One replayed cycle; the fields mirror :class:`specfit.core.stats.CycleRecord` where they exist."""

    sequence: int
    position: int  # index of the root in the sequence's output
    levels: int
    drafted: int
    verified: int
    accepted: int
    committed: int
    misses: int
    hits: int
    union: float  # mean experts per layer in the verification pass
    draft_seconds: float  # D: drafting and selection (recorded + measured here, or modelled)
    seconds: float  # the cost model's cycle time
    predicted: dict[str, float] = field(default_factory=dict)
    prediction: tuple[int, int, int] | None = None
    diverged: bool = False


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

    def committed(self, sequence: int = 0) -> list[int]:
        """Tokens committed per cycle of one sequence (the agreement test's exact comparison)."""
        return [c.committed for c in self.cycles if c.sequence == sequence]

    def summary(self) -> dict[str, Any]:
        cycles = self.cycles
        n = max(len(cycles), 1)
        tokens = sum(c.committed for c in cycles)
        seconds = sum(c.seconds for c in cycles)
        hits, misses = sum(c.hits for c in cycles), sum(c.misses for c in cycles)
        out: dict[str, Any] = {
            "method": self.method,
            "selector": self.selector,
            "predictor": self.predictor,
            "cache": self.cache,
            "cache_slots_per_layer": self.slots_per_layer,
            "draft_time": self.draft_time,
            "positions": self.positions,
            "cycles": len(cycles),
            "decode_tokens": tokens,
            "tokens_per_cycle": tokens / n,
            "spec_decode_acceptance_length": sum(c.accepted + 1 for c in cycles) / n,
            "verified_nodes": sum(c.verified for c in cycles),
            "verified_nodes_per_cycle": sum(c.verified for c in cycles) / n,
            "draft_levels_per_cycle": sum(c.levels for c in cycles) / n,
            "draft_tokens_per_cycle": sum(c.drafted for c in cycles) / n,
            "expert_cache_hits": hits,
            "expert_cache_misses": misses,
            "expert_cache_hit_rate": hits / max(hits + misses, 1),
            "experts_per_layer_union": sum(c.union for c in cycles) / n,
            "predicted_seconds": seconds,
            "predicted_tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "divergences": sum(c.diverged for c in cycles),
            "replay_seconds": self.wall_seconds,
            "replay_positions_per_second": self.positions / self.wall_seconds if self.wall_seconds > 0 else 0.0,
        }
        scored = [c.prediction for c in cycles if c.prediction is not None]
        if scored:
            correct, predicted, routed = (sum(x[i] for x in scored) for i in range(3))
            out["predictor_precision"] = correct / predicted if predicted else 0.0
            out["predictor_recall"] = correct / routed if routed else 0.0
        return out


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
            from specfit.config import ModelConfig
            from specfit.core.loading import load_target

            cfg = model_cfg
            if cfg is None:
                recorded = (trace.meta.config or {}).get("model")
                if not recorded:
                    raise ConfigError("the trace's config names no model: give model.path=DIR (or model=tiny)")
                cfg = ModelConfig(**{k: v for k, v in recorded.items() if k in ModelConfig.__dataclass_fields__})
            cache.append(load_target(cfg).model.eval())
        return cache[0]

    return load


def replay(trace: Trace, selector: Any, cache: Any, cost_model: Any, predictor: Any = None, *,
           draft_time: str = "recorded", model: Any = None, method: str | None = None,
           max_cycles: int | None = None) -> ReplayResult:
    """Replay ``trace`` with these plugin instances (fresh ones: they are bound and keep state).

    ``draft_time``: ``recorded`` charges each cycle the recorded drafting time up to the level it
    stopped at plus the predictor and selector time measured here; ``modelled`` charges the
    calibration's ``c_draft0 + c_level * levels`` (and hands selectors that value), so the whole
    replay depends on no clock. ``model`` is the target (or a function loading it) for predictors
    that read its weights; by default the trace's model is loaded when first needed.
    ``max_cycles`` stops early (a warm-up: the first selection in a process may compile code, and
    a recorded-time replay would charge that as selection time).
    """
    if draft_time not in DRAFT_TIMES:
        raise ConfigError(f"replay.draft_time={draft_time!r} must be one of {', '.join(DRAFT_TIMES)}")
    return _Replayer(trace, selector, cache, cost_model, predictor, draft_time,
                     model if model is not None else model_loader(trace), method).run(max_cycles)


class _Replayer:
    def __init__(self, trace: Trace, selector: Any, cache: Any, cost_model: Any, predictor: Any, draft_time: str,
                 model: Any, method: str | None) -> None:
        self.trace, self.selector, self.cache = trace, selector, cache
        self.cost_model, self.predictor, self.draft_time = cost_model, predictor, draft_time
        parts = {"selector": selector, "cache": cache, "cost_model": cost_model, "predictor": predictor}
        for kind, part in parts.items():
            if part is not None:
                check_plugin_instance(kind, part)
        if cost_model is None:
            raise ConfigError("replay charges each cycle the cost model's time: set cost_model=union")
        for needed in getattr(selector, "requires", ()):  # as the engine checks
            if parts.get(needed) is None:
                raise ConfigError(f"selector={selector.name} needs a {needed}: set {needed}=... (e.g. predictor=history)")
        self.spec = spec = trace.meta.moe_spec()
        self.max_depth = int(trace.meta.drafter.get("depth", 0))
        self.max_nodes = int(trace.meta.drafter.get("total_tokens", 0))
        # Plug-ins are called through specfit.core.guard, as the engine calls them.
        guard.call("selector", selector, "bind", spec)
        guard.call("cost_model", cost_model, "bind", spec)
        self.constants = _constants(cost_model, trace)
        self.target = ReplayTarget(spec, model)
        if predictor is not None:
            guard.call("predictor", predictor, "bind", self.target)
        self.slots = bind_cache(cache, spec)
        self.slot_expert = np.full((spec.num_layers, self.slots), -1, dtype=np.int64)
        for layer, loads in cache_preload(cache, spec, self.slots).items():
            for expert, slot in loads:
                self.slot_expert[layer, slot] = expert
        self.method = method or selector.name
        self.cycles: list[ReplayCycle] = []

    def run(self, max_cycles: int | None = None) -> ReplayResult:
        self.max_cycles = max_cycles
        start = time.perf_counter()
        for i, seq in enumerate(self.trace.sequences):
            self._sequence(i, seq)
        return ReplayResult(
            method=self.method,
            selector=self.selector.name,
            predictor=self.predictor.name if self.predictor is not None else None,
            cache=self.cache.name,
            slots_per_layer=self.slots,
            draft_time=self.draft_time,
            cycles=self.cycles,
            positions=self.trace.positions,
            wall_seconds=time.perf_counter() - start,
            constants=self.constants.to_json(),
        )

    # ------------------------------------------------------------------ the decode loop, replayed

    def _sequence(self, index: int, seq: TraceSequence) -> None:
        self._pass(seq.prefill_routing)  # the prefill goes through the cache too (not counted)
        if self.predictor is not None:  # as the engine does: the prompt's routing is a free warm start
            guard.call("predictor", self.predictor, "observe", seq.prompt.tolist(), seq.prefill_routing.astype(np.int64))
        output = seq.output
        done = 1  # output tokens committed (the first comes from the prefill)
        while done < len(output):
            if self.max_cycles is not None and len(self.cycles) >= self.max_cycles:
                return
            done += self._cycle(index, seq.position(done - 1), done - 1, output)

    def _cycle(self, index: int, rec: TracePosition, pos: int, output: np.ndarray) -> int:
        tree = DraftTree(root_token=rec.root)
        selection = Selection(nodes=[])
        overhead = 0.0  # predictor and selector time measured here
        full_path = rec.accepted_path()
        self.target.trace_routing.position = rec
        levels = 0
        for d in range(1, (rec.levels if should_draft(self.selector) else 0) + 1):
            nodes = rec.level(d)
            part = slice(nodes.start, nodes.stop)
            level = tree.add_level(rec.parents[part].tolist(), rec.tokens[part].tolist(), rec.log_probs[part].tolist())
            levels = d
            t0 = time.perf_counter()
            if self.predictor is not None:
                guard.call("predictor", self.predictor, "predict", tree, level)
                guard.check_predicted_experts(self.predictor, tree, level, self.spec.num_layers, self.spec.top_k,
                                              self.spec.num_experts)
            t_sel = time.perf_counter()
            overhead += t_sel - t0
            ctx = SelectionContext(
                resident=cache_resident(self.cache, self.spec),
                draft_seconds=self._draft_seconds(rec, d, overhead),
                max_depth=self.max_depth,
                max_nodes=self.max_nodes,
                cost_model=self.cost_model,
                extra={ACCEPTED_KEY: full_path},
            )
            selection = guard.check_selection(self.selector, tree, guard.call("selector", self.selector, "select", tree, ctx))
            overhead += time.perf_counter() - t_sel
            if selection.stop:
                break

        block = verify_block(tree, selection.nodes)  # checked by guard.check_selection
        rows = rec.rows(block.nodes)
        if np.any(rows < 0):
            unknown = [v for v, r in zip(block.nodes, rows) if r < 0]
            raise TraceError(
                f"selector '{self.selector.name}' chose nodes {unknown[:5]} at position {pos} of sequence {index}, "
                f"which the recording did not verify (it verifies each level's {self.max_nodes} best nodes by "
                f"path probability and the most likely chain): this selection cannot be replayed")
        routing = np.concatenate([rec.root_routing[None], rec.routing[rows]]).astype(np.int64)
        path, bonus = _accept(block, rec, rows)
        misses, hits, union = self._pass(routing)

        # Commit as the live run would: the greedy output is the ground truth of the sequence.
        start = pos + 1
        for j, p in enumerate(path):
            if start + j < len(output) and block.tokens[p] != output[start + j]:
                path, diverged = path[:j], True  # a tree pass disagrees with the recorded output
                break
        else:
            diverged = start + len(path) < len(output) and bonus != int(output[start + len(path)])
        committed = len(output[start : start + len(path) + 1])

        accepted_nodes = [block.nodes[p - 1] for p in path]
        tree.greedy_next = bonus  # traces are greedy
        guard.call("selector", self.selector, "observe", tree, selection.nodes, accepted_nodes)
        if self.predictor is not None:
            kept = [0] + path
            guard.call("predictor", self.predictor, "observe", [block.tokens[p] for p in kept], routing[kept])
        draft = self._draft_seconds(rec, levels, overhead)
        self.cycles.append(ReplayCycle(
            sequence=index,
            position=pos,
            levels=levels,
            drafted=len(tree),
            verified=len(block) - 1,
            accepted=len(path),
            committed=committed,
            misses=misses,
            hits=hits,
            union=union,
            draft_seconds=draft,
            seconds=self.constants.cycle_seconds(len(block) - 1, misses, hits, draft),
            predicted=dict(selection.predicted),
            prediction=prediction_overlap(tree, block, routing) if self.predictor is not None else None,
            diverged=diverged,
        ))
        report_time(self.selector, levels > 0, committed, self.cycles[-1].seconds)  # the charged seconds
        return committed

    def _draft_seconds(self, rec: TracePosition, levels: int, overhead: float) -> float:
        """D after ``levels`` levels: recorded drafting plus the time measured here, or modelled."""
        if self.draft_time == "modelled":
            return self.constants.c_draft0 + self.constants.c_level * levels
        return (float(rec.level_seconds[levels - 1]) if levels else 0.0) + overhead

    def _pass(self, routing: np.ndarray) -> tuple[int, int, float]:
        """One target pass through the cache policy: (misses, hits, mean union per layer)."""
        guard.call("cache", self.cache, "begin_pass")
        misses = hits = union = 0
        for layer in range(self.spec.num_layers):
            needed = np.unique(routing[:, layer, :]).tolist()  # ascending, as the runtime asks
            union += len(needed)
            for admission in admission_rounds(self.cache, self.slot_expert, layer, needed):
                misses += len(admission.loads)
                hits += len(admission.slots) - len(admission.loads)
        return misses, hits, union / max(self.spec.num_layers, 1)


def _accept(block: VerifyBlock, rec: TracePosition, rows: np.ndarray) -> tuple[list[int], int]:
    """Greedy acceptance from the recorded argmaxes (``rows``: each block node's verified row),
    walking the block as the engine does."""
    children = block.children()
    path: list[int] = []
    pos = 0
    while True:
        token = rec.root_argmax if pos == 0 else int(rec.argmax[rows[pos - 1]])
        nxt = next((c for c in children[pos] if block.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        pos = nxt


def _constants(cost_model: Any, trace: Trace) -> CostConstants:
    """The constants to charge: the cost model's own file or explicit values, else the trace's."""
    if hasattr(cost_model, "set_constants") and not getattr(cost_model, "calibrated", True):
        source = getattr(cost_model, "calibration", "auto")
        if source not in ("auto", None):
            guard.call("cost_model", cost_model, "set_constants", load_constants(source))
        elif trace.meta.constants:
            guard.call("cost_model", cost_model, "set_constants", CostConstants.from_json(trace.meta.constants))
    try:
        constants = cost_model.constants
    except AttributeError as exc:
        raise ConfigError(f"cost_model '{cost_model.name}' has no constants: replay charges time with "
                          "CostConstants (use cost_model=union)") from exc
    except ConfigError as exc:
        raise ConfigError("the trace carries no cost constants (it was recorded without cost_model=union): give "
                          "cost_model.calibration=FILE or cost_model.c0/c_tok/c_miss/c_hit") from exc
    except SpecfitError:
        raise
    except Exception as exc:
        raise guard.failure("cost_model", cost_model, "constants", exc) from exc
    if not isinstance(constants, CostConstants):
        raise guard.violation("cost_model", cost_model, "constants",
                              f"must be a specfit.core.calibration.CostConstants, got {type(constants).__name__}")
    values = {k: getattr(constants, k) for k in ("c0", "c_tok", "c_miss", "c_hit", "c_level", "c_draft0")}
    broken = {k: v for k, v in values.items() if not (isinstance(v, Real) and math.isfinite(v))}
    if broken:
        raise guard.violation("cost_model", cost_model, "constants", f"non-finite or non-numeric constants {broken}")
    return constants
