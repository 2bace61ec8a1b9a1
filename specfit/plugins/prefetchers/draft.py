"""Draft-time prefetch (SP-MoE, MoE-SpeQ): the draft is a look-ahead for the verification pass.

After each draft level the predictor has said which experts every node will use; the selector has
said which nodes it would verify now. An expert's benefit is the probability that the pass uses
it: 1 - prod over nodes v of (1 - w_v p_ve), w_v = 1 for the root and the selected nodes (a
verification pass runs every token it verifies, accepted or not) and, before the selector has
chosen any, the path probability of the likeliest nodes; p_ve is the predictor's probability that
e routes v (``tree.expert_probs``), or 1 for its picks where it gives none. Equals are ranked by
how many nodes are expected to use the expert. Weighing picks by the predictor's certainty
(history's frequencies) rather than taking them as sure raised SpecFit's fraction of the oracle
on the held-out demo traces (GPU-like replay) from 0.753 to 0.777, mean of four.
Experts resident or already on their way are skipped. The rest go to the link layer by layer (a
FIFO link: the first layer's copies must land first), most beneficial first, as many as it can
deliver before that layer runs (the drafting still to come, taken as the last level's time, plus
the pass's compute up to the layer, minus what the link has queued) and no more than the layer's
slots not holding an expert the pass is likely to use (a copy evicts one); none at all for a layer
whose expected union exceeds its slots (once every layer's does, the rest of the cycle plans
nothing: EAGLE-3's 60-node selections spent host time on plans that copied nothing; the pass
streams such a layer in rounds and would evict the copies first:
measured on the demo pair with EAGLE-3's trees and 8 slots, 658 prefetches, 547 of them used,
left the misses unchanged, 1432 against 1433, and only added link time; again with pipelined
rounds, which compute resident experts first: 2510 prefetches, 2151 used, 7039 misses against
6816 and 21% more link time, since what they evict was often used too). The request also names
the resident experts the pass is likely to use as ``keep``: the cache may not evict them for the
copies (an LRU's oldest slot may hold one). The cache policy has
the last word (``admit_prefetch``): it never evicts an expert in flight or in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specfit.interfaces import ConfigError, DraftTree, PrefetcherBase, PrefetcherConfig, number, optional_integer


@dataclass
class DraftPrefetcherConfig(PrefetcherConfig):
    name: str = "draft"
    # skip experts the pass uses with a lower probability than this
    min_benefit: float = 0.2
    # the most copies per layer and level (null: bounded by the link and the cache alone)
    max_per_layer: int | None = None
    # with no selection yet (the selector chose the root alone): the nodes of highest path probability to consider
    fallback_nodes: int = 4

    def __post_init__(self) -> None:
        check_draft_settings(self.min_benefit, self.max_per_layer)
        if self.fallback_nodes < 0:
            raise ConfigError(f"prefetch.fallback_nodes={self.fallback_nodes} must be >= 0")


def check_draft_settings(min_benefit: float, max_per_layer: int | None) -> None:
    """The draft prefetch's settings (``prefetch=draft`` and ``auto`` share them), one line naming the key."""
    number("prefetch.min_benefit", min_benefit, minimum=0.0, maximum=1.0)
    optional_integer("prefetch.max_per_layer", max_per_layer, minimum=1)


class DraftPrefetcher(PrefetcherBase):
    """Prefetches the experts the draft predicts for the nodes most likely to be verified."""

    name = "draft"
    Config = DraftPrefetcherConfig

    def __init__(self, min_benefit: float = 0.2, max_per_layer: int | None = None, fallback_nodes: int = 4) -> None:
        check_draft_settings(min_benefit, max_per_layer)
        self.min_benefit, self.max_per_layer, self.fallback_nodes = min_benefit, max_per_layer, fallback_nodes
        self._tree_id: int | None = None
        self._saturated = False  # this cycle's pass was expected to overflow every layer's slots
        self._last_level_at = 0.0
        self._level_seconds = 0.0  # drafting time of one level (the last one measured)

    def after_level(self, tree: DraftTree, predicted: Sequence[int], resident: np.ndarray) -> None:
        plan, useful = self._plan(tree, predicted, resident)
        for layer, experts in plan:
            # the resident experts the pass is likely to use are kept: the cache may not evict them
            # for these copies (its least recent slot may hold one)
            self.sink.prefetch(layer, experts, keep=useful[layer])

    def needs_predictions(self, tree: DraftTree) -> bool:
        """Not once this cycle's pass is expected to overflow every layer's slots: nothing more is
        planned for it (measured, EAGLE-3 + prefetch on the demo pair: predicting its ~60-node levels
        for plans that copy nothing made it slower than EAGLE-3 without prefetch)."""
        return not (self._saturated and id(tree) == self._tree_id)

    def plan(self, tree: DraftTree, predicted: Sequence[int], resident: np.ndarray) -> list[tuple[int, list[int]]]:
        """[(layer, experts most beneficial first)], layers ascending, within the link's budget."""
        return self._plan(tree, predicted, resident)[0]

    def _plan(self, tree: DraftTree, predicted: Sequence[int],
              resident: np.ndarray) -> tuple[list[tuple[int, list[int]]], list[list[int]]]:
        """:meth:`plan`, and per layer the experts already present that the pass is likely to use."""
        sink = self.sink
        now = sink.now()
        if id(tree) != self._tree_id or tree.depth <= 1:  # a new cycle: the level's time from the last one
            self._tree_id, self._saturated = id(tree), False
        else:
            self._level_seconds = max(now - self._last_level_at, 0.0)
        self._last_level_at = now
        if self._saturated:  # a deeper level's selection rarely verifies less: no layer is expected to have room
            return [], []
        expected = expected_use(tree, predicted, self.fallback_nodes, *resident.shape)
        if expected is None:
            return [], []  # no predictor: nothing is known of the experts
        benefit, weight = expected
        arriving = sink.arriving()
        present = resident if arriving is None else np.isfinite(arriving)
        # a copy evicts some resident expert: only as many as the layer has slots not holding an
        # expert the pass is likely to use
        slots = sink.capacity()
        useful_present = present & (benefit >= self.min_benefit)
        useful = [np.flatnonzero(row).tolist() for row in useful_present]
        room_in_cache = slots - useful_present.sum(axis=1)
        # a layer whose pass is expected to use more experts than it has slots streams them through
        # in rounds: what a prefetch copies is evicted again before it is used, so leave it alone
        overflowing = benefit.sum(axis=1) > slots
        room_in_cache[overflowing] = 0
        if overflowing.all() and len(predicted) > 0:  # EAGLE-3's trees: nothing to plan for the rest of the cycle
            self._saturated = True
        benefit = np.where(present, 0.0, benefit)
        expert_s = sink.expert_seconds()
        layer_s = sink.layer_seconds(len(predicted) + 1)
        queued = sink.link_free_in()
        lead = self._level_seconds  # the drafting still to come, if the selector goes on
        eligible = (benefit >= self.min_benefit) & (benefit > 0)
        plan, issued = [], 0
        # only layers with an expert worth copying and room for it (a layer left out takes nothing)
        for layer in np.flatnonzero(eligible.any(axis=1) & (room_in_cache > 0)).tolist():
            candidates = np.flatnonzero(eligible[layer])
            order = np.lexsort((-weight[layer, candidates], -benefit[layer, candidates]))  # likeliest, then used by most nodes
            take = candidates[order[: int(room_in_cache[layer])]].tolist()
            if self.max_per_layer is not None:
                take = take[: self.max_per_layer]
            if expert_s > 0:  # what lands before this layer of the pass runs
                deadline = lead + layer * layer_s
                room = int(np.floor((deadline - queued) / expert_s + 1e-9)) - issued
                take = take[: max(room, 0)]
            if take:
                plan.append((layer, take))
                issued += len(take)
        return plan, useful


def expected_use(tree: DraftTree, nodes: Sequence[int], fallback: int, layers: int,
                 experts: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The predicted experts of the verification pass, [layers, experts] each: the probability it
    uses each one, and the expected number of nodes using it (the root counts as all of them), to
    rank equals. None without predictions.

    A node is verified with probability w_v: 1 for the root and the selected nodes (they are
    verified whatever the target accepts), a fallback node's path probability otherwise (the
    fallback nodes are the likeliest, whose experts the cycle predicts while ``fallback`` is at most
    the selectable ``max_nodes``; beyond that their rows are unpredicted and add nothing). Given that
    it is verified it uses expert e with probability p_ve: the predictor's ``tree.expert_probs``
    where it gives them, else 1 for its picks and 0 for the rest. The pass uses e with probability
    1 - prod_v (1 - w_v p_ve)."""
    if tree.root_experts is None and tree.experts is None:
        return None
    log_miss = np.zeros((layers, experts))  # log of the probability that no node uses the expert
    weight = np.zeros((layers, experts))
    chosen = list(nodes) if len(nodes) else (tree.top_by_path_prob(fallback) if fallback and len(tree) else [])
    if tree.experts is not None and chosen:
        rows = np.asarray([v for v in chosen if v < tree.experts.shape[0]], dtype=np.int64)
        if rows.size:
            if len(nodes):
                weights = np.ones(rows.size)
            else:
                weights = np.exp(np.asarray(tree.path_log_probs, dtype=np.float64)[rows])
            uses = weights[:, None, None] * _node_use(tree.experts[rows], _prob_rows(tree.expert_probs, rows), experts)
            known = min(layers, uses.shape[1])  # a prediction of fewer layers says nothing of the rest
            log_miss[:known] += np.log1p(-np.minimum(uses[:, :known], 1 - 1e-12)).sum(axis=0)
            weight[:known] += uses[:, :known].sum(axis=0)
    use = 1.0 - np.exp(log_miss)
    if tree.root_experts is not None:  # the root is verified in every pass
        probs = tree.root_expert_probs[None] if tree.root_expert_probs is not None else None
        root_use = _node_use(np.asarray(tree.root_experts)[None], probs, experts)[0][:layers]
        known = root_use.shape[0]
        use[:known] = 1.0 - (1.0 - use[:known]) * (1.0 - root_use)
        weight[:known] += (len(chosen) + 1) * root_use
    return use, weight


def _prob_rows(probs: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    """``probs[rows]``, with NaN (not predicted) for rows beyond the array; None without it."""
    if probs is None:
        return None
    out = np.full((len(rows), *probs.shape[1:]), np.nan, dtype=np.float32)
    inside = rows < len(probs)
    out[inside] = probs[rows[inside]]
    return out


def _node_use(picks: np.ndarray, probs: np.ndarray | None, experts: int) -> np.ndarray:
    """[n, layers, experts]: the probability each node uses each expert, given it is verified:
    ``probs`` where the predictor gave them (NaN rows fall back to the picks), else its picks."""
    use = np.zeros((*picks.shape[:2], experts))
    n, layer, _ = np.nonzero(picks >= 0)
    use[n, layer, picks[picks >= 0]] = 1.0
    if probs is not None:
        probs = probs[:, : picks.shape[1]]
        use = np.where(np.isnan(probs), use, probs)
    return use
