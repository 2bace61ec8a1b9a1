"""The look-ahead's per-token expert table: counts per token id, scored against the router's picks,
taken only where it has recalled a layer's experts better lately."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

import specfit
from specfit import Engine
from specfit.plugins._kit.token_experts import TokenExperts
from specfit.errors import ConfigError
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher


def test_counts_per_token_and_unseen_tokens_leave_it_to_the_router() -> None:
    table = TokenExperts(layers=2, experts=8)
    table.learn(0, [3, 5, 3], np.array([[1, 2], [4, 6], [1, 7]]))
    counts = table.scores(0, [3])
    assert counts is not None and counts[0].tolist() == [0, 2, 1, 0, 0, 0, 0, 1]
    assert table.scores(0, [3, 9]) is None  # token 9 unseen: no table picks for the pass
    assert table.scores(1, [3]) is None  # nothing learnt for layer 1


def test_the_table_is_preferred_only_after_recalling_better() -> None:
    table = TokenExperts(layers=1, experts=8, decay=0.5)
    assert not table.preferred(0)  # unscored
    table.judge(0, [1, 2], table_picks=[1, 2], router_picks=[1, 5])
    assert table.preferred(0)
    for _ in range(3):  # the router recalls better from then on: the preference follows
        table.judge(0, [1, 2], table_picks=[6, 7], router_picks=[1, 2])
    assert not table.preferred(0)


def test_lookahead_learns_and_scores_the_table_in_decoding() -> None:
    prefetcher = LookaheadPrefetcher(gate=False)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), copy="emulated", prefetcher=prefetcher, max_new_tokens=12)
    plain = Engine(tiny_model(), cache=LRUCache(capacity=3), max_new_tokens=12)
    prompt = [5, 17, 99, 5, 17, 99, 5, 17]
    for _ in range(2):
        assert engine.generate(prompt).token_ids == plain.generate(prompt).token_ids  # lossless
    table = prefetcher.table
    assert table is not None and table.layers == 2
    assert {5, 17, 99} <= set(table.counts[0]) and {5, 17, 99} <= set(table.counts[1])
    assert np.isfinite(table.recall).all()  # both predictors scored on both layers
    counted = table.scores(0, [5])
    assert counted is not None and counted.sum() > 0


def test_token_table_off_and_bad_values() -> None:
    prefetcher = LookaheadPrefetcher(token_table=0)
    Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=prefetcher)
    assert prefetcher.table is None
    with pytest.raises(ConfigError, match="prefetch.token_table=-1 must be an integer >= 0"):
        specfit.build(specfit.compose(["model=tiny", "prefetch=auto", "prefetch.token_table=-1"]))
    with pytest.raises(ConfigError, match="prefetch.token_table='2' must be an integer"):
        LookaheadPrefetcher(token_table="2")  # type: ignore[arg-type]


def test_a_one_token_pass_takes_the_tables_picks_where_preferred() -> None:
    """With the table preferred for layer 0, the picks asked for layer 0 are the table's counts."""
    prefetcher = LookaheadPrefetcher(gate=False)
    Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=prefetcher)
    table = prefetcher.table
    table.learn(0, [7], np.array([[2, 3]]))
    table.recall[0] = (1.0, 0.0)
    prefetcher._ids = [7]
    scores = torch.zeros(1, table.experts)
    scores[0, 5] = 1.0  # the router would pick expert 5 first
    by_router = torch.topk(scores, 2).indices
    picked = prefetcher._table_or(0, by_router)
    assert sorted(picked[0].tolist()) == [2, 3]
    wider = torch.topk(scores, 4).indices  # more than the token was seen with: the router's next picks fill up
    assert prefetcher._table_or(0, wider)[0].tolist()[2:] == [e for e in wider[0].tolist() if e not in (2, 3)][:2]
    assert prefetcher._judged[0][1][0] == 5  # both rankings are kept to be scored when layer 0 routes
    table.recall[0] = (0.0, 1.0)  # the router has done better lately: its ranking stands
    assert prefetcher._table_or(0, by_router) is by_router


def test_the_tables_picks_in_tree_and_prompt_passes_stay_lossless() -> None:
    """With the table preferred on its layers from the start, every pass it has seen all tokens of
    (prompts again, verification trees) takes the table's picks; the output is still the target's."""
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    class TablePreferred(LookaheadPrefetcher):
        def _table_or(self, layer: int, ranked: torch.Tensor) -> torch.Tensor:
            self.table.recall[layer] = (1.0, 0.0)  # whatever the scores say
            picked = super()._table_or(layer, ranked)
            self.used += picked is not ranked
            return picked

    prefetcher = TablePreferred(gate=False)
    prefetcher.used = 0
    engine = Engine(tiny_model(), drafter=Eagle3Drafter(path="random"), cache=LRUCache(capacity=3), copy="emulated",
                    prefetcher=prefetcher, max_new_tokens=10)
    plain = Engine(tiny_model(), cache=LRUCache(capacity=3), max_new_tokens=10)
    prompt = [5, 17, 99, 5, 17, 99, 5, 17]
    for _ in range(2):
        assert engine.generate(prompt).token_ids == plain.generate(prompt).token_ids
    assert prefetcher.used > 0
