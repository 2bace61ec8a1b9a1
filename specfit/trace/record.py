"""Recording a trace: decode greedily, verifying at every position every node a selector could choose.

The engine decodes with ``accept_limit=0``, so each cycle commits exactly one token and every
position of the greedy output is the root of a recorded tree. The recording selector never stops
drafting and verifies the union over draft levels d of the ``total_tokens`` nodes of highest path
probability among nodes of depth <= d: the candidate sets that the built-in selectors choose
from after each level (EAGLE's reranking), plus the chain selector's path (the most likely child at
each level, which need not rank among them). Verifying them gives the target's argmax and routing
for every node any built-in selector could verify, at any level it could stop at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specfit.calibrate.fingerprint import acceptance_setup
from specfit.types.tree import DraftTree
from specfit.errors import ConfigError
from specfit.interfaces import Selection, SelectionContext, SelectorBase
from specfit.trace.format import Trace, TraceMeta, TraceSequence, expert_dtype, spec_to_json


class CandidateUnionSelector(SelectorBase):
    """Verifies, once the drafter has finished, every node that was a candidate after some level.

    Not registered as a plugin: it only serves recording (it never stops early and ignores cost).
    """

    name = "trace_recorder"

    def __init__(self) -> None:
        from specfit.plugins.selectors.chain import ChainSelector

        self._union: set[int] = set()
        self._chain = ChainSelector()

    def bind(self, spec: Any) -> None:
        self._chain.bind(spec)

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        if tree.depth == 1:
            self._union = set()
        self._union.update(tree.top_by_path_prob(ctx.max_nodes))
        self._union.update(self._chain.select(tree, ctx).nodes)
        return Selection(nodes=sorted(self._union))


class _SequenceBuilder:
    """Collects one prompt's cycles into the flat arrays of a :class:`TraceSequence`."""

    def __init__(self, prompt_ids: Sequence[int], routing: np.ndarray, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.prompt = np.asarray(prompt_ids, dtype=np.int32)
        self.prefill_routing = np.asarray(routing).astype(dtype)
        self.roots: list[int] = []
        # per cycle: tokens, parents, depths, log-probs, entropies, acceptance logits
        self.trees: list[tuple[np.ndarray, ...]] = []
        self.verified: list[tuple[np.ndarray, ...]] = []  # per cycle: nodes, argmax, routing
        self.root_argmax: list[int] = []
        self.root_routing: list[np.ndarray] = []
        self.level_seconds: list[list[float]] = []
        self.root_entropy: list[float] = []
        self.root_prob: list[float] = []
        self.root_accept_logit: list[float] = []

    def add(self, trace: Any) -> None:
        tree, block = trace.tree, trace.block
        if trace.accepted:
            raise RuntimeError("trace recording needs generate(accept_limit=0) (one committed token per cycle)")
        routing = np.asarray(trace.routing)
        self.roots.append(int(block.tokens[0]))
        self.trees.append((
            np.asarray(tree.tokens, dtype=np.int32),
            np.asarray(tree.parents, dtype=np.int32),  # tree indices are the local ones; ROOT is -1
            np.asarray(tree.depths, dtype=np.int16),
            np.asarray(tree.log_probs, dtype=np.float64),
            tree.node_entropy(),
            tree.node_accept_logit(),
        ))
        self.verified.append((
            np.asarray(block.nodes, dtype=np.int32),  # ascending tree indices
            np.asarray(trace.argmax[1:], dtype=np.int32),
            routing[1:].astype(self.dtype),
        ))
        self.root_argmax.append(int(trace.argmax[0]))
        self.root_routing.append(routing[0].astype(self.dtype))
        self.level_seconds.append([float(s) for s in trace.level_seconds])
        self.root_entropy.append(tree.root_entropy)
        self.root_prob.append(np.nan if tree.root_prob is None else float(tree.root_prob))
        self.root_accept_logit.append(tree.root_accept_logit)

    def finish(self, output_ids: Sequence[int], layers: int, top_k: int) -> TraceSequence:
        output = np.asarray(output_ids, dtype=np.int32)
        n = len(self.roots)
        if len(output) != n + 1 or (n and list(output[:-1]) != self.roots):
            raise RuntimeError(f"recording: {n} cycles do not match {len(output)} output tokens")

        def cat(parts: list[tuple[np.ndarray, ...]], i: int, dtype: Any, shape: tuple[int, ...] = ()) -> np.ndarray:
            arrays = [p[i] for p in parts]
            return np.concatenate(arrays).astype(dtype) if arrays else np.zeros((0, *shape), dtype=dtype)

        def offsets(counts: list[int]) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        shape = (layers, top_k)
        return TraceSequence(
            prompt=self.prompt,
            output=output,
            prefill_routing=self.prefill_routing,
            node_offsets=offsets([len(t[0]) for t in self.trees]),
            node_token=cat(self.trees, 0, np.int32),
            node_parent=cat(self.trees, 1, np.int32),
            node_depth=cat(self.trees, 2, np.int16),
            node_log_prob=cat(self.trees, 3, np.float64),
            verified_offsets=offsets([len(v[0]) for v in self.verified]),
            verified_node=cat(self.verified, 0, np.int32),
            verified_argmax=cat(self.verified, 1, np.int32),
            verified_routing=cat(self.verified, 2, self.dtype, shape),
            root_argmax=np.asarray(self.root_argmax, dtype=np.int32),
            root_routing=np.stack(self.root_routing) if self.root_routing else np.zeros((0, *shape), dtype=self.dtype),
            level_offsets=offsets([len(s) for s in self.level_seconds]),
            level_seconds=np.asarray([s for row in self.level_seconds for s in row], dtype=np.float64),
            node_entropy=cat(self.trees, 4, np.float32),
            root_entropy=np.asarray(self.root_entropy, dtype=np.float32),
            root_prob=np.asarray(self.root_prob, dtype=np.float64),
            node_accept_logit=cat(self.trees, 5, np.float32),
            root_accept_logit=np.asarray(self.root_accept_logit, dtype=np.float32),
        )


class TraceRecorder:
    """A cycle observer (``Engine.generate(observers=...)``) that turns each cycle into trace data."""

    def __init__(self, num_experts: int) -> None:
        self.dtype = expert_dtype(num_experts)
        self.current: _SequenceBuilder | None = None

    def on_prefill(self, prompt_ids: list[int], routing: Any, first_token: int) -> None:
        self.current = _SequenceBuilder(prompt_ids, routing, self.dtype)

    def on_cycle(self, trace: Any) -> None:
        if self.current is None:
            raise RuntimeError("trace recorder: a cycle before any prefill")
        self.current.add(trace)


def record(engine: Any, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = None,
           config: dict[str, Any] | None = None, done: Sequence[TraceSequence] = (),
           on_sequence: Callable[[int, TraceSequence], None] | None = None) -> Trace:
    """Decode ``prompts`` greedily with ``engine``'s drafter and return the trace of every position.

    The engine decodes with the recording's selector, a :class:`TraceRecorder` observer and an
    accept limit of 0, all passed to ``generate`` (the engine itself is not changed), and without
    its predictor, so the level timings measure drafting alone (a replay adds the time of the
    predictor it runs). Greedy decoding only: under sampling the
    committed sequence depends on the cycle boundaries, so no trace could be exact.

    ``done`` holds the sequences of the first prompts, recorded before (a resumed recording: a
    sequence depends only on its prompt, so they are kept, not decoded again); ``on_sequence(i,
    seq)`` is called as soon as prompt ``i`` is recorded (the trace writer saves it then).
    """
    if not engine.sampling.greedy:
        raise ConfigError("specfit record needs greedy decoding (sampling.temperature=0): under sampling "
                          "the output depends on the selector, so a trace cannot be replayed exactly")
    spec = engine.spec
    recorder = TraceRecorder(spec.num_experts)
    selector = CandidateUnionSelector()
    selector.bind(spec)
    if len(done) > len(prompts):
        raise ConfigError(f"a resumed recording holds {len(done)} sequences but there are only {len(prompts)} prompts")
    sequences = list(done)
    for i in range(len(done), len(prompts)):
        out = engine.generate(prompts[i], max_new_tokens=max_new_tokens, selector=selector, predict=False,
                              observers=[recorder], accept_limit=0)
        sequences.append(recorder.current.finish(out.token_ids, spec.num_layers, spec.top_k))
        recorder.current = None
        if on_sequence is not None:
            on_sequence(i, sequences[-1])
    constants, calibration = _calibration(engine)
    meta = TraceMeta(
        spec=spec_to_json(spec),
        drafter={"name": engine.drafter.name, "depth": int(engine.drafter.depth),
                 "total_tokens": int(engine.drafter.total_tokens)},
        stop_token_ids=sorted(int(t) for t in engine.stop_token_ids),
        max_new_tokens=int(engine.max_new_tokens if max_new_tokens is None else max_new_tokens),
        config=config,
        constants=constants,
        calibration=calibration,
        # what a learned acceptance model fitted on this trace is about (fit-acceptance copies it)
        info={**{k: v for k, v in engine.info.items() if k != "selector"}, "acceptance_setup": acceptance_setup(engine)},
    )
    return Trace(meta, sequences)


def _calibration(engine: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The cost model's constants and, when they came from a calibration file, its error report."""
    model = engine.cost_model
    if model is None or not model.calibrated:
        return None, None
    constants = model.constants
    report = None
    source = Path(constants.source) if constants.source not in ("", "config", "online") else None
    if source is not None and source.is_file():
        try:
            report = json.loads(source.read_text()).get("report")
        except (OSError, json.JSONDecodeError):
            report = None
    return constants.to_json(), report
