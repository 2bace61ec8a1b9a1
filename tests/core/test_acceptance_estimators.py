"""Acceptance estimators: a plug-in kind (group, alias, registry), what they estimate and learn,
that decoding stays exact with each, their scores, and the per-setup state of selectors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter
from scipy.stats import chisquare

from specfit import Engine
from specfit.config import compose
from specfit.decode.acceptance import accept
from specfit.types.acceptance import SettledTree, conditional, greedy_settled, score, settled
from specfit.api import build_selector
from specfit.types.costs import CostConstants
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.calibrate.setup_state import attach_setup_state, state_path
from specfit.types.tree import DraftTree, greedy_outcomes, verify_block
from specfit.errors import ConfigError
from specfit.plugins.acceptance.calibrated import CalibratedAcceptance
from specfit.plugins.acceptance.learned import FEATURES, LearnedAcceptance, exclusive, features, initial_weights, map_weights
from specfit.plugins.acceptance.path_prob import PathProbAcceptance
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.specfit import SpecFitSelector
from specfit.registry import get_plugins

ESTIMATORS = ["path_prob", "calibrated", "learned"]
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4)
SPECFIT = ["model=tiny", "selector=specfit", "cost_model=union", "predictor=history"]


def random_tree(rng: np.random.Generator, vocab: int = 6, top_k: int = 3, depth: int = 4, beam: int = 3) -> DraftTree:
    """An EAGLE-like tree: top_k children per expanded node, the best ``beam`` nodes of a level expanded."""
    tree = DraftTree(root_token=0)
    level = tree.add_level([-1] * top_k, rng.integers(0, vocab, top_k).tolist(),
                           np.log(rng.dirichlet(np.ones(top_k + 1))[:top_k]).tolist())
    for _ in range(depth - 1):
        best = sorted(level, key=lambda v: -tree.path_log_probs[v])[:beam]
        parents = [p for p in best for _ in range(top_k)]
        q = np.log(rng.dirichlet(np.ones(top_k + 1), size=len(best))[:, :top_k]).ravel()
        level = tree.add_level(parents, rng.integers(0, vocab, len(parents)).tolist(), q.tolist())
    return tree


def settled_tree(rng: np.random.Generator, p_top: float) -> SettledTree:
    """A greedy pass over a random tree whose target accepts a parent's most likely child with
    probability ``p_top`` and any other child never, whatever q says (so q is a poor guide)."""
    tree = random_tree(rng, vocab=1000)
    path, parent = [], -1
    while True:
        kids = [v for v in range(len(tree)) if tree.parents[v] == parent]
        if not kids or rng.random() >= p_top:
            tree.greedy_next = 999_999  # the target's token matches no child
            break
        best = max(kids, key=lambda v: (tree.log_probs[v], -v))
        path.append(best)
        parent = best
    return SettledTree(tree, verified=[], accepted=path)


# --------------------------------------------------------------------------- the plug-in kind


def test_estimators_are_registered_and_listed(capsys):
    from specfit.commands.plugins import run

    names = sorted(e.name for e in get_plugins().entries() if e.kind == "acceptance")
    assert names == ["calibrated", "learned", "oracle", "path_prob"]
    run()
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {line[1] for line in lines if line[0] == "acceptance"} == set(names)


def selector_for(cfg):
    return build_selector(cfg.selector, cfg.get("acceptance"))


def test_the_acceptance_group_reaches_the_selector_with_its_settings(capsys):
    selector = selector_for(compose([*SPECFIT, "acceptance=learned", "acceptance.prior_strength=5"]))
    assert isinstance(selector.estimator, LearnedAcceptance) and selector.estimator.prior_strength == 5
    assert isinstance(selector_for(compose(SPECFIT)).estimator, PathProbAcceptance)  # the default
    eagle3 = selector_for(compose(["model=tiny", "acceptance=learned"]))  # ignored: no estimates used
    assert eagle3.estimator is None
    assert "note: acceptance=learned is not used by selector=eagle3" in capsys.readouterr().err  # said, not silent
    assert "acceptance=calibrated" in compose([]).method_presets["specfit_calibrated"]


def test_selector_acceptance_is_the_earlier_spelling_of_the_group():
    assert isinstance(selector_for(compose([*SPECFIT, "selector.acceptance=calibrated"])).estimator, CalibratedAcceptance)
    agreeing = selector_for(compose([*SPECFIT, "selector.acceptance=learned", "acceptance=learned"]))
    assert isinstance(agreeing.estimator, LearnedAcceptance)
    with pytest.raises(ConfigError, match="selector.acceptance=calibrated and acceptance=learned disagree"):
        selector_for(compose([*SPECFIT, "selector.acceptance=calibrated", "acceptance=learned"]))
    with pytest.raises(ConfigError, match="selector.acceptance='foo'.*built in: calibrated, learned, oracle, path_prob"):
        SpecFitSelector(acceptance="foo")
    with pytest.raises(ConfigError, match="selector.acceptance='foo'.*registered: calibrated, learned, oracle, path_prob"):
        selector_for(compose([*SPECFIT, "selector.acceptance=foo"]))
    with pytest.raises(ConfigError, match="acceptance"):
        compose([*SPECFIT, "acceptance=foo"])
    with pytest.raises(ConfigError, match="acceptance.forget"):
        selector_for(compose([*SPECFIT, "acceptance=learned", "acceptance.forget=2"]))


# --------------------------------------------------------------------------- what they estimate


def test_an_untrained_learned_estimator_is_path_prob():
    rng = np.random.default_rng(0)
    for _ in range(5):
        tree = random_tree(rng)
        np.testing.assert_allclose(LearnedAcceptance().estimate(tree), tree.path_probs(), rtol=1e-5)


def test_siblings_compete_for_their_parent_so_their_estimates_never_promise_more_than_one():
    """At most one child of a node is accepted: whatever the weights, the conditional estimates of
    siblings sum to at most 1 (independent sigmoids of the same weights exceed it)."""
    rng = np.random.default_rng(3)
    tree = random_tree(rng, depth=3)
    learned = LearnedAcceptance()
    learned.weights = initial_weights()
    learned.weights[FEATURES.index("bias")] = 4.0  # confident of every child
    conditional = learned.conditional_estimate(tree)
    parents = np.asarray(tree.parents) + 1
    sums = np.bincount(parents, weights=conditional)[np.unique(parents)]
    assert np.all(sums <= 1.0 + 1e-12) and sums.max() > 0.9
    z = features(tree, learned.recent, learned.root_logit(tree), token_rate=learned.token_rates) @ learned.weights
    independent = 1 / (1 + np.exp(-z))
    assert np.bincount(parents, weights=independent).max() > 1.5


def test_the_competing_fit_recovers_its_weights_and_is_the_logistic_fit_for_only_children():
    rng = np.random.default_rng(4)
    true_w = np.array([-1.0, 2.0, 0.5])
    groups = np.repeat(np.arange(3000), 3)
    x = np.c_[np.ones(len(groups)), rng.normal(size=(len(groups), 2))]
    p = exclusive(x @ true_w, groups)
    y = np.zeros(len(groups))
    for g in range(3000):  # one child of each group or none, with the model's probabilities
        pick = rng.choice(4, p=np.r_[p[3 * g:3 * g + 3], 1 - p[3 * g:3 * g + 3].sum()])
        if pick < 3:
            y[3 * g + pick] = 1.0
    fitted = map_weights(x, y, np.zeros(3), 1e-3 * np.eye(3), 25, groups)
    np.testing.assert_allclose(fitted, true_w, atol=0.15)
    alone = map_weights(x, y, np.zeros(3), np.eye(3), 25, np.arange(len(y)))
    np.testing.assert_allclose(alone, map_weights(x, y, np.zeros(3), np.eye(3), 25), atol=1e-9)
    np.testing.assert_allclose(exclusive(x @ true_w), 1 / (1 + np.exp(-(x @ true_w))), atol=1e-12)


def test_a_sampled_pass_teaches_only_through_sibling_sets_it_verified_whole():
    """After a sampled pass only verified nodes are settled. The model's denominator holds every
    drafted sibling, so a set verified in part is not learned from (it would bias the estimates
    down: the target's acceptance of the top child does not depend on which siblings were
    verified); a set verified whole is."""
    rng = np.random.default_rng(6)
    partial, whole = LearnedAcceptance(), LearnedAcceptance()
    for _ in range(50):
        tree = random_tree(rng)
        top = [v for v in tree.level(1) if tree.log_probs[v] == max(tree.log_probs[u] for u in tree.level(1))][:1]
        partial.observe(tree, verified=top, accepted=top)  # greedy_next is None: a sampled pass
        whole.observe(tree, verified=list(tree.level(1)), accepted=top)
    np.testing.assert_array_equal(partial.weights, initial_weights())
    assert not np.allclose(whole.weights, initial_weights())


def test_learning_from_the_features_estimate_built_equals_learning_from_scratch():
    """observe reuses the features estimate computed for the same tree in the cycle."""
    rng = np.random.default_rng(5)
    reusing, fresh = LearnedAcceptance(), LearnedAcceptance()
    for _ in range(20):
        item = settled_tree(rng, p_top=0.7)
        reusing.estimate(item.tree)
        reusing.observe(item.tree, item.verified, item.accepted)
        fresh.observe(item.tree, item.verified, item.accepted)
    np.testing.assert_allclose(reusing.weights, fresh.weights, rtol=1e-12, atol=1e-12)
    assert reusing.recent == fresh.recent


def test_learned_estimates_per_level_equal_the_whole_tree_and_never_rise_with_depth():
    rng = np.random.default_rng(1)
    full = random_tree(rng, depth=5)
    learned = LearnedAcceptance()
    learned.weights = rng.normal(size=len(FEATURES))
    grown = DraftTree(root_token=0)
    for d in range(1, full.depth + 1):
        part = full.level(d)
        grown.add_level(full.parents[part.start:part.stop], full.tokens[part.start:part.stop],
                        full.log_probs[part.start:part.stop])
        step = learned.estimate(grown)  # computed for the new level only
    fresh = LearnedAcceptance()
    fresh.weights = learned.weights
    np.testing.assert_allclose(step, fresh.estimate(full))
    parents = np.asarray(full.parents)
    has_parent = parents >= 0
    assert np.all(step[has_parent] <= step[parents[has_parent]] + 1e-12)


def test_vectorised_greedy_outcomes_equal_the_reference():
    rng = np.random.default_rng(2)
    for _ in range(200):
        tree = random_tree(rng, vocab=3, top_k=int(rng.integers(1, 4)), depth=int(rng.integers(1, 5)))
        path, parent = [], -1
        while True:
            kids = [v for v in range(len(tree)) if tree.parents[v] == parent]
            if not kids or rng.random() < 0.3:
                break
            parent = kids[int(rng.integers(len(kids)))]
            path.append(parent)
        tree.greedy_next = int(rng.integers(0, 3))
        np.testing.assert_array_equal(greedy_settled(tree, path), greedy_outcomes(tree, path))


def test_conditional_samples_are_the_children_of_accepted_nodes():
    tree = DraftTree(root_token=0)
    tree.add_level([-1, -1], [1, 2], [-0.1, -2.0])
    tree.add_level([0, 0, 1], [3, 4, 5], [-0.2, -1.0, -0.1])
    tree.greedy_next = 7
    nodes, hit = conditional(tree, [], [0])  # node 0 accepted, then the target wants 7: no child matches
    assert nodes.tolist() == [0, 1, 2, 3] and hit.tolist() == [True, False, False, False]
    nodes, hit = settled(tree, [], [0])  # unconditionally node 4 (below a rejected node) is settled too
    assert nodes.tolist() == [0, 1, 2, 3, 4] and hit.tolist() == [True, False, False, False, False]


def test_learned_beats_path_prob_where_q_is_a_poor_guide():
    """The target accepts the top-ranked child 70% of the time, q notwithstanding: learned (online,
    from scratch) and calibrated must score better than path_prob on the same trees."""
    rng = np.random.default_rng(3)
    trees = [settled_tree(rng, 0.7) for _ in range(300)]
    scores = {name: score(make(), trees) for name, make in
              (("path_prob", PathProbAcceptance), ("calibrated", CalibratedAcceptance), ("learned", LearnedAcceptance))}
    assert scores["learned"].brier < 0.8 * scores["path_prob"].brier
    assert scores["learned"].log_loss < scores["path_prob"].log_loss
    assert scores["learned"].log_loss < scores["calibrated"].log_loss
    assert scores["path_prob"].nodes == scores["learned"].nodes > 1000
    offline = LearnedAcceptance()
    assert offline.fit_trees(trees[:200]) > 200
    held_out = score(offline, trees[200:], learn=False)
    assert held_out.brier < score(PathProbAcceptance(), trees[200:]).brier
    rows = held_out.as_dict()["acceptance_reliability"]
    assert sum(n for _, _, n in rows) == held_out.nodes and all(0 <= f <= 1 and 0 <= o <= 1 for f, o, _ in rows)


def test_learned_state_round_trips_and_bad_states_are_refused_or_ignored(tmp_path):
    rng = np.random.default_rng(4)
    trained = LearnedAcceptance()
    for _ in range(50):
        item = settled_tree(rng, 0.6)
        trained.observe(item.tree, item.verified, item.accepted)
    tree = random_tree(rng)
    restored = LearnedAcceptance()
    restored.load_state(json.loads(json.dumps(trained.state())))
    np.testing.assert_allclose(restored.estimate(tree), trained.estimate(tree))
    ignored = LearnedAcceptance()
    ignored.load_state({**trained.state(), "features": ["other"]})
    np.testing.assert_allclose(ignored.estimate(tree), tree.path_probs(), rtol=1e-5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"state": {**trained.state(), "weights": [1.0, "x"]}}))
    with pytest.raises(ConfigError, match=f"acceptance.state_file={bad}: weights"):
        LearnedAcceptance(state_file=str(bad)).bind(None)
    with pytest.raises(ConfigError, match="no such file"):
        LearnedAcceptance(state_file=str(tmp_path / "missing.json")).bind(None)
    with pytest.raises(ConfigError, match=r"is a directory, not a file .*acceptance.state_file=.*learned.json"):
        LearnedAcceptance(state_file=str(tmp_path)).bind(None)  # fit-acceptance's out_dir, not its file
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"state": trained.state()}))
    from_file = LearnedAcceptance(state_file=str(good))
    from_file.bind(None)
    np.testing.assert_allclose(from_file.estimate(tree), trained.estimate(tree))


# --------------------------------------------------------------------------- decoding stays exact


def reference(n=30):
    with torch.no_grad():
        return tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()


def engine_with(name: str, ref: list[int], **selector_kwargs) -> Engine:
    return Engine(tiny_model(), drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=4, miss=0.2),
                  selector=SpecFitSelector(acceptance=name, **selector_kwargs),
                  cost_model=UnionCostModel(constants=CONSTANTS), predictor=HistoryPredictor(), device="cpu")


@pytest.mark.parametrize("name", ESTIMATORS)
def test_greedy_output_is_identical_with_every_estimator(name):
    ref = reference()
    engine = engine_with(name, ref, draft_gate=False)
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["accepted_tokens"] > 0 and engine.selector.acceptance_score.nodes > 0


@pytest.mark.parametrize("name", ESTIMATORS)
def test_seeded_sampling_gives_the_same_tokens_with_every_estimator(name):
    """Keyed sampling: a token depends on the seed and its position only, so whatever subtree an
    estimator makes the selector verify, the output equals autoregressive sampling's."""
    ref = reference()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    plain = Engine(tiny_model(), device="cpu").generate(PROMPT, 20, params).token_ids
    out = engine_with(name, ref, draft_gate=False).generate(PROMPT, 20, params)
    assert out.token_ids == plain and out.stats["cycles"] < 20  # drafts were accepted


VOCAB = 6
TARGET = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_the_acceptance_rule_keeps_the_target_distribution_on_what_each_estimator_selects(name):
    """The statistical check of tests/core/test_sampling.py on the block each estimator's a_v
    selects (the nodes with a_v >= 0.05 of a tree over 6 tokens; learned trained first)."""
    rng = np.random.default_rng(5)
    estimator = get_plugins()["acceptance"].get(name).cls()
    for _ in range(30):
        item = settled_tree(rng, 0.7)
        estimator.observe(item.tree, item.verified, item.accepted)
    tree = DraftTree(root_token=0)
    tree.add_level([-1, -1, -1, -1], [3, 1, 3, 5], np.log([0.4, 0.3, 0.2, 0.05]).tolist())
    tree.add_level([1, 0], [4, 2], np.log([0.5, 0.3]).tolist())
    a = estimator.estimate(tree)
    block = verify_block(tree, [v for v in range(len(tree)) if a[v] >= 0.05])
    logits = torch.stack([TARGET] * len(block))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts = np.zeros(VOCAB)
    for trial in range(4000):
        sampler.position = 2 * trial
        acc = accept(block, logits, sampler)
        counts[block.tokens[acc.path[0]] if acc.path else acc.bonus] += 1
    expected = TARGET.double().softmax(-1).numpy() * counts.sum()
    assert len(block) > 2 and chisquare(counts, expected).pvalue > 1e-3


# --------------------------------------------------------------------------- per-setup state


def test_a_new_engine_of_the_setup_starts_from_the_gate_and_estimator_it_left():
    ref = reference()
    first = engine_with("learned", ref)
    keeper = attach_setup_state(first)
    assert keeper is not None and keeper in first.listeners
    first.generate(PROMPT, max_new_tokens=20)
    gate = first.selector.gate
    gate.skip_left, gate.backoff = 4, 8  # as if drafting had lost: the next cycles skip it
    keeper.save()  # saved after a decode (at most every SAVE_INTERVAL seconds), and when the selector goes
    stored = json.loads(state_path(first).read_text())
    assert stored["gate"]["specfit/learned/measured"]["skip_left"] == 4 and "learned" in stored["acceptance"]

    second = engine_with("learned", ref)
    assert attach_setup_state(second) is not None
    assert second.selector.gate.state() == gate.state()
    np.testing.assert_allclose(second.selector.estimator.weights, first.selector.estimator.weights)
    assert not second.selector.should_draft()  # it does not learn again that drafting loses

    modelled = engine_with("learned", ref, draft_time="modelled")  # decisions from the inputs alone
    assert attach_setup_state(modelled) is None and modelled.selector.gate.state()["skip_left"] == 0


def test_a_damaged_state_file_is_ignored_and_rewritten():
    ref = reference()
    engine = engine_with("calibrated", ref)
    path = state_path(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff{not json")
    keeper = attach_setup_state(engine)
    assert engine.selector.gate.state()["plain_passes"] == 0.0  # nothing loaded
    engine.generate(PROMPT, max_new_tokens=12)
    keeper.save()
    assert set(json.loads(path.read_text())) == {"gate", "acceptance"}


def test_build_attaches_the_setup_state():
    import specfit

    cfg = compose([*SPECFIT, "drafter=none", "cost_model.c0=0.002", "cost_model.c_tok=0.0001",
                   "cost_model.c_miss=0.0004", "cost_model.c_hit=0.00002", "acceptance=learned"])
    engine = specfit.build(cfg)
    from specfit.calibrate.setup_state import StateKeeper

    assert any(isinstance(listener, StateKeeper) for listener in engine.listeners)
    assert isinstance(engine.selector.estimator, LearnedAcceptance)


def test_a_broken_estimator_is_named():
    from specfit.errors import PluginError
    from specfit.interfaces import AcceptanceEstimatorBase

    class Overconfident(AcceptanceEstimatorBase):
        name = "overconfident"

        def estimate(self, tree):
            return np.full(len(tree), 1.5)

    selector = SpecFitSelector(estimator=Overconfident())
    tree = random_tree(np.random.default_rng(6))
    with pytest.raises(PluginError, match=r"acceptance 'overconfident' \(estimate\) returned .* values in \[1.5, 1.5\]"):
        selector.accept_estimates(tree)
    with pytest.raises(PluginError, match="acceptance object lacks name, bind, bind_target, estimate"):
        SpecFitSelector(estimator=object())


def test_the_state_is_saved_between_decodes_never_between_cycles():
    """A save's file system calls (fsync) must not stall a decode's next token."""
    ref = reference()
    engine = engine_with("learned", ref)
    keeper = attach_setup_state(engine)
    keeper.interval = 0.0  # every chance to save is taken
    path = state_path(engine)
    path.unlink(missing_ok=True)
    seen = []
    observe_time = engine.selector.observe_time

    def spy(*args):
        observe_time(*args)
        seen.append(path.exists())

    engine.selector.observe_time = spy
    engine.generate(PROMPT, max_new_tokens=12)
    assert len(seen) > 1 and not any(seen)  # cycles ran, none of them wrote the file
    assert path.exists() and not keeper.dirty  # the decode's end did


def test_a_state_that_is_not_json_is_one_line_not_an_error(tmp_path, capsys):
    from specfit.calibrate.setup_state import StateKeeper

    class Odd(PathProbAcceptance):
        name = "odd"

        def state(self):
            return {"x": object()}

    keeper = StateKeeper(tmp_path / "s.json", "specfit/odd/measured", None, Odd())
    keeper.cycle_ended()  # marks it dirty; the interval has not passed
    keeper.save()
    assert "acceptance 'odd' state() is not JSON" in capsys.readouterr().err and not (tmp_path / "s.json").exists()


def test_every_estimator_answers_a_tree_with_no_nodes():
    """A cycle that drafted nothing (plain decoding, a trace recorded with drafter=none) has an empty tree."""
    from specfit.plugins.acceptance.calibrated import CalibratedAcceptance
    from specfit.plugins.acceptance.learned import LearnedAcceptance
    from specfit.plugins.acceptance.path_prob import PathProbAcceptance

    for estimator in (PathProbAcceptance(), CalibratedAcceptance(), LearnedAcceptance()):
        assert np.asarray(estimator.estimate(DraftTree(root_token=1))).shape == (0,)
