"""The learned estimator's two features that only the drafter and the verifier know: the draft
head's entropy at each expanded node, and the target's probability of the root token. They are
computed right (live and in a replay), a trace carries them so a replay sees what the live run saw,
a trace of format 1 (without them) still loads and replays, and learned falls back without them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

from specfit import Engine
from specfit.types.costs import CostConstants
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.types.tree import ROOT, DraftTree
from specfit.interfaces import Selection, SelectorBase
from specfit.plugins.acceptance.learned import FEATURES, LearnedAcceptance, features
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
from specfit.plugins.drafters.eagle3.probe import entropies as _entropy
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.specfit import SpecFitSelector
from specfit.trace import load_trace
from specfit.trace.record import record
from specfit.trace.replay import replay

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
N = 12
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4, c_draft0=1e-4)


def column(x: np.ndarray, name: str) -> np.ndarray:
    return x[:, FEATURES.index(name)]


class Probe(SelectorBase):
    """Drafts two levels, verifies the root's first child, and remembers what each cycle's tree
    carried at level 2: the root token, its probability, the head's entropy at the root and at
    the level-1 nodes."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: list[tuple[int, float | None, float, list[float]]] = []

    def select(self, tree, ctx):
        if tree.depth == 2:
            entropy = [] if tree.entropy is None else tree.entropy[: len(tree.level(1))].tolist()
            self.seen.append((tree.root_token, tree.root_prob, tree.root_entropy, entropy))
        return Selection(nodes=[0], stop=tree.depth >= 2)


def target_logits(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model()(torch.tensor([ids])).logits[0].double()


# --------------------------------------------------------------------------- the tree and the drafter


def test_entropy_is_kept_per_expanded_node_and_read_at_each_parent():
    tree = DraftTree(root_token=0)
    tree.add_level([ROOT, ROOT], [1, 2], np.log([0.6, 0.3]).tolist())
    assert np.isnan(tree.parent_entropy()).all()  # a drafter that does not tell
    tree.set_entropy([ROOT], [math.log(4)])
    tree.add_level([0, 0, 1], [3, 4, 5], np.log([0.5, 0.2, 0.9]).tolist())
    tree.set_entropy([1], [0.25])  # node 0 was not expanded by the head here: unknown
    parent = tree.parent_entropy()
    assert parent[:2] == pytest.approx([math.log(4)] * 2)
    assert np.isnan(parent[2:4]).all() and parent[4] == pytest.approx(0.25)
    assert tree.parent_entropy(2, 5)[2] == pytest.approx(0.25)
    assert tree.entropy.dtype == np.float32 and len(tree.entropy) == len(tree)
    with pytest.raises(ValueError, match="node ids"):
        tree.set_entropy([7], [1.0])
    # the drafter's entropy: nats of the full distribution (a token of probability 0 adds 0)
    uniform, peaked = torch.full((8,), 1 / 8).log(), torch.tensor([0.0, -math.inf, -math.inf])
    assert float(_entropy(uniform)) == pytest.approx(math.log(8))
    assert float(_entropy(peaked)) == 0.0
    p = torch.tensor([0.5, 0.25, 0.25])
    assert float(_entropy(p.log()[None])[0]) == pytest.approx(1.5 * math.log(2))


def test_the_eagle3_drafter_records_its_heads_entropy_at_the_root_and_every_expanded_node():
    model = tiny_model()
    engine = Engine(model, drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=8, seed=0), device="cpu")
    drafter = engine.drafter
    rows: list[torch.Tensor] = []
    logits = drafter.head.logits

    def spy(hidden):
        out = logits(hidden)
        rows.append(torch.log_softmax(out.float(), dim=-1))
        return out

    drafter.head.logits = spy
    trees: list[DraftTree] = []

    class Keep(Probe):
        def select(self, tree, ctx):
            if tree.depth == drafter.depth:
                trees.append(tree)
            return Selection(nodes=[], stop=False)

    engine.generate(PROMPT, max_new_tokens=2, selector=Keep(), predict=False)
    tree = trees[0]
    root, level2, level3 = rows[0][0], rows[1], rows[2]  # one row for the root, one per beam node
    p = root.exp()
    assert tree.root_entropy == pytest.approx(float(-(p * root).sum()), rel=1e-5)
    expanded = np.flatnonzero(~np.isnan(tree.entropy))
    beams = [sorted({tree.parents[v] for v in tree.level(d)}) for d in (2, 3)]
    assert expanded.tolist() == sorted(beams[0] + beams[1])  # the last level is never expanded
    for beam, level in zip(beams, (level2, level3)):
        want = -(level.exp() * level).sum(-1)
        # the drafter's beam order is by path probability; compare as sets of values
        assert sorted(tree.entropy[beam].tolist()) == pytest.approx(sorted(want.tolist()), rel=1e-5)
    assert 0 < tree.root_entropy <= math.log(drafter.head.cfg.draft_vocab_size) + 1e-6


# --------------------------------------------------------------------------- the root probability


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)])
def test_the_root_probability_is_the_targets_at_the_position_that_produced_it(sampling):
    """Greedy: the softmax probability of the argmax; sampling: the sampled token's under the
    processed distribution. Checked against the HF model's logits over the whole output."""
    probe = Probe()
    ref = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0].tolist()
    engine = Engine(tiny_model(), drafter=ScriptedDrafter(ref, vocab=256, branching=2, depth=2, miss=0.3),
                    selector=probe, device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=N, sampling=sampling)
    ids = PROMPT + out.token_ids
    logits = target_logits(ids)
    sampler = Sampler(sampling or SamplingParams())
    assert len(probe.seen) == len(out.cycles) >= 3
    assert sampling is not None or any(c.accepted for c in out.cycles)  # bonuses after accepted paths too
    position = 0  # the output index of each cycle's root
    for (root, prob, _, _), cycle in zip(probe.seen, out.cycles):
        assert root == out.token_ids[position]
        row = logits[len(PROMPT) + position - 1]  # the position that produced the root
        want = row.softmax(-1)[root] if sampling is None else sampler.probs(row)[root]
        assert prob == pytest.approx(float(want), rel=1e-4), position
        position += cycle.committed
    assert any(p < 0.999 for _, p, _, _ in probe.seen)


# --------------------------------------------------------------------------- traces and replay


@pytest.fixture(scope="module")
def eagle3_trace(tmp_path_factory):
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=8),
                    device="cpu")
    return record(engine, [PROMPT], max_new_tokens=N).save(tmp_path_factory.mktemp("t") / "trace")


def test_a_trace_carries_the_entropies_and_root_probabilities_and_the_replay_sees_the_live_values(eagle3_trace):
    trace = load_trace(eagle3_trace)
    seq = trace.sequences[0]
    assert not trace.notes and np.isfinite(seq.root_entropy).all() and np.isfinite(seq.root_prob).all()
    assert np.isfinite(seq.node_entropy).any() and np.isnan(seq.node_entropy).any()  # the last level: never expanded
    logits = target_logits(PROMPT + seq.output.tolist())
    want = [float(logits[len(PROMPT) + i - 1].softmax(-1)[seq.output[i]]) for i in range(len(seq))]
    assert seq.root_prob.tolist() == pytest.approx(want, rel=1e-4)

    live = Probe()  # a random head: nothing is accepted, so live and replay cycle at every position
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=8),
                    selector=live, cost_model=UnionCostModel(constants=CONSTANTS), device="cpu")
    engine.generate(PROMPT, max_new_tokens=N)
    replayed = Probe()
    replay(trace, replayed, LRUCache(capacity=4), UnionCostModel(constants=CONSTANTS), draft_time="modelled",
           model=tiny_model())
    assert len(live.seen) == len(replayed.seen) == len(seq)
    for (root, prob, h_root, h), (r_root, r_prob, r_h_root, r_h) in zip(live.seen, replayed.seen):
        assert root == r_root and prob == pytest.approx(r_prob, rel=1e-5)
        assert h_root == pytest.approx(r_h_root, rel=1e-5) and len(h) == 3
        assert np.isfinite(h).sum() == 3 and r_h == pytest.approx(h, rel=1e-5)  # the beam: all 3 expanded


def as_format_1(path):
    """Rewrite a trace as format 1 wrote it: no entropies, no root probabilities."""
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    for file in path.glob("seq-*.npz"):
        with np.load(file) as npz:
            arrays = {k: npz[k] for k in npz.files if k not in ("node_entropy", "root_entropy", "root_prob")}
        np.savez(file, **arrays)


def learned_selector() -> SpecFitSelector:
    return SpecFitSelector(draft_time="modelled", acceptance="learned", draft_gate=False)


def test_a_format_1_trace_loads_says_so_and_replays(eagle3_trace, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(eagle3_trace, old)
    as_format_1(old)
    trace = load_trace(old)
    assert len(trace.notes) == 1 and "format 1" in trace.notes[0] and "falls back" in trace.notes[0]
    seq = trace.sequences[0]
    assert np.isnan(seq.root_prob).all() and np.isnan(seq.node_entropy).all() and len(seq.root_prob) == len(seq)
    runs = [replay(t, learned_selector(), LRUCache(capacity=4), UnionCostModel(constants=CONSTANTS),
                   HistoryPredictor(), draft_time="modelled", model=tiny_model())
            for t in (load_trace(eagle3_trace), trace)]
    # an untrained learned estimator does not weigh the new features: both replays decide alike
    assert runs[0].committed() == runs[1].committed() and runs[1].acceptance["acceptance_nodes"] > 0


def test_replay_of_the_old_trace_names_the_missing_features(eagle3_trace, tmp_path, capsys):
    import shutil

    from specfit.cli import main

    old = tmp_path / "old"
    shutil.copytree(eagle3_trace, old)
    as_format_1(old)
    main(["replay", f"trace.path={old}", "methods=[specfit_learned]", "cache.capacity=4", "replay.oracle=false",
          "replay.cost_profile=gpu-like", f"hydra.run.dir={tmp_path / 'run'}", "model=tiny"])
    assert capsys.readouterr().out.count("carries no draft-head entropies") == 1


# --------------------------------------------------------------------------- learned's features


def feature_tree() -> DraftTree:
    tree = DraftTree(root_token=0)
    tree.add_level([ROOT, ROOT, ROOT], [1, 2, 3], np.log([0.5, 0.3, 0.1]).tolist())
    tree.add_level([0, 0, 1], [4, 5, 6], np.log([0.7, 0.2, 0.4]).tolist())
    return tree


def test_learned_reads_the_entropy_and_root_probability_and_falls_back_without_them():
    tree = feature_tree()
    learned = LearnedAcceptance()
    learned.root_mean = 1.25
    x = features(tree, 0.5, learned.root_logit(tree))
    # no entropy told: the min-entropy of the parent's top-k (-log of its largest child's q)
    np.testing.assert_allclose(column(x, "parent_entropy"), -np.log([0.5, 0.5, 0.5, 0.7, 0.7, 0.4]))
    np.testing.assert_allclose(column(x, "root_prob"), 1.25)  # no root probability: the running mean
    tree.set_entropy([ROOT, 0], [2.0, 0.5])
    tree.root_prob = 0.8
    x = features(tree, 0.5, learned.root_logit(tree))
    np.testing.assert_allclose(column(x, "parent_entropy"), [2.0, 2.0, 2.0, 0.5, 0.5, -np.log(0.4)], rtol=1e-6)
    np.testing.assert_allclose(column(x, "root_prob"), math.log(0.8 / 0.2))
    # untrained, the new features carry no weight: learned is path_prob with or without them
    np.testing.assert_allclose(LearnedAcceptance().estimate(tree), tree.path_probs(), rtol=1e-5)


def test_learned_learns_from_the_root_probability_and_keeps_its_mean():
    """The target accepts the first child 90% of the time when it was sure of the root token
    (root_prob 0.95), never when it was not (0.3), on otherwise identical trees: the online model
    must tell the two apart, and keep the mean it saw."""
    rng = np.random.default_rng(0)
    trees = []
    for i in range(200):
        tree = feature_tree()
        tree.root_prob = 0.95 if i % 2 else 0.3
        sure = bool(i % 2) and rng.random() < 0.9
        tree.greedy_next = 99
        trees.append((tree, [0] if sure else []))
    learned = LearnedAcceptance()
    for tree, path in trees:
        learned.observe(tree, [], path)
    sure, unsure = feature_tree(), feature_tree()
    sure.root_prob, unsure.root_prob = 0.95, 0.3
    assert learned.estimate(sure)[0] > 3 * learned.estimate(unsure)[0]  # (the prior keeps both modest)
    assert learned.weights[FEATURES.index("root_prob")] > 0.3
    mean = (math.log(0.95 / 0.05) + math.log(0.3 / 0.7)) / 2
    assert learned.root_mean == pytest.approx(mean, abs=0.6)
    restored = LearnedAcceptance()
    restored.load_state(json.loads(json.dumps(learned.state())))
    assert restored.root_mean == learned.root_mean


def test_a_state_of_the_earlier_features_is_ignored_or_refused(tmp_path):
    from specfit.errors import ConfigError

    earlier = ["bias", "logit_q", "top_sibling", "log_rank", "log_depth", "parent_path", "parent_confidence", "recent"]
    state = {"features": earlier, "weights": [0.0] * 8, "precision": np.eye(8).tolist(), "recent": 0.5}
    learned = LearnedAcceptance()
    learned.load_state(state)  # the per-setup state: ignored, relearned from w0
    np.testing.assert_allclose(learned.estimate(feature_tree()), feature_tree().path_probs(), rtol=1e-5)
    file = tmp_path / "old.json"
    file.write_text(json.dumps({"state": state}))
    with pytest.raises(ConfigError, match="not a learned acceptance model of the features .*root_prob"):
        LearnedAcceptance(state_file=str(file)).bind(None)


def test_learned_tells_tokens_the_head_drafts_well_from_those_it_does_not():
    """Identical trees but for the first child's token: token 1 is accepted 90% of the time, token
    7 never. Draft probabilities cannot tell them apart; the token's own record can, and it
    survives the state's round trip."""
    rng = np.random.default_rng(0)
    learned = LearnedAcceptance()
    for i in range(200):
        tree = feature_tree()
        good = i % 2 == 0
        tree.tokens[0] = 1 if good else 7
        tree.greedy_next = 99
        learned.observe(tree, [], [0] if good and rng.random() < 0.9 else [])
    good, bad, unseen = feature_tree(), feature_tree(), feature_tree()
    bad.tokens[0], unseen.tokens[0] = 7, 50
    rate = learned.token_rates.lookup([1, 7, 50])
    assert rate[0] > 0 > rate[1] and rate[2] == 0  # never settled: no evidence either way
    assert learned.estimate(good)[0] > 3 * learned.estimate(bad)[0]
    assert learned.weights[FEATURES.index("token_rate")] > 0.3
    restored = LearnedAcceptance()
    restored.load_state(json.loads(json.dumps(learned.state())))
    np.testing.assert_allclose(restored.estimate(bad), learned.estimate(bad))


def test_token_rates_are_bounded_and_a_damaged_record_is_refused(tmp_path):
    from specfit.errors import ConfigError
    from specfit.plugins.acceptance.learned import TokenRates

    rates = TokenRates(max_tokens=2)
    rates.add([1, 2, 3, 1], np.array([True, False, True, True]))
    assert sorted(rates.counts) == [1, 2] and rates.counts[1] == [2.0, 2.0] and rates.total == 4
    state = LearnedAcceptance().state()
    file = tmp_path / "damaged.json"
    file.write_text(json.dumps({"state": {**state, "token_rates": {"counts": {"5": [3, 2]}, "hits": 0, "total": 0}}}))
    with pytest.raises(ConfigError, match=r"state_file=.*token_rates entry '5'"):
        LearnedAcceptance(state_file=str(file)).bind(None)
    trained = LearnedAcceptance()
    trained.weights[0] = 0.5
    for damaged in ({"counts": {"²": [1, 2]}, "hits": 1, "total": 2}, {"counts": {"-1": [1, 2]}, "hits": 1, "total": 2}):
        ignored = LearnedAcceptance()  # the per-setup state: the whole of it ignored, relearned from w0
        ignored.load_state({**trained.state(), "token_rates": damaged})
        assert ignored.weights[0] == 0.0 and not ignored.token_rates.counts
    without = LearnedAcceptance()  # a state without token rates: the weights, and no counts yet
    without.load_state({k: v for k, v in trained.state().items() if k != "token_rates"})
    assert without.weights[0] == 0.5 and not without.token_rates.counts
    placeholder = TokenRates()
    placeholder.add([-1, 4], np.array([True, True]))  # a placeholder id is never counted (its record could not be saved)
    assert list(placeholder.counts) == [4]
