"""The EAGLE-3 head's acceptance probe: its inputs and fit, the file beside the head (and the errors
that name it), the drafter recording its logit at every expanded node, a trace carrying the
logits into a replay, and the learned estimator's two features that read it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import tiny_model

from specfit import Engine
from specfit.types.tree import ROOT, DraftTree
from specfit.errors import ModelError
from specfit.interfaces import Selection, SelectorBase
from specfit.plugins.acceptance.learned import FEATURES, features
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.drafters.eagle3.checkpoint import save_head
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
from specfit.plugins.drafters.eagle3.probe import (PROBE_FILE, SUMMARIES, AcceptanceProbe, fit_logistic, load_probe,
                                                   probe_inputs, save_probe, summarise)
from specfit.trace import load_trace
from specfit.trace.record import record

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


def test_inputs_are_the_state_then_log_top1_entropy_and_margin():
    hidden = torch.randn(2, 5)
    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), -1)
    x = probe_inputs(hidden, *summarise(logp))
    assert x.shape == (2, 5 + len(SUMMARIES)) and torch.equal(x[:, :5], hidden)
    p = logp.exp()
    assert x[:, 5].tolist() == pytest.approx(logp.max(-1).values.tolist())
    assert x[:, 6].tolist() == pytest.approx((-(p * logp).sum(-1)).tolist(), rel=1e-6)
    assert x[:, 7].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert probe_inputs(hidden[:1], *summarise(torch.zeros(1, 1)))[0, 7] == 30.0  # one token: a wide margin


def test_the_fit_finds_the_direction_that_decides_acceptance():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4000, 6, generator=gen) * torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    logp = torch.log_softmax(torch.randn(4000, 10, generator=gen), -1)
    y = (torch.rand(4000, generator=gen) < torch.sigmoid(2 * hidden[:, 1])).float()
    probe = fit_logistic(probe_inputs(hidden, *summarise(logp)), y, l2=1e-4)
    w = probe.weight / probe.scale  # per raw unit
    assert w[1] == pytest.approx(2.0, rel=0.15) and w.abs()[[0, 2, 3, 4, 5]].max() < 0.3  # (the summaries: collinear here)
    z = probe(hidden, *summarise(logp))
    assert z.shape == (4000,) and np.corrcoef(z, 2 * hidden[:, 1].numpy())[0, 1] > 0.98
    assert z == pytest.approx(probe.score(probe_inputs(hidden, *summarise(logp))).numpy(), rel=1e-4, abs=1e-4)


def test_a_saved_probe_loads_back_and_a_bad_one_is_named(tmp_path):
    probe = fit_logistic(torch.randn(50, 4 + 3), (torch.arange(50) % 2).float(), l2=1e-2)
    probe.metrics = {"auc": 0.7}
    save_probe(probe, tmp_path)
    back = load_probe(tmp_path, 4)
    assert back.metrics == {"auc": 0.7}
    for name in ("mean", "scale", "weight", "bias"):
        assert torch.equal(getattr(back, name), getattr(probe, name))
    assert load_probe(tmp_path / "none", 4) is None  # no file: no probe
    with pytest.raises(ModelError, match=f"{PROBE_FILE}.*do not fit this head.*hidden_size 8"):
        load_probe(tmp_path, 8)
    probe.weight[0] = math.nan
    save_probe(probe, tmp_path)
    with pytest.raises(ModelError, match="non-finite"):
        load_probe(tmp_path, 4)
    (tmp_path / PROBE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match=f"{PROBE_FILE}: not a readable acceptance probe"):
        load_probe(tmp_path, 4)


class KeepTrees(SelectorBase):
    name = "keep"

    def __init__(self) -> None:
        self.trees: list[DraftTree] = []

    def select(self, tree, ctx):
        self.trees.append(tree)
        return Selection(nodes=[], stop=tree.depth >= 3)


def _head_dir(tmp_path) -> tuple:
    """A seeded random head saved with a probe whose weight reads the state's first value."""
    drafter = Eagle3Drafter(top_k=3, depth=3, total_tokens=8, seed=0)
    Engine(tiny_model(), drafter=drafter, device="cpu")
    save_head(drafter.head, tmp_path / "head")
    probe = AcceptanceProbe(drafter.head.cfg.hidden_size)
    probe.weight[0], probe.bias[0] = 50.0, -0.5
    save_probe(probe, tmp_path / "head")
    return tmp_path / "head", probe


def test_the_drafter_records_the_probes_logit_where_it_records_the_entropy(tmp_path):
    head_dir, probe = _head_dir(tmp_path)
    keep = KeepTrees()
    engine = Engine(tiny_model(), drafter=Eagle3Drafter(path=str(head_dir), top_k=3, depth=3, total_tokens=8),
                    selector=keep, device="cpu")
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    head = engine.drafter.head
    logits = head.logits

    def spy(hidden):
        out = logits(hidden)
        rows.append((hidden, torch.log_softmax(out.float(), -1)))
        return out

    head.logits = spy
    engine.generate(PROMPT, max_new_tokens=2, predict=False)
    tree = keep.trees[0]  # the first cycle's (one row for the root, then one per expanded level)
    assert np.array_equal(np.isnan(tree.node_accept_logit()), np.isnan(tree.node_entropy()))
    assert tree.root_accept_logit == pytest.approx(float(probe(rows[0][0], *summarise(rows[0][1]))[0]), rel=1e-5, abs=1e-5)
    expanded = np.flatnonzero(~np.isnan(tree.node_accept_logit()))
    want = np.concatenate([probe(h, *summarise(lp)) for h, lp in rows[1:3]]).tolist()
    assert sorted(tree.node_accept_logit()[expanded].tolist()) == pytest.approx(sorted(want), rel=1e-5, abs=1e-5)
    assert len(set(np.round(want, 3))) > 1  # the weight reads the state: not one constant

    keep_off = KeepTrees()  # acceptance_probe=False: the file is there, the drafter ignores it
    Engine(tiny_model(), drafter=Eagle3Drafter(path=str(head_dir), top_k=3, depth=3, total_tokens=8,
                                               acceptance_probe=False), selector=keep_off,
           device="cpu").generate(PROMPT, max_new_tokens=2, predict=False)
    assert np.isnan(keep_off.trees[-1].node_accept_logit()).all() and math.isnan(keep_off.trees[-1].root_accept_logit)
    assert keep_off.trees[0].tokens == tree.tokens  # same drafts


def test_a_trace_carries_the_logits_into_the_replayed_tree(tmp_path):
    head_dir, _ = _head_dir(tmp_path)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4),
                    drafter=Eagle3Drafter(path=str(head_dir), top_k=3, depth=3, total_tokens=8), device="cpu")
    trace = load_trace(record(engine, [PROMPT], max_new_tokens=6).save(tmp_path / "trace"))
    seq = trace.sequences[0]
    assert np.isfinite(seq.root_accept_logit).all() and np.isfinite(seq.node_accept_logit).any()
    assert np.array_equal(np.isnan(seq.node_accept_logit), np.isnan(seq.node_entropy))
    position = seq.position(0)
    tree = DraftTree(root_token=position.root)
    for _ in position.draft(tree):
        pass
    assert tree.root_accept_logit == pytest.approx(position.root_accept_logit)
    expanded = ~np.isnan(position.accept_logit)
    assert tree.node_accept_logit()[expanded].tolist() == pytest.approx(position.accept_logit[expanded].tolist())


def test_the_learned_features_read_the_parents_logit_for_its_top_child_and_the_others():
    tree = DraftTree(root_token=0)
    tree.add_level([ROOT, ROOT], [1, 2], np.log([0.6, 0.3]).tolist())
    tree.set_accept_logit([ROOT], [1.5])
    tree.add_level([0, 0, 1], [3, 4, 5], np.log([0.2, 0.7, 0.9]).tolist())
    tree.set_accept_logit([0], [-2.0])  # node 1 expanded by no probe: unknown, read as 0
    x = features(tree, recent=0.5, root_logit=0.0)
    top, other = x[:, FEATURES.index("probe_top")], x[:, FEATURES.index("probe_other")]
    assert top.tolist() == [1.5, 0.0, 0.0, -2.0, 0.0]
    assert other.tolist() == [0.0, 1.5, -2.0, 0.0, 0.0]
    bare = DraftTree(root_token=0)
    bare.add_level([ROOT, ROOT], [1, 2], np.log([0.6, 0.3]).tolist())
    assert not features(bare, 0.5, 0.0)[:, [FEATURES.index("probe_top"), FEATURES.index("probe_other")]].any()


def test_saving_new_head_weights_removes_the_probe_fit_on_the_old_ones(tmp_path):
    from specfit.plugins.drafters.eagle3.checkpoint import load_head

    head_dir, _ = _head_dir(tmp_path)
    assert (head_dir / PROBE_FILE).is_file()
    save_head(load_head(head_dir), head_dir)  # e.g. train-drafter writing into the same out_dir
    assert not (head_dir / PROBE_FILE).exists()
    assert Eagle3Drafter(path=str(head_dir)).probe is None


def test_the_folded_forward_equals_the_standardised_score():
    gen = torch.Generator().manual_seed(1)
    probe = AcceptanceProbe(6)
    for name in ("mean", "weight"):
        getattr(probe, name).copy_(torch.randn(9, generator=gen))
    probe.scale.copy_(torch.rand(9, generator=gen) + 0.5)
    probe.bias.fill_(0.3)
    hidden, logp = torch.randn(5, 6, generator=gen), torch.log_softmax(torch.randn(5, 12, generator=gen), -1)
    tops, entropy = summarise(logp)
    assert probe(hidden, tops, entropy).tolist() == pytest.approx(probe.score(probe_inputs(hidden, tops, entropy)).tolist(), rel=1e-5)
    one = torch.topk(logp, 1, -1).values  # a single top column: the margin to -30, as probe_inputs
    assert probe(hidden, one, entropy).tolist() == pytest.approx(probe.score(probe_inputs(hidden, one, entropy)).tolist(), rel=1e-5)


def test_learned_with_the_probe_leaves_greedy_and_seeded_sampled_output_unchanged(tmp_path, monkeypatch):
    from specfit.types.costs import CostConstants
    from specfit.plugins.acceptance import learned
    from specfit.decode.sampling import SamplingParams
    from specfit.plugins.cost_models.union import UnionCostModel
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.selectors.specfit import SpecFitSelector

    head_dir, _ = _head_dir(tmp_path)
    constants = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-5, c_hit=2e-5, c_level=1e-5, c_draft0=1e-5)

    def engine() -> Engine:
        return Engine(tiny_model(), drafter=Eagle3Drafter(path=str(head_dir), top_k=3, depth=3, total_tokens=8),
                      selector=SpecFitSelector(acceptance="learned", draft_gate=False, draft_time="modelled"),
                      cost_model=UnionCostModel(constants=constants), predictor=HistoryPredictor(), device="cpu")

    with torch.no_grad():
        ref = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0]
    read = []  # the probe columns of every feature matrix the estimator built
    real = learned.features
    monkeypatch.setattr(learned, "features", lambda *a, **k: read.append(real(*a, **k)[:, -2:]) or real(*a, **k))
    spec = engine()
    assert spec.generate(PROMPT, max_new_tokens=12).token_ids == ref[len(PROMPT):].tolist()
    assert spec.selector.acceptance_score.nodes > 0 and any(x.any() for x in read)  # the logits reached it
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    plain = Engine(tiny_model(), device="cpu").generate(PROMPT, 12, params).token_ids
    assert engine().generate(PROMPT, 12, params).token_ids == plain


def test_the_cached_raw_weights_follow_a_buffer_changed_in_place():
    probe = AcceptanceProbe(4)
    hidden, tops, entropy = torch.ones(2, 4), torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]), torch.tensor([0.3, 0.9])
    assert probe(hidden, tops, entropy).tolist() == [0.0, 0.0]
    probe.weight[0] = 2.0  # in place, after a call cached the fold
    assert probe(hidden, tops, entropy).tolist() == pytest.approx([2.0, 2.0])
    probe.bias.fill_(-1.0)
    assert probe(hidden, tops, entropy).tolist() == pytest.approx([1.0, 1.0])


def test_a_format_2_trace_loads_with_unknown_logits_and_replays_as_recorded(tmp_path):
    import json
    import shutil

    from specfit.plugins.acceptance.learned import LearnedAcceptance
    from specfit.trace.format import ADDED_IN

    head_dir, _ = _head_dir(tmp_path)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4),
                    drafter=Eagle3Drafter(path=str(head_dir), top_k=3, depth=3, total_tokens=8), device="cpu")
    path = record(engine, [PROMPT], max_new_tokens=6).save(tmp_path / "trace")
    old = tmp_path / "v2"
    shutil.copytree(path, old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "version": 2}))
    for file in old.glob("seq-*.npz"):
        with np.load(file) as npz:
            arrays = {k: npz[k] for k in npz.files if k not in ADDED_IN[3]}
        np.savez(file, **arrays)
    new_seq, old_seq = load_trace(path).sequences[0], load_trace(old).sequences[0]
    assert np.isnan(old_seq.node_accept_logit).all() and np.isnan(old_seq.root_accept_logit).all()
    assert np.array_equal(old_seq.node_token, new_seq.node_token) and np.isfinite(new_seq.root_accept_logit).all()
    # the features read the logits where the trace has them, and 0 where it does not
    columns = [FEATURES.index("probe_top"), FEATURES.index("probe_other")]
    for seq, known in ((new_seq, True), (old_seq, False)):
        position = seq.position(0)
        tree = DraftTree(root_token=position.root)
        for _ in position.draft(tree):
            pass
        x = features(tree, 0.5, 0.0, token_rate=LearnedAcceptance().token_rates)
        assert bool(x[:, columns].any()) == known


def test_a_probe_left_unused_is_another_setup(tmp_path):
    from specfit.calibrate.fingerprint import setup_fingerprint

    head_dir, _ = _head_dir(tmp_path)

    def drafter_key(**kw) -> dict:
        engine = Engine(tiny_model(), drafter=Eagle3Drafter(path=str(head_dir), **kw), device="cpu")
        return setup_fingerprint(engine)["drafter"]

    used, unused = drafter_key(), drafter_key(acceptance_probe=False)
    assert "acceptance_probe" not in used and unused["acceptance_probe"] is False
    assert {k: v for k, v in unused.items() if k != "acceptance_probe"} == used
    (head_dir / PROBE_FILE).unlink()
    assert "acceptance_probe" not in drafter_key(acceptance_probe=False)


def test_a_probe_beside_other_weights_than_it_was_fit_on_is_refused(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from specfit.plugins.drafters.eagle3.probe import restamp_probe

    head_dir, _ = _head_dir(tmp_path)
    assert Eagle3Drafter(path=str(head_dir)).probe is not None
    copy = tmp_path / "copy"
    shutil.copytree(head_dir, copy)
    state = load_file(str(copy / "model.safetensors"))
    save_file({k: v + 1 if v.is_floating_point() else v for k, v in state.items()}, str(copy / "model.safetensors"))
    with pytest.raises(ModelError, match=f"{PROBE_FILE}: was fit on other weights than .*refit it"):
        Eagle3Drafter(path=str(copy))
    assert Eagle3Drafter(path=str(copy), acceptance_probe=False).probe is None  # the head alone still loads
    from specfit.training.export import export_demo

    with pytest.raises(ModelError, match=f"{PROBE_FILE}: was fit on other weights"):  # not shipped re-stamped
        export_demo(tmp_path / "no-target", copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written
    restamp_probe(copy)  # what export does for the same head re-encoded
    assert Eagle3Drafter(path=str(copy)).probe is not None


def test_fitting_a_probe_keeps_the_calibration_and_starts_the_learned_state_again(tmp_path, monkeypatch):
    """Costs do not depend on the head's weight values or its probe; what the gate and estimator
    learned does: the calibration's file stays, the state's file is another."""
    from specfit.calibrate.store import calibration_path
    from specfit.calibrate.fingerprint import cost_fingerprint
    from specfit.calibrate.setup_state import state_path

    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path / "home"))
    head_dir, _ = _head_dir(tmp_path)

    def paths(**kw) -> tuple:
        engine = Engine(tiny_model(), drafter=Eagle3Drafter(path=str(head_dir), **kw), device="cpu")
        return calibration_path(engine), state_path(engine), cost_fingerprint(engine)["drafter"]

    with_probe, unused = paths(), paths(acceptance_probe=False)
    moved = tmp_path / "probe.safetensors"
    (head_dir / PROBE_FILE).rename(moved)
    without = paths()
    assert with_probe[0] == unused[0] == without[0]  # one calibration
    assert len({with_probe[1], unused[1], without[1]}) == 3  # three learned states
    assert "weights" not in with_probe[2] and "acceptance_probe" not in unused[2]
    assert with_probe[1].name.endswith(".selector.json") and with_probe[1].parent == with_probe[0].parent
