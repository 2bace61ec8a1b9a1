"""The n-gram (prompt lookup) drafter: what it drafts, what it learns, and that output stays identical."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

import specfit
from specfit import Engine
from specfit.types.costs import CostConstants
from specfit.types.tree import DraftTree
from specfit.errors import ConfigError
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.drafters.ngram import NgramDrafter
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.eagle3 import TopByPathProbSelector
from specfit.plugins.selectors.specfit import SpecFitSelector
from specfit.registry import get_plugins

# a prompt that repeats itself, so the drafter finds matches from the first cycle
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 5, 17, 99, 3, 42, 8, 120, 77, 5, 17, 99]


def drafted(drafter: NgramDrafter) -> DraftTree:
    tree = DraftTree(root_token=drafter.context.tokens[-1] if drafter.context.tokens else 0)
    for _ in drafter.draft(tree):
        pass
    return tree


def test_drafts_the_continuation_of_the_longest_match_as_a_chain():
    drafter = NgramDrafter(depth=5)
    drafter.start([1, 2, 3, 4, 1, 2, 3], None, 4)  # ... 1 2 3 4 | root 4 follows (1, 2, 3) again
    tree = drafted(drafter)
    assert tree.tokens == [1, 2, 3, 4, 1] and tree.parents == [-1, 0, 1, 2, 3]
    assert tree.log_probs == pytest.approx([math.log(0.5)] * 5)  # nothing learned yet: 1/2
    assert len(drafted(NgramDrafter(depth=2)).tokens) == 0  # a fresh drafter has no context
    alone = NgramDrafter(depth=3)
    alone.start([7, 8, 9], None, 10)  # no n-gram repeats: no draft, the cycle is a plain pass
    assert len(drafted(alone)) == 0
    strict = NgramDrafter(depth=3, min_match=8)
    strict.start([1, 2, 3, 4, 1, 2, 3], None, 4)  # its longest repeat is 4 tokens: too short
    assert drafted(strict).tokens == []


def test_learns_how_often_each_match_length_is_accepted():
    drafter = NgramDrafter(depth=3)
    drafter.start([1, 2, 3, 4, 1, 2, 3], None, 4)
    tree = drafted(drafter)
    # 1 and 2 continue the 4-gram before them, 3 the 6-gram (1, 2, 3, 4, 1, 2)
    assert tree.tokens == [1, 2, 3] and drafter._chain == [(1, 4), (2, 4), (3, 6)]
    drafter.commit([4, 1], None, 9)  # the target kept 1, then produced 9 where 2 was drafted
    assert drafter._tried[4] == 2 and drafter._accepted[4] == 1 and drafter._tried[6] == 0
    assert drafter.acceptance(4) == pytest.approx(2 / 4) and drafter.acceptance(6) == pytest.approx(1 / 2)
    assert drafter._chain == [] and drafter.context.tokens[-2:] == [1, 9]
    drafter.commit([9], None, 5)  # a cycle that did not draft settles nothing
    assert sum(drafter._tried.values()) == 2
    drafter.start([1, 2, 1, 2], None, 1)
    used = set()
    for _ in range(3):
        tree = drafted(drafter)  # 2, 1, 2, ...: the loop continues
        used |= {n for _, n in drafter._chain}
        drafter.commit([tree.root_token, *tree.tokens[:2]], None, tree.tokens[2])  # all three accepted
    assert all(drafter.acceptance(n) > 0.5 for n in used if n != 4)  # 4 also lost once above


@pytest.mark.parametrize("bad, key", [("drafter.depth=0", "drafter.depth"), ("drafter.depth=65", "drafter.depth"),
                                      ("drafter.min_match=1", "drafter.min_match"),
                                      ("drafter.min_match=9", "drafter.min_match"),
                                      ("drafter.min_match=5", "drafter.min_match")])  # not an indexed length
def test_bad_settings_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        specfit.compose(["model=tiny", "drafter=ngram", bad])


def test_is_a_registered_drafter_with_presets():
    assert get_plugins()["drafter"].get("ngram").cls is NgramDrafter
    presets = specfit.compose(["model=tiny"]).method_presets
    assert "drafter=ngram" in presets["ngram"] and "selector=specfit" in presets["specfit_ngram"]


def reference(n: int = 40) -> list[int]:
    with torch.no_grad():
        return tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()


@pytest.mark.parametrize("cache", [lambda: LRUCache(capacity=3), NoCache], ids=["lru", "none"])
@pytest.mark.parametrize("selector", ["top_by_path_prob", "specfit"])
def test_greedy_output_is_identical_to_generate(cache, selector):
    ref = reference()
    parts = {"top_by_path_prob": dict(selector=TopByPathProbSelector()),
             "specfit": dict(selector=SpecFitSelector(draft_gate=False), predictor=HistoryPredictor(),
                             cost_model=UnionCostModel(constants=CostConstants(1e-3, 1e-5, 1e-5, 1e-6)))}[selector]
    engine = Engine(tiny_model(), cache=cache(), drafter=NgramDrafter(depth=4), device="cpu", **parts)
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == ref[len(PROMPT):][:30]
    assert sum(c.levels for c in out.cycles) > 0  # it drafted
    assert out.stats["spec_decode_acceptance_length"] > 1.0  # and the target accepted some of it


def test_sampling_keeps_the_targets_distribution():
    """Seed for seed, sampling with prompt-lookup drafts gives AR's tokens (each an exact draw from
    the target's distribution, see test_speculative.sampled_like_ar). The prompt holds (last token,
    x, y) for every x the target may sample first, so every decode drafts after its first token."""
    from specfit.decode.sampling import SamplingParams

    prompt = _prompt_that_drafts_after_every_likely_token(top_k=6)
    ar = Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu")
    ngram = Engine(tiny_model(), cache=LRUCache(capacity=3), drafter=NgramDrafter(depth=3),
                   selector=TopByPathProbSelector(), device="cpu")  # verifies every draft
    drafts = accepted = 0
    for seed in range(60):
        params = SamplingParams(temperature=0.8, top_k=6, seed=seed)
        out = ngram.generate(prompt, 4, params)
        assert out.token_ids == ar.generate(prompt, 4, params).token_ids, f"seed {seed}"
        drafts += sum(c.verified for c in out.cycles)
        accepted += out.stats["accepted_tokens"]
    assert drafts > 60 and accepted > 8  # decodes verified drafted tokens, and the target took some


def _prompt_that_drafts_after_every_likely_token(top_k: int) -> list[int]:
    """A prompt ending in token a, in which (a, x, y) occurred for each of the target's top_k first
    tokens x: the drafter then finds a match whatever x is sampled, and drafts y, the target's own
    greedy token after (prompt, x), so drafts are often accepted."""
    model, a, covered, follow = tiny_model(), 7, [], {}

    def build() -> list[int]:
        return [t for x in covered for t in (a, x, follow.get(x, (x * 31 + 11) % 256))] + [a]

    for _ in range(10):
        with torch.no_grad():
            prompt = build()
            top = model(torch.tensor([prompt])).logits[0, -1].topk(top_k).indices.tolist()
            if set(top) <= set(covered):
                return prompt
            covered += [x for x in top if x not in covered]
            after = model(torch.tensor([build() + [x] for x in covered])).logits[:, -1].argmax(-1)
            follow = dict(zip(covered, after.tolist()))
    raise AssertionError("the target's likely first tokens did not settle")
