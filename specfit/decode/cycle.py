"""One decode cycle: draft -> predict -> select -> verify -> accept -> commit -> observe.

The same code runs live decoding (:class:`specfit.decode.engine.EngineCore`, against the target and its
offload runtime) and exact trace replay (:mod:`specfit.trace.replay`, against a recorded trace):
a :class:`Verifier` answers for the target, and everything else (the order of the plug-in
calls, their guard checks, acceptance, the cycle record) is written once. That is what makes a
replay take the decisions the live run took (docs/method.md section 7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from specfit.interfaces import guard
from specfit.decode.acceptance import Acceptance, walk
from specfit.types.context import TokenContext
from specfit.decode.sampling import Sampler
from specfit.types.stats import CycleRecord, prediction_overlap, waited_copy_seconds
from specfit.types.tree import DraftTree, VerifyBlock, verify_block
from specfit.errors import ConfigError
from specfit.interfaces import CostModel, ExpertPredictor, Selection, SelectionContext, Selector


@dataclass
class Verdict:
    """What verifying one block told the cycle: the target's pass, or the trace's record of it."""

    routing: np.ndarray  # int [len(block), layers, top_k]: the experts each verified token used
    misses: int  # expert-cache misses and hits of the pass
    hits: int
    union: list[int]  # experts per MoE layer in the pass
    h2d_seconds: float = 0.0
    h2d_stall_seconds: float = 0.0  # time the pass's compute blocked on copies (pipelined runtime)
    copies_overlap: bool = False  # copies overlapped other work and the stall is what the pass waited
    stall_measured: bool = False  # h2d_stall_seconds is the pass's wait as the host measured it (emulated link)


@dataclass
class CycleTimes:
    """A cycle's seconds: measured (live), or charged by the cost model (replay)."""

    draft_seconds: float  # drafting (live: selection excluded; replay: D, everything before verification)
    select_seconds: float
    verify_seconds: float
    total_seconds: float


class Verifier(Protocol):
    """What a cycle runs against: where the tree's levels come from (live: the drafter; replay: the
    recorded tree), the cache's residency, the target's verdict on a block, and the clock."""

    measured: bool  # True: times are wall-clock (the cost model may learn from them); False: charged
    extra: dict[str, Any]  # SelectionContext.extra for the selector

    def now(self) -> float: ...

    def levels(self, tree: DraftTree) -> Generator[range, None, None]:
        """The tree's levels as they are grown; the cycle closes it when it stops drafting."""

    def arriving(self) -> np.ndarray | None:
        """float [layers, experts]: seconds until each expert is usable (the runtime's or a
        replay's modelled link), for the cost model; None where the verifier cannot tell."""

    def draft_seconds(self, levels: int, elapsed: float, overhead: float) -> float:
        """D handed to the selector after ``levels`` levels: ``elapsed`` is the wall time since the
        cycle started, ``overhead`` its predictor and selector time."""

    def resident(self) -> np.ndarray: ...

    def verify(self, block: VerifyBlock) -> Verdict: ...

    def token_after(self, block: VerifyBlock, pos: int, sampler: Sampler) -> int:
        """The target's token after block position ``pos`` (output token ``sampler.position + depth``)."""

    def token_prob(self, block: VerifyBlock, pos: int, token: int, sampler: Sampler) -> float | None:
        """The target's probability of ``token`` after block position ``pos`` (see
        :func:`target_prob`); None where it is not known (a trace recorded without it)."""

    def keep(self, block: VerifyBlock, path: list[int], bonus: int) -> list[int]:
        """Keep the accepted path (live: compact the KV cache); returns the path to commit (a replay
        cuts it where a tree pass disagreed with the recorded output)."""

    def commit(self, tokens: list[int], kept: list[int], bonus: int) -> None:
        """Hand the kept positions to the drafter (live); nothing to do in a replay."""

    def argmax(self) -> list[int]:
        """The target's greedy token after each block position of the last pass (for observers)."""

    def times(self, measured: CycleTimes, levels: int, verified: int, verdict: Verdict, overhead: float) -> CycleTimes:
        """The seconds to record: ``measured`` live, the cost model's charge in a replay."""


@dataclass
class CycleTrace:
    """Everything one cycle saw, for observers (trace recording, analysis); built only when observed."""

    tree: DraftTree
    block: Any  # the VerifyBlock that was verified
    argmax: list[int]  # the target's greedy token after each block position
    routing: Any  # np.ndarray int [len(block), layers, top_k], experts each verified token used
    accepted: list[int]  # accepted block positions
    bonus: int
    level_seconds: list[float]  # time since the cycle started, at the end of each draft level
    record: CycleRecord


@runtime_checkable
class CycleObserver(Protocol):
    """Sees every cycle of a decode (trace recording, analysis); never changes a part or the output."""

    def on_prefill(self, prompt_ids: list[int], routing: Any, first_token: int) -> None: ...

    def on_cycle(self, trace: CycleTrace) -> None: ...


@dataclass
class Drafted:
    """What a cycle's drafting leaves for verification: the last selection and its times."""

    selection: Selection
    select_seconds: float = 0.0
    overhead: float = 0.0  # predictor and selector time
    level_seconds: list[float] = field(default_factory=list)  # since the cycle started, at each level's end


@dataclass
class Cycle:
    """The plug-ins one decode (or one replay) runs its cycles with.

    ``accept_limit``: commit at most this many accepted draft tokens per cycle (trace recording
    uses 0 to visit every position of the greedy output; greedy decoding only).
    """

    verifier: Verifier
    spec: Any  # the target's MoESpec
    selector: Selector
    predictor: ExpertPredictor | None = None
    cost_model: CostModel | None = None
    accept_limit: int | None = None
    observers: Sequence[CycleObserver] = ()
    stop_token_ids: frozenset[int] | set[int] = field(default_factory=frozenset)
    # the prefetcher and the sink it was bound with (specfit.offload.prefetch): after_level runs after
    # every draft level's selection; None: no prefetch during drafting
    prefetcher: Any = None
    sink: Any = None
    # the target's probability of the next cycle's root token (DraftTree.root_prob): the engine sets
    # it after the prefill, a replay at each sequence's start, and every cycle for the next one
    root_prob: float | None = None
    # the sequence so far, the root included (specfit.types.context): set at each sequence's start
    # by the engine or the replay (which also resets it to the recorded output after a divergence),
    # grown here by every cycle's committed tokens
    context: TokenContext | None = None

    def run(self, root: int, sampler: Sampler, max_depth: int, max_nodes: int, room: int | None = None,
            max_commit: int | None = None) -> tuple[CycleRecord, list[int]]:
        """One cycle from the committed token ``root``; returns its record and the tokens it commits.

        ``room``: the deepest draft level the context has room for (None: no limit); ``max_commit``:
        the most tokens it may commit (the rest of ``max_new_tokens``); a stop token ends the commit.
        """
        verifier = self.verifier
        t0 = verifier.now()
        tree = DraftTree(root_token=root, root_prob=self.root_prob,
                         context=self.context.view() if self.context is not None else None)
        drafted = self._draft(tree, t0, max_depth if room is None else min(max_depth, room), max_nodes, room)
        t_verify = verifier.now()
        block = verify_block(tree, drafted.selection.nodes)  # checked by guard.check_selection
        verdict = verifier.verify(block)
        acc, path = self._accept(block, sampler)
        verify_seconds = verifier.now() - t_verify
        tokens = self._commit(tree, block, verdict, drafted.selection, acc, path, sampler, max_commit)
        quality = prediction_overlap(tree, block, verdict.routing)
        measured = CycleTimes(t_verify - t0 - drafted.select_seconds, drafted.select_seconds, verify_seconds,
                              verifier.now() - t0)
        times = verifier.times(measured, tree.depth, len(block) - 1, verdict, drafted.overhead)
        record = cycle_record(tree, block, verdict, drafted.selection, len(path), len(tokens), times, quality)
        self._learn(record)
        if self.observers:
            trace = CycleTrace(tree, block, verifier.argmax(), verdict.routing, path, acc.bonus,
                               drafted.level_seconds, record)
            for observer in self.observers:
                observer.on_cycle(trace)
        if self.context is not None:
            self.context.extend(tokens)
        return record, tokens

    # ------------------------------------------------------------------ the cycle's steps

    def _draft(self, tree: DraftTree, t0: float, depth_limit: int, max_nodes: int, room: int | None) -> Drafted:
        """Grow ``tree`` level by level, predicting experts and selecting after each, until the
        selector stops, the drafter has no more levels or the context no more room."""
        verifier = self.verifier
        drafted = Drafted(Selection(nodes=[]))
        levels = verifier.levels(tree) if should_draft(self.selector) else no_levels()
        likeliest = chooses_among_likeliest(self.selector)
        for level in levels:
            t_pred = verifier.now()
            candidates = self._predict(tree, level, likeliest, max_nodes)
            t_sel = verifier.now()
            drafted.overhead += t_sel - t_pred
            drafted.level_seconds.append(t_sel - t0 - drafted.select_seconds)
            ctx = self._context(tree, t_sel - t0, drafted.overhead, depth_limit, max_nodes)
            drafted.selection = self._select(tree, ctx, candidates, max_nodes)
            spent = verifier.now() - t_sel
            drafted.select_seconds += spent
            drafted.overhead += spent
            if drafted.selection.stop or (room is not None and tree.depth >= room):  # never draft past the context
                break
        levels.close()  # the drafter tidies up (drops its tree KV) now, not when garbage-collected
        return drafted

    def _predict(self, tree: DraftTree, level: range, likeliest: bool, max_nodes: int) -> list[int] | None:
        """The new level's experts, where anything reads them; returns the likeliest nodes where
        experts were predicted for those alone (None: for the whole level, or not at all)."""
        predictor, spec = self.predictor, self.spec
        if predictor is None or not self._predictions_needed(tree):
            return None
        candidates = tree.top_by_path_prob(max_nodes) if likeliest else None
        nodes = level if candidates is None else [v for v in candidates if v >= level.start]
        guard.call("predictor", predictor, "predict", tree, nodes)
        guard.check_predicted_experts(predictor, tree, nodes, spec.num_layers, spec.top_k, spec.num_experts)
        return candidates

    def _context(self, tree: DraftTree, elapsed: float, overhead: float, depth_limit: int,
                 max_nodes: int) -> SelectionContext:
        verifier = self.verifier
        return SelectionContext(
            resident=verifier.resident(),
            draft_seconds=verifier.draft_seconds(tree.depth, elapsed, overhead),
            max_depth=depth_limit,
            max_nodes=max_nodes,
            cost_model=self.cost_model,
            # copies in flight between passes come only from a prefetcher: without one, today's context;
            # the cost model prices them (a selector without one, EAGLE's, reads none)
            arriving=verifier.arriving() if self.prefetcher is not None and self.cost_model is not None else None,
            extra=verifier.extra,
        )

    def _select(self, tree: DraftTree, ctx: SelectionContext, candidates: list[int] | None,
                max_nodes: int) -> Selection:
        """The selector's checked choice after this level; the prefetcher then issues copies for
        the pass to come while drafting goes on."""
        selector = self.selector
        selection = guard.check_selection(selector, tree, guard.call("selector", selector, "select", tree, ctx))
        if candidates is not None:
            guard.check_among_likeliest(selector, selection, candidates, max_nodes)
        if self.prefetcher is not None:
            self.sink.at(ctx.draft_seconds)
            self.sink.call("after_level", tree, list(selection.nodes), ctx.resident)
        return selection

    def _accept(self, block: VerifyBlock, sampler: Sampler) -> tuple[Acceptance, list[int]]:
        """The target's verdict walked from the root (at most ``accept_limit`` draft tokens), and
        the accepted path the verifier keeps."""
        verifier = self.verifier
        acc = walk(block, lambda pos: verifier.token_after(block, pos, sampler))
        if self.accept_limit is not None and len(acc.path) > self.accept_limit:
            if not sampler.params.greedy:
                raise ConfigError("accept_limit (trace recording) needs greedy decoding")
            path = acc.path[: self.accept_limit]
            acc = Acceptance(path, verifier.token_after(block, path[-1] if path else 0, sampler))
        return acc, verifier.keep(block, acc.path, acc.bonus)

    def _commit(self, tree: DraftTree, block: VerifyBlock, verdict: Verdict, selection: Selection,
                acc: Acceptance, path: list[int], sampler: Sampler, max_commit: int | None) -> list[int]:
        """Hand the kept positions to the drafter, the outcome to the selector and the routing to
        the predictor; returns the tokens committed and keeps the next root's probability."""
        verifier, predictor = self.verifier, self.predictor
        kept = [0] + path
        kept_tokens = [block.tokens[p] for p in kept]
        verifier.commit(kept_tokens, kept, acc.bonus)
        if sampler.params.greedy:
            tree.greedy_next = acc.bonus
        guard.call("selector", self.selector, "observe", tree, selection.nodes, [block.nodes[p - 1] for p in path])
        if predictor is not None:
            guard.call("predictor", predictor, "observe", kept_tokens, verdict.routing[kept])
        tokens = self._truncate(kept_tokens[1:] + [acc.bonus], max_commit)
        bonus_pos = acc.path[-1] if acc.path else 0  # the block position whose logits gave the bonus
        ends_in_bonus = len(tokens) == len(kept_tokens) and path == acc.path  # else the decode ends or diverged
        self.root_prob = verifier.token_prob(block, bonus_pos, acc.bonus, sampler) if ends_in_bonus else None
        return tokens

    def _learn(self, record: CycleRecord) -> None:
        """The finished cycle for the parts that learn from it: the cost model and a live sink from
        measured cycles only, the selector from every one."""
        if self.cost_model is not None and self.verifier.measured:
            guard.call("cost_model", self.cost_model, "observe", record)
        if self.sink is not None and self.verifier.measured:  # a live sink learns a layer's compute time
            self.sink.observe(record.verify_seconds, waited_copy_seconds(record), record.verified + 1)
        guard.call("selector", self.selector, "observe_time", record.levels > 0, record.committed,
                   record.total_seconds)

    def _predictions_needed(self, tree: DraftTree) -> bool:
        """Predict this level's experts unless nothing reads them: a selector that prices levels
        with them always does; otherwise only a prefetcher does, while it says so (with no
        prefetcher they still serve the run's predictor recall)."""
        if self.prefetcher is None or selector_reads_predictions(self.selector):
            return True
        return guard.check_flag("prefetch", self.prefetcher, "needs_predictions",
                                self.sink.call("needs_predictions", tree), "the answer")

    def _truncate(self, tokens: list[int], max_commit: int | None) -> list[int]:
        """At most ``max_commit`` tokens, ending at the first stop token."""
        if max_commit is not None:
            tokens = tokens[:max_commit]
        for i, t in enumerate(tokens):
            if t in self.stop_token_ids:
                return tokens[: i + 1]
        return tokens


def target_prob(logits: torch.Tensor, token: int, sampler: Sampler) -> float:
    """The target's probability of ``token`` given one position's ``logits``: greedy, under the
    softmax; sampling, under the processed distribution the sampler draws from."""
    if sampler.params.greedy:
        return float(torch.softmax(logits.detach().float(), dim=-1)[token])
    return float(sampler.probs(logits)[token])


def cycle_record(tree: DraftTree, block: VerifyBlock, verdict: Verdict, selection: Selection, accepted: int,
                 committed: int, times: CycleTimes, quality: Any) -> CycleRecord:
    """The record of one cycle: its tree, what it verified, accepted and committed, its seconds
    (``times``) and the cache's figures from the pass (``verdict``)."""
    return CycleRecord(
        drafted=len(tree),
        levels=tree.depth,
        verified=len(block) - 1,
        accepted=accepted,
        committed=committed,
        draft_seconds=times.draft_seconds,
        select_seconds=times.select_seconds,
        verify_seconds=times.verify_seconds,
        h2d_seconds=verdict.h2d_seconds,
        h2d_stall_seconds=verdict.h2d_stall_seconds,
        copies_overlap=verdict.copies_overlap,
        stall_measured=verdict.stall_measured,
        total_seconds=times.total_seconds,
        misses=verdict.misses,
        hits=verdict.hits,
        union=verdict.union,
        predicted=dict(selection.predicted),
        prediction=quality,
    )


def no_levels() -> Generator[range, None, None]:
    """The levels of a cycle that does not draft (the selector said so): none."""
    yield from ()


def selector_reads_predictions(selector: Selector) -> bool:
    """A cost-aware selector (``requires`` a predictor) prices every level with the predictions."""
    return "predictor" in selector.requires


def chooses_among_likeliest(selector: Selector) -> bool:
    """The selector verifies only nodes among the tree's ``max_nodes`` likeliest by path
    probability (``chooses_among_likeliest``): the cycle then predicts experts for
    those alone. A level of EAGLE-3's tree holds top_k^2 nodes (100), of which 4-50 enter the
    likeliest 60 on the demo pair's traces; at Qwen3-30B-A3B's 48 x 128 experts the history
    predictor takes 3.5 ms for 100 nodes and 0.7 ms for 20 (docs/results.md)."""
    return guard.check_flag("selector", selector, "chooses_among_likeliest", selector.chooses_among_likeliest,
                            "the attribute")


def should_draft(selector: Selector) -> bool:
    """Selectors may skip drafting for a cycle (``should_draft``): the root alone is verified."""
    answer = guard.call("selector", selector, "should_draft")
    return guard.check_flag("selector", selector, "should_draft", answer, "the answer")


def bind_estimator_target(selector: Any, target: Any) -> None:
    """Give the selector's acceptance estimator (if it owns one) the target: the oracle estimator
    reads a trace replay's recorded outcomes through it; a live target has none, and it says so."""
    if selector.estimator is not None:
        guard.call("acceptance", selector.estimator, "bind_target", target)
