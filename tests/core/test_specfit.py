"""SpecFit end to end: lossless with every cache, the cost model, predictors and calibration."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import time

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

import specfit
from specfit import Engine
from specfit.types.costs import CostConstants, fit_constants, load_constants, nnls
from specfit.types.moe import MoESpec
from specfit.types.tree import ROOT, DraftTree
from specfit.errors import ConfigError
from specfit.interfaces import SelectionContext
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.predictors.router_probe import RouterProbePredictor
from specfit.plugins.selectors.greedy import GreedySelector
from specfit.plugins.selectors.prefix import PrefixSelector
from specfit.plugins.selectors.specfit import SpecFitSelector

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4)


def reference(n=40):
    with torch.no_grad():
        return tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()


@pytest.mark.parametrize("cache", [lambda: LRUCache(capacity=4), lambda: NoCache(), lambda: FullCache()], ids=["lru", "none", "full"])
@pytest.mark.parametrize("predictor", [HistoryPredictor, RouterProbePredictor])
@pytest.mark.parametrize("acceptance", ["path_prob", "calibrated"])
@pytest.mark.parametrize("selector", [SpecFitSelector, GreedySelector, PrefixSelector,
                                      functools.partial(SpecFitSelector, objective="rate")],
                         ids=["specfit", "greedy", "prefix", "specfit_rate"])
def test_cost_aware_selectors_are_lossless(cache, predictor, acceptance, selector):
    ref = reference()
    engine = Engine(tiny_model(), cache=cache(), drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=4, miss=0.1),
                    selector=selector(acceptance=acceptance), cost_model=UnionCostModel(constants=CONSTANTS),
                    predictor=predictor(), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == ref[len(PROMPT):][:30]
    assert 0 < out.stats["predictor_recall"] <= 1
    assert all("rho" in c.predicted for c in out.cycles if c.drafted)


class RecordingPredictor(HistoryPredictor):
    """History, noting which nodes of each level it was asked for and the tree's likeliest then."""

    def __init__(self, max_nodes: int) -> None:
        super().__init__()
        self.max_nodes, self.asked = max_nodes, []

    def predict(self, tree, nodes):
        level = tree.level(tree.depth)
        self.asked.append((list(nodes), [v for v in tree.top_by_path_prob(self.max_nodes) if v in level], len(level)))
        super().predict(tree, nodes)


def test_experts_are_predicted_only_for_nodes_the_selector_may_choose():
    ref = reference()
    drafter = ScriptedDrafter(ref, vocab=256, branching=3, depth=4, miss=0.1, total_tokens=6)
    predictor = RecordingPredictor(max_nodes=6)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=drafter, selector=SpecFitSelector(draft_gate=False),
                    cost_model=UnionCostModel(constants=CONSTANTS), predictor=predictor, device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == ref[len(PROMPT):][:30]
    assert predictor.asked and all(nodes == likeliest for nodes, likeliest, _ in predictor.asked)
    assert any(len(nodes) < size for nodes, _, size in predictor.asked)  # some levels' nodes were skipped


def test_cheap_misses_verify_more_than_expensive_ones():
    ref = reference()

    def verified(c_miss):
        constants = CostConstants(c0=2e-3, c_tok=1e-5, c_miss=c_miss, c_hit=1e-6, c_level=1e-4)
        engine = Engine(tiny_model(), cache=NoCache(), drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=3, miss=0.0),
                        selector=SpecFitSelector(), cost_model=UnionCostModel(constants=constants),
                        predictor=HistoryPredictor(), device="cpu")
        return engine.generate(PROMPT, max_new_tokens=24).stats["verified_nodes_per_cycle"]

    assert verified(1e-6) > verified(5e-2)


def test_union_cost_model_matches_the_formula():
    spec_model = tiny_model()
    engine = Engine(spec_model, device="cpu")
    cm = UnionCostModel(constants=CONSTANTS)
    cm.bind(engine.spec)
    tree = DraftTree(root_token=1)
    tree.add_level([-1, -1], [2, 3], [-0.1, -0.2])
    tree.add_level([0], [4], [-0.3])
    rows = tree.expert_rows(engine.spec.num_layers, 2)
    rows[0], rows[1], rows[2] = [0, 1], [2, 3], [0, 5]
    tree.root_experts = np.tile(np.array([[0, 7]], dtype=np.int32), (engine.spec.num_layers, 1))
    resident = np.zeros((engine.spec.num_layers, engine.spec.num_experts), dtype=bool)
    resident[:, 1] = True
    # S = {0, 2}: per layer union {0, 7, 1, 5}: hits {1}, misses {0, 7, 5}
    expected = CONSTANTS.c0 + CONSTANTS.c_tok * 3 + engine.spec.num_layers * (3 * CONSTANTS.c_miss + CONSTANTS.c_hit) + 0.01
    assert cm.predict(tree, [0, 2], resident, 0.01) == pytest.approx(expected)
    oblivious = UnionCostModel(cache_aware=False, constants=CONSTANTS)
    oblivious.bind(engine.spec)
    assert oblivious.predict(tree, [0, 2], resident, 0.01) == pytest.approx(expected + engine.spec.num_layers * (CONSTANTS.c_miss - CONSTANTS.c_hit))


def test_uncalibrated_cost_model_says_how_to_fix_it():
    cm = UnionCostModel(calibration="auto")
    with pytest.raises(ConfigError, match="specfit calibrate"):
        cm.constants


TRUTH = CostConstants(c0=3e-3, c_tok=2e-4, c_miss=7e-4, c_hit=1e-4, c_level=4e-4, c_draft0=1e-3)


def measured_cycles(rng: np.random.Generator, slow_draft: tuple[int, ...] = (),
                    slow_total: tuple[int, ...] = ()) -> list:
    """40 cycles timed exactly by TRUTH, but those in ``slow_draft`` draft 0.4 s longer and those in
    ``slow_total`` take 1 s longer in all (a busy host)."""
    from specfit.types.stats import CycleRecord

    records = []
    for i in range(40):
        n, misses, hits, levels = (int(v) for v in rng.integers(0, 30, size=4))
        draft = TRUTH.c_draft0 + TRUTH.c_level * levels + (0.4 if i in slow_draft else 0.0)
        h2d = misses * (TRUTH.c_miss - TRUTH.c_hit)
        total = TRUTH.cycle_seconds(n, misses, hits, draft) + (1.0 if i in slow_total else 0.0)
        records.append(CycleRecord(drafted=n, levels=levels, verified=n, accepted=0, committed=1, draft_seconds=draft,
                                   select_seconds=0.0, verify_seconds=total - draft, h2d_seconds=h2d, total_seconds=total,
                                   misses=misses, hits=hits, union=[]))
    return records


def test_nnls_and_fit_recover_known_constants():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, size=(50, 3))
    assert np.allclose(nnls(x, x @ np.array([1.0, 0.0, 2.0])), [1.0, 0.0, 2.0], atol=1e-9)
    truth = TRUTH
    records = measured_cycles(rng)
    fitted = fit_constants(records)
    for key in ("c0", "c_tok", "c_miss", "c_hit", "c_level", "c_draft0"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-6, abs=1e-12), key


def test_calibration_is_measured_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    overrides = ["model=tiny", "drafter=eagle3", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=6",
                 "selector=specfit", "cost_model=union", "predictor=history", "cache.capacity=4", "max_new_tokens=8"]
    engine = specfit.build(specfit.compose(overrides))
    files = list(tmp_path.glob("calibration/*.json"))
    assert len(files) == 1 and engine.cost_model.constants.source == str(files[0])
    data = json.loads(files[0].read_text())
    assert data["setup"]["cache"] == "lru" and data["report"]["cycles_fit"] >= 4
    again = specfit.build(specfit.compose(overrides))
    assert again.cost_model.constants == engine.cost_model.constants
    out = again.generate(PROMPT)
    assert out.token_ids == reference()[len(PROMPT):][:8]


def test_a_calibration_file_of_another_setup_is_used_with_a_note(tmp_path, monkeypatch, capsys):
    """cost_model.calibration=FILE from another setup is honoured (planning with another machine's
    constants is legitimate) but never silently: the differing parts of the setup are named."""
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    overrides = ["model=tiny", "drafter=eagle3", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=6",
                 "selector=specfit", "cost_model=union", "predictor=history", "cache.capacity=4", "max_new_tokens=8"]
    specfit.build(specfit.compose(overrides))
    (path,) = tmp_path.glob("calibration/*.json")
    capsys.readouterr()
    specfit.build(specfit.compose([*overrides, f"cost_model.calibration={path}"]))
    assert "another setup" not in capsys.readouterr().err  # its own setup: nothing to say
    other = specfit.build(specfit.compose([*overrides, "cache.capacity=2", f"cost_model.calibration={path}"]))
    assert "was measured on another setup (its slots_per_layer differ" in capsys.readouterr().err
    assert other.cost_model.constants.source == str(path)


def test_a_calibration_fitted_by_an_older_specfit_is_measured_again(tmp_path, monkeypatch, capsys):
    """A stored file without the current ``fit_version`` (an older fit) is not reused silently."""
    from specfit.types.costs import FIT_VERSION

    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    overrides = ["model=tiny", "drafter=eagle3", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=6",
                 "selector=specfit", "cost_model=union", "predictor=history", "cache.capacity=4", "max_new_tokens=8"]
    specfit.build(specfit.compose(overrides))
    (path,) = tmp_path.glob("calibration/*.json")
    data = json.loads(path.read_text())
    assert data["fit_version"] == FIT_VERSION
    del data["fit_version"]
    data["constants"]["c0"] = 123.0  # what an old fit stored: must not be used
    path.write_text(json.dumps(data))
    capsys.readouterr()
    engine = specfit.build(specfit.compose(overrides))
    assert "fitted by an older specfit (fit version 1" in capsys.readouterr().err
    assert engine.cost_model.constants.c0 != 123.0
    assert json.loads(path.read_text())["fit_version"] == FIT_VERSION
    path.write_text('{"constants": {"c0": 1,')  # damaged, not old: named, not silently measured again
    with pytest.raises(ConfigError, match=f"stored calibration of this setup, {path} .*is damaged: not valid JSON.* "
                                          "delete it to measure again"):
        specfit.build(specfit.compose(overrides))


def test_a_few_cycles_slowed_by_a_busy_host_do_not_move_the_constants():
    """Another process or a descheduled thread only adds time: 3 cycles of 40 taking a second more
    (as measured under load) are left out, and the rest fit exactly; plain least squares would
    have put them into c0 and c_draft0."""
    truth = TRUTH
    records = measured_cycles(np.random.default_rng(1), slow_draft=(5, 17), slow_total=(9, 17, 30))
    fitted = fit_constants(records)
    for key in ("c0", "c_tok", "c_miss", "c_hit", "c_level", "c_draft0"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-6, abs=1e-12), key
    compute = np.array([r.total_seconds - r.draft_seconds - r.h2d_seconds for r in records])
    x = np.array([[1.0, r.verified + 1, r.hits + r.misses] for r in records])
    plain = nnls(x, compute)  # what the slow cycles do to a plain fit: constants off by far more than 50%
    assert np.max(np.abs(plain / [truth.c0, truth.c_tok, truth.c_hit] - 1)) > 0.5


CALIBRATED = ["model=tiny", "drafter=eagle3", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=6",
              "selector=specfit", "cost_model=union", "predictor=history", "cache.capacity=4", "max_new_tokens=8"]


def test_a_calibration_measured_under_load_is_stored_provisional_and_never_measured_twice(tmp_path, monkeypatch,
                                                                                          capsys):
    """A held-out median error above POOR_FIT (a busy host): stored, marked provisional, said in one
    line; the next engine of the setup uses it (said once) and refines it, without measuring again."""
    from specfit.calibrate import run as calibration
    from specfit.calibrate.refine import ProvisionalRefiner
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    measure = calibration.run_calibration

    def busy(*args, **kwargs):
        constants, report = measure(*args, **kwargs)
        return constants, {**report, "cycle_time_ape_median": 2.9}

    monkeypatch.setattr("specfit.api.run_calibration", busy)
    engine = specfit.build(specfit.compose(CALIBRATED))
    err = capsys.readouterr().err
    assert "predicts its held-out cycle times poorly (median error 290%)" in err and "stored as provisional" in err
    (path,) = tmp_path.glob("calibration/*.json")
    assert json.loads(path.read_text())["constants"]["provisional"] is True
    assert engine.cost_model.constants.provisional
    assert any(isinstance(listener, ProvisionalRefiner) for listener in engine.listeners)

    def never(*args, **kwargs):
        raise AssertionError("measured a second time")

    monkeypatch.setattr("specfit.api.run_calibration", never)
    again = specfit.build(specfit.compose(CALIBRATED))
    assert "is provisional (measured on a busy host, held-out error 290%)" in capsys.readouterr().err
    assert again.cost_model.constants.provisional
    assert again.generate([5, 17, 99], max_new_tokens=4).token_ids  # decodes with it
    monkeypatch.setattr("specfit.api.run_calibration", measure)
    forced = specfit.build(specfit.compose([*CALIBRATED, "calibration=force"]))  # measured again, in full
    assert "calibrating the cost model for this setup" in capsys.readouterr().err
    assert not forced.cost_model.constants.provisional
    assert json.loads(path.read_text())["constants"]["provisional"] is False


def test_a_poor_fit_stored_by_an_earlier_version_is_provisional_not_measured_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    specfit.build(specfit.compose(CALIBRATED))
    (path,) = tmp_path.glob("calibration/*.json")
    data = json.loads(path.read_text())
    data["report"]["cycle_time_ape_median"] = 2.9  # as a calibration stored under load before provisional fits
    data["constants"].pop("provisional")
    data["constants"]["c0"] = 0.137
    path.write_text(json.dumps(data))
    capsys.readouterr()
    engine = specfit.build(specfit.compose(CALIBRATED))
    assert "is provisional" in capsys.readouterr().err
    assert engine.cost_model.constants.c0 == 0.137 and engine.cost_model.constants.provisional
    data["report"]["kept_despite_error"] = True  # what `specfit calibrate` stores: trusted as it is
    path.write_text(json.dumps(data))
    trusted = specfit.build(specfit.compose(CALIBRATED)).cost_model.constants
    assert trusted.c0 == 0.137 and not trusted.provisional


def test_calibration_off_never_measures_and_a_setup_that_cannot_draft_never_calibrates(tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="calibration=off, and this setup has no stored calibration"):
        specfit.build(specfit.compose([*CALIBRATED, "calibration=off"]))
    no_drafts = [o for o in CALIBRATED if not o.startswith("drafter")] + ["drafter=none"]
    plain = specfit.build(specfit.compose(no_drafts))  # no tree is ever selected from
    assert "calibrating" not in capsys.readouterr().err and not list(tmp_path.glob("calibration/*.json"))
    assert plain.generate([5, 17, 99], max_new_tokens=3).token_ids
    specfit.build(specfit.compose(CALIBRATED))  # auto: measured once
    assert specfit.build(specfit.compose([*CALIBRATED, "calibration=off"])).cost_model.calibrated  # off: the stored one
    (path,) = tmp_path.glob("calibration/*.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fit_version": 1}))  # an older fit: auto measures again, off uses it
    capsys.readouterr()
    assert specfit.build(specfit.compose([*CALIBRATED, "calibration=off"])).cost_model.calibrated
    assert "measuring it again" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="calibration='sometimes'"):
        specfit.compose([*CALIBRATED, "calibration=sometimes"])


class _Refined:
    """What the refiner reads of an engine: its cost model's constants (set through set_constants)."""

    def __init__(self, constants):
        self.cost_model = UnionCostModel(constants=constants)
        self.listeners = []


def test_the_refiner_stores_what_the_runs_refined_and_trusts_it_once_it_predicts_them(tmp_path, monkeypatch):
    from specfit.calibrate import refine

    monkeypatch.setattr(refine, "save_constants", lambda path, c, engine, report: path.write_text(
        json.dumps({"constants": c.to_json(), "report": report})))
    records = measured_cycles(np.random.default_rng(3))

    def decode_with(constants):
        engine = _Refined(dataclasses.replace(constants, provisional=True, source="online"))
        refiner = refine.ProvisionalRefiner(engine, tmp_path / "c.json")
        for r in records:
            refiner.cycle_ended(r)
        refiner.decode_ended()
        return engine, refiner, json.loads((tmp_path / "c.json").read_text())

    _, _, stored = decode_with(dataclasses.replace(TRUTH, c0=TRUTH.c0 * 20))  # refined, still far off
    assert stored["constants"]["provisional"] is True and stored["report"]["refined_from_cycles"] == len(records)
    engine, refiner, stored = decode_with(TRUTH)  # refined to the truth
    assert stored["constants"]["provisional"] is False and not engine.cost_model.constants.provisional
    (tmp_path / "c.json").unlink()
    refiner.decode_ended()  # trusted now: nothing more to store
    assert not (tmp_path / "c.json").exists()


def test_calibrate_command_prints_error_and_path(tmp_path, monkeypatch, capsys):
    from specfit.cli import main

    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path / "home"))
    main(["calibrate", "model=tiny", "drafter=eagle3", "drafter.depth=2", "drafter.top_k=3", "predictor=history",
          "max_new_tokens=12", f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert "held-out cycle-time error: median" in out and "stored: " in out


def test_calibrate_command_stores_the_constants_in_the_file_named(tmp_path, monkeypatch, capsys):
    """`specfit calibrate cost_model.calibration=FILE` writes FILE (it used to write $SPECFIT_HOME only)."""
    from specfit.cli import main

    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path / "home"))
    file = tmp_path / "mine" / "calibration.json"
    main(["calibrate", "model=tiny", "max_new_tokens=12", f"cost_model.calibration={file}",
          f"hydra.run.dir={tmp_path / 'run'}"])
    assert f"stored: {file}" in capsys.readouterr().out
    assert load_constants(file).c0 > 0 and not (tmp_path / "home").exists()
    file.write_text("{damaged")  # a damaged file is measured over, not a reason to refuse
    main(["calibrate", "model=tiny", "max_new_tokens=12", f"cost_model.calibration={file}",
          f"hydra.run.dir={tmp_path / 'run2'}"])
    assert load_constants(file).c0 > 0


def test_a_calibration_file_given_in_code_is_loaded_when_bound(tmp_path, monkeypatch, capsys):
    """UnionCostModel(calibration=FILE) given to an Engine (no specfit.build) loads FILE, a path or a
    string, ~ expanded; a damaged one is named when the constants are first needed."""
    from specfit.calibrate.store import save_constants

    monkeypatch.setenv("HOME", str(tmp_path))
    file = tmp_path / "c.json"

    def engine(cost_model: UnionCostModel) -> Engine:
        return Engine(tiny_model(), drafter=ScriptedDrafter(reference(), vocab=256), selector=SpecFitSelector(),
                      predictor=HistoryPredictor(), cost_model=cost_model, device="cpu")

    save_constants(file, CONSTANTS, engine(UnionCostModel(constants=CONSTANTS)), {})
    for given in (file, str(file), "~/c.json"):
        model = UnionCostModel(calibration=given)
        engine(model)
        assert model.calibrated and model.constants.c0 == CONSTANTS.c0
    assert UnionCostModel(calibration=None).calibration == "auto"
    file.write_text("{damaged")
    model = UnionCostModel(calibration=file)
    engine(model)
    with pytest.raises(ConfigError, match=f"cost_model.calibration={file}"):
        model.constants


def test_specfit_without_cost_model_or_predictor_is_a_clear_error_before_decoding():
    ref = reference()
    with pytest.raises(ConfigError, match="selector=specfit needs a cost_model: set cost_model=..."):
        Engine(tiny_model(), drafter=ScriptedDrafter(ref, vocab=256), selector=SpecFitSelector(),
               predictor=HistoryPredictor(), device="cpu")
    with pytest.raises(ConfigError, match="selector=specfit needs a predictor"):
        Engine(tiny_model(), drafter=ScriptedDrafter(ref, vocab=256), selector=SpecFitSelector(),
               cost_model=UnionCostModel(constants=CONSTANTS), device="cpu")


def test_exact_search_never_predicts_less_than_the_baselines():
    """On the same problems, the exact subtree's predicted throughput bounds greedy's and the prefix's."""
    from specfit.search import evaluate
    from specfit.search.synthetic import paper_scale_problem

    rng = np.random.default_rng(0)
    for _ in range(20):
        problem = paper_scale_problem(rng, n_nodes=40, layers=8, experts=32, top_k=4)
        allowed = np.ones(problem.n_nodes, dtype=bool)
        best = evaluate(problem, SpecFitSelector().choose(problem, allowed))[2]
        for other in (GreedySelector(), PrefixSelector()):
            assert evaluate(problem, other.choose(problem, allowed))[2] <= best * (1 + 1e-9)


def _specfit_engine(constants, **selector_kw):
    ref = reference()
    drafter = ScriptedDrafter(ref, vocab=256, branching=3, depth=4, miss=0.0)
    return Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=drafter, selector=SpecFitSelector(**selector_kw),
                  cost_model=UnionCostModel(constants=constants), predictor=HistoryPredictor(), device="cpu")


def test_draft_stop_rule_stops_when_a_level_cannot_pay_and_continues_when_it_can():
    dear = CostConstants(c0=2e-3, c_tok=1e-5, c_miss=1e-5, c_hit=1e-6, c_level=10.0)  # another level costs 10 s
    cheap = CostConstants(c0=2e-3, c_tok=1e-6, c_miss=1e-6, c_hit=1e-7, c_level=0.0)
    stopped = _specfit_engine(dear, draft_gate=False).generate(PROMPT, max_new_tokens=16)
    assert all(c.levels == 1 for c in stopped.cycles)
    full = _specfit_engine(cheap, draft_time="modelled").generate(PROMPT, max_new_tokens=16)
    assert max(c.levels for c in full.cycles) == 4
    no_rule = _specfit_engine(dear, early_stop=False, draft_gate=False).generate(PROMPT, max_new_tokens=16)
    assert all(c.levels == 4 for c in no_rule.cycles)
    for out in (stopped, full, no_rule):
        assert out.token_ids == reference()[len(PROMPT):][:16]


def test_draft_gate_skips_drafting_while_it_does_not_pay_and_probes_with_backoff():
    # drafting a level costs 1 s while a plain pass costs milliseconds: no drafted cycle can pay
    dear = CostConstants(c0=2e-3, c_tok=1e-5, c_miss=1e-5, c_hit=1e-6, c_level=1.0)
    engine = _specfit_engine(dear, draft_time="modelled", gate_max_backoff=4)
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == reference()[len(PROMPT):][:24]
    drafted = [c.levels > 0 for c in out.cycles]
    # probes after 1, 2, 4, 4, ... skipped cycles
    runs, count = [], 0
    for d in drafted[1:]:
        if d:
            runs.append(count)
            count = 0
        else:
            count += 1
    assert drafted[0] and runs[:3] == [1, 2, 4] and set(runs[3:]) <= {4}
    assert all(c.verified == 0 and c.drafted == 0 for c, d in zip(out.cycles, drafted) if not d)


def test_draft_gate_keeps_drafting_while_it_pays():
    cheap = CostConstants(c0=2e-3, c_tok=1e-6, c_miss=1e-6, c_hit=1e-7, c_level=1e-6)
    out = _specfit_engine(cheap, draft_time="modelled").generate(PROMPT, max_new_tokens=24)
    assert all(c.levels > 0 for c in out.cycles)
    assert out.token_ids == reference()[len(PROMPT):][:24]


def test_draft_gate_compares_tokens_per_second_drafting_with_plain_passes():
    from specfit.plugins._kit.selection import DraftGate

    gate = DraftGate(max_backoff=8)
    assert gate.should_draft()
    gate.plain(0.012)
    gate.speculated(committed=3, seconds=0.030)  # 100 tok/s drafting vs 83 passes/s: pays
    assert gate.should_draft()
    gate.speculated(committed=1, seconds=0.030)  # decayed: 3.1 tok / 0.051 s = 61 tok/s: loses
    assert not gate.should_draft() and gate.should_draft()  # skip one cycle, then probe
    with pytest.raises(ConfigError, match="gate_max_backoff"):
        DraftGate(max_backoff=0)
    with pytest.raises(ConfigError, match="gate_probe_budget"):
        DraftGate(probe_budget=0.0)
    with pytest.raises(ConfigError, match="gate_probe_budget"):  # checked with the gate off too
        SpecFitSelector(draft_gate=False, gate_probe_budget=2.0)


def _losing_gate(budget: float, committed: int, seconds: float):
    """A gate that has lost every probe so far (a plain pass: 10 ms, one token), its backoff run up."""
    from specfit.plugins._kit.selection import DraftGate

    gate = DraftGate(max_backoff=256, probe_budget=budget)
    gate.plain(0.010)
    skips = []
    for _ in range(12):
        gate.speculated(committed=committed, seconds=seconds)
        skips.append(gate.skip_left)
        gate.skip_left = 0
    return skips


def test_draft_gate_spaces_losing_probes_by_what_they_cost():
    """Between losing probes the backoff doubles, but only as far as keeping the probes' cost within
    gate_probe_budget of the tokens needs: a probe that gives up a whole pass (2 passes' time for one
    token) waits 1 / budget cycles, one that gives up a tenth of a token ten times fewer."""
    assert _losing_gate(0.01, committed=1, seconds=0.020)[-1] == 100  # loss 1 token a probe
    assert _losing_gate(0.01, committed=1, seconds=0.011)[-1] == 10  # loss 0.1 token
    assert _losing_gate(0.02, committed=1, seconds=0.020)[-1] == 50
    assert _losing_gate(0.01, committed=1, seconds=1.0)[:5] == [1, 2, 4, 8, 16]  # the doubling still leads
    assert _losing_gate(0.01, committed=1, seconds=1.0)[-1] == 256  # ... up to gate_max_backoff


def test_draft_gate_lucky_probe_does_not_restart_the_backoff():
    """A probe that wins by luck halves the back-off instead of resetting it: when drafting then
    loses again, the gate skips about as long as before the win, not 1, 2, 4, ... cycles anew;
    drafting that keeps winning is back at back-off 1 after log2(max_backoff) wins."""
    from specfit.plugins._kit.selection import DraftGate

    gate = DraftGate(max_backoff=64, probe_budget=1e-3)  # a small budget: the back-off decides
    gate.plain(0.010)
    for _ in range(6):  # losing probes: 1 token in 50 ms against 100 plain passes a second
        gate.speculated(committed=1, seconds=0.050)
        gate.skip_left = 0
    assert gate.backoff == 64
    gate.speculated(committed=16, seconds=0.050)  # a lucky probe: the decayed means say drafting wins
    assert gate.should_draft() and gate.backoff == 32
    gate.speculated(committed=1, seconds=0.050)  # the next drafted cycle loses again
    assert gate.skip_left == 32
    for wins in range(6):  # drafting that wins every cycle: 32, 16, ..., 1
        gate.speculated(committed=40, seconds=0.050)
        assert gate.skip_left == 0
    assert gate.backoff == 1


def test_draft_gate_state_saved_before_it_counted_cycles_still_loads():
    from specfit.plugins._kit.selection import DraftGate

    gate = DraftGate()
    old = {"spec_tokens": 2.5, "spec_seconds": 0.05, "plain_passes": 3.0, "plain_seconds": 0.03,
           "backoff": 8, "skip_left": 3}
    gate.load_state(old)
    assert gate.skip_left == 3 and gate.backoff == 8 and 1.0 <= gate.spec_cycles <= 2.5


def _select_once(selector: SpecFitSelector, draft_seconds: float) -> float:
    """One ``select`` on a one-node tree, ``draft_seconds`` into the cycle, under a cost model that
    charges 1 ms per pass and nothing else: the selector predicts T(S*) = 1 ms + ``draft_seconds``
    and 1 ms for a plain pass. Returns the predicted T(S*)."""
    spec = MoESpec(num_layers=1, num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.float32,
                   module_names=("experts",), decoder_layers=(0,))
    cost_model = UnionCostModel(constants=CostConstants(c0=1e-3, c_tok=0.0, c_miss=0.0, c_hit=0.0))
    cost_model.bind(spec)
    tree = DraftTree(root_token=0)
    tree.add_level([-1], [1], [np.log(0.5)])
    tree.expert_rows(1, 2)[0] = [0, 1]
    tree.root_experts = np.array([[0, 1]], dtype=np.int32)
    ctx = SelectionContext(resident=np.zeros((1, 4), dtype=bool), draft_seconds=draft_seconds, max_depth=4,
                           max_nodes=8, cost_model=cost_model)
    return selector.select(tree, ctx).predicted["seconds"]


def test_draft_gate_times_plain_passes_when_drafting_is_measured():
    selector = SpecFitSelector(gate_max_backoff=2)
    assert _select_once(selector, 0.029) == pytest.approx(0.030)  # the cost model thinks a plain pass takes 1 ms
    selector.observe_time(True, 2, 0.030)  # 67 tok/s drafting vs a predicted 1000 passes/s: skip
    assert not selector.should_draft()
    for _ in range(3):  # measured plain passes are slow: 20 passes/s
        selector.observe_time(False, 1, 0.050)
    _select_once(selector, 0.029)
    selector.observe_time(True, 2, 0.030)  # 67 tok/s against the measured plain rate now: pays
    assert selector.should_draft()


def test_draft_gate_re_times_plain_passes_while_drafting_wins():
    """A slow plain time (measured under load, or loaded from an earlier run's state) must not keep
    the gate drafting for ever: every gate_max_backoff drafted cycles one cycle is plain."""
    selector = SpecFitSelector(gate_max_backoff=3)
    selector.gate.plain(0.050)  # a stale measurement: 20 passes/s
    plain_cycles = []
    for cycle in range(7):
        if not selector.should_draft():
            plain_cycles.append(cycle)
            selector.observe_time(False, 1, 0.050)
            continue
        _select_once(selector, 0.029)
        selector.observe_time(True, 2, 0.030)  # 67 tok/s: drafting wins against 20 passes/s
    assert plain_cycles == [3]  # after three drafted cycles, one plain probe; then drafting again


class NoisyClock:
    """``time.perf_counter`` on a loaded machine: every reading comes a random delay (exponential,
    mean ``scale`` seconds) later than the last, so every measured interval is jittered."""

    def __init__(self, seed: int, scale: float = 2e-3) -> None:
        self.rng, self.scale, self.delay = random.Random(seed), scale, 0.0
        self.real = time.perf_counter

    def __call__(self) -> float:
        self.delay += self.rng.expovariate(1.0 / self.scale)
        return self.real() + self.delay


@pytest.mark.parametrize(("draft_time", "repeatable"), [("modelled", True), ("measured", False)])
def test_on_a_noisy_clock_only_modelled_draft_time_repeats_its_decisions(monkeypatch, draft_time, repeatable):
    """Two runs, each on its own noisy clock. With measured draft time the stop rule, the subtree and
    the draft gate see the noise, so the decisions differ (the test can fail); with modelled draft
    time they depend on no clock and are identical. The output is the target's either way."""
    runs = []
    for seed in (1, 2):
        engine = _specfit_engine(CONSTANTS, draft_time=draft_time)
        with monkeypatch.context() as patch:
            patch.setattr(time, "perf_counter", NoisyClock(seed))
            out = engine.generate(PROMPT, max_new_tokens=16)
        assert out.token_ids == reference()[len(PROMPT):][:16]
        runs.append([(c.levels, c.verified, c.committed) for c in out.cycles])
    assert all(any(levels for levels, _, _ in run) for run in runs)  # both drafted
    assert (runs[0] == runs[1]) is repeatable


def test_cache_oblivious_model_ignores_residency_and_stays_lossless():
    ref = reference()
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=ScriptedDrafter(ref, vocab=256, branching=3, depth=3),
                    selector=SpecFitSelector(), cost_model=UnionCostModel(cache_aware=False, constants=CONSTANTS),
                    predictor=HistoryPredictor(), device="cpu")
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == ref[len(PROMPT):][:16]
    tree = DraftTree(root_token=1)
    tree.add_level([-1], [2], [-0.1])
    tree.expert_rows(engine.spec.num_layers, 2)[0] = [0, 1]
    tree.root_experts = np.zeros((engine.spec.num_layers, 2), dtype=np.int32)
    problem = engine.cost_model.problem(tree, np.ones(1), np.ones((engine.spec.num_layers, engine.spec.num_experts), bool), 0.0)
    assert not problem.resident.any() and problem.c_hit == problem.c_miss


def test_online_refit_keeps_copy_cost_through_a_window_without_misses():
    from specfit.types.stats import CycleRecord

    model = UnionCostModel(online=True, constants=CONSTANTS, refit_every=8)
    rng = np.random.default_rng(1)
    for _ in range(16):
        n, hits = int(rng.integers(0, 20)), int(rng.integers(2, 40))
        total = CONSTANTS.cycle_seconds(n, 0, hits, 1e-3)
        model.observe(CycleRecord(drafted=n, levels=2, verified=n, accepted=0, committed=1, draft_seconds=1e-3,
                                  select_seconds=0.0, verify_seconds=total - 1e-3, h2d_seconds=0.0, total_seconds=total,
                                  misses=0, hits=hits, union=[]))
    c = model.constants
    assert c.source == "online"
    assert c.c_miss - c.c_hit == pytest.approx(CONSTANTS.c_miss - CONSTANTS.c_hit)
    assert c.c_tok == pytest.approx(CONSTANTS.c_tok, rel=1e-6) and c.c_hit == pytest.approx(CONSTANTS.c_hit, rel=1e-6)


def test_calibrated_acceptance_learns_from_unverified_nodes_after_a_greedy_pass():
    from specfit.plugins.acceptance.calibrated import CalibratedAcceptance

    tree = DraftTree(root_token=0)
    a, b = tree.add_level([-1, -1], [10, 11], [np.log(0.1), np.log(0.05)])
    calibrator = CalibratedAcceptance(prior_weight=1.0)
    before = calibrator.estimate(tree)
    for _ in range(20):  # nothing verified, but the target's next token was always a's
        tree.greedy_next = 10
        calibrator.observe(tree, verified=[], accepted=[])
    after = calibrator.estimate(tree)
    assert after[a] > 0.9 > before[a] and after[b] < before[b]
    tree.greedy_next = None  # sampling: only verified nodes teach
    seen = calibrator.seen.sum()
    calibrator.observe(tree, verified=[], accepted=[])
    assert calibrator.seen.sum() == seen


def test_rate_objective_maximises_the_surplus_at_the_decodes_throughput():
    """objective=rate: the first cycle (no throughput yet) maximises N / T; later ones maximise
    N - lambda * T at the decayed committed tokens per second the selector was told of."""
    from specfit.plugins._kit.selection import RateTracker

    tracker = RateTracker(decay=0.5)
    assert tracker.rate is None
    tracker.add(2, 0.01)
    tracker.add(1, 0.0)  # a cycle without a positive time teaches nothing
    assert tracker.rate == pytest.approx(200.0)
    tracker.add(1, 0.01)
    assert tracker.rate == pytest.approx((0.5 * 2 + 1) / (0.5 * 0.01 + 0.01))

    selector = SpecFitSelector(objective="rate", draft_gate=False)
    assert selector.surplus_rate() is None
    selector.observe_time(False, 1, 0.02)
    assert selector.surplus_rate() == pytest.approx(50.0)
    assert SpecFitSelector().surplus_rate() is None  # ratio: never a surplus
    with pytest.raises(ConfigError, match="selector.objective='fastest'"):
        SpecFitSelector(objective="fastest")
    with pytest.raises(ConfigError, match="selector.objective"):
        specfit.compose(["model=tiny", "drafter=eagle3", "selector=specfit", "selector.objective=fastest",
                         "cost_model=union", "predictor=history"])


def test_rate_objective_compiles_its_kernel_when_bound(monkeypatch):
    """bind's warm-up pays the JIT compilation of the kernel the cycles will use: for objective=rate
    that is solve_surplus too, not only solve (else the first cycle with a rate compiles it, and
    its measured time feeds the rate and the gate)."""
    import specfit.plugins.selectors.specfit as module

    calls = []
    real = module.solve_surplus
    monkeypatch.setattr(module, "solve_surplus", lambda *a, **k: calls.append(a) or real(*a, **k))
    SpecFitSelector(objective="rate", draft_gate=False)._warm_up()
    assert calls
    calls.clear()
    SpecFitSelector(draft_gate=False)._warm_up()
    assert not calls


def test_history_scores_every_node_of_a_level_as_it_would_one_at_a_time():
    """The predictor estimates a level's nodes in one array: the same probabilities as the
    per-token formula (the token's frequencies with a prior of the layer-wide ones, then the
    pair's with a prior of that), and the top-k of them as picks."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), predictor=HistoryPredictor(pair_weight=0.7),
                    device="cpu")
    predictor, spec = engine.predictor, engine.spec
    k = spec.top_k
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 12, size=200).tolist()
    routing = np.stack([np.stack([rng.choice(spec.num_experts, k, replace=False) for _ in range(spec.num_layers)])
                        for _ in tokens])
    predictor.observe(tokens, routing)
    predictor.flush()
    previous, level = [None, 3, 5, 7, 99, 2], [4, 4, 6, 7, 1, 11]  # a pair seen or not, a previous unseen
    frequency = predictor.overall / predictor.overall.sum(axis=1, keepdims=True)
    picks, probs = predictor._top_k(previous, level)
    for p, t, row, got in zip(previous, level, picks, probs):
        own = predictor.single.get(t)
        want = (own + predictor.prior * k * frequency) / (own[0].sum() / k + predictor.prior)
        pair = predictor.pairs.get((p, t)) if p is not None else None
        if pair is not None:
            w = predictor.pair_weight
            want = (w * pair + 2 * want) / (w * pair[0].sum() / k + 2)
        np.testing.assert_allclose(got, np.minimum(want, 1), rtol=1e-5)
        np.testing.assert_allclose(got.sum(axis=1), k, rtol=1e-4)  # k experts a token and layer, in expectation
        best = -np.sort(-want, axis=1)[:, :k]  # the k largest, likeliest first (ties may pick either)
        np.testing.assert_allclose(np.take_along_axis(np.minimum(want, 1), row, 1), np.minimum(best, 1), rtol=1e-5)
        assert all(len(set(r)) == k for r in row.tolist())


def test_history_is_sure_of_what_a_token_always_does_and_unsure_of_a_new_token():
    """A token routed the same way twenty times: its experts near 1, the rest near 0. A token never
    seen: its probe's picks at about one half, nothing above."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), predictor=HistoryPredictor(), device="cpu")
    predictor, spec = engine.predictor, engine.spec
    fixed = np.stack([np.arange(spec.top_k)] * spec.num_layers)
    predictor.observe([5] * 20, np.stack([fixed] * 20))
    predictor.flush()
    picks, probs = predictor._top_k([5], [5])
    assert (np.sort(picks[0], 1) == fixed).all()
    assert probs[0][:, : spec.top_k].min() > 0.9 and probs[0][:, spec.top_k :].max() < 0.1
    picks, probs = predictor._top_k([5], [9])  # never seen: the router probe
    chosen = np.take_along_axis(probs[0], picks[0], 1)
    assert 0.45 < chosen.min() and chosen.max() < 0.5 + spec.top_k / spec.num_experts
    tree = DraftTree(root_token=9)
    predictor._last_token = 5
    tree.add_level([ROOT, ROOT], [5, 9], [-0.1, -2.0])
    predictor.predict(tree, range(2))
    tree.add_level([0], [5], [-0.2])  # the tree grows: the new row is predicted, the old ones kept
    predictor.predict(tree, range(2, 3))
    assert len(tree.expert_probs) >= 3 and tree.expert_probs.shape[1:] == (spec.num_layers, spec.num_experts)
    assert np.isnan(tree.expert_probs[3:]).all()  # rows beyond the nodes: not predicted
    np.testing.assert_allclose(tree.root_expert_probs, predictor._top_k([5], [9])[1][0])
    for node, (previous, token) in enumerate([(9, 5), (9, 9), (5, 5)]):
        picks, probs = predictor._top_k([previous], [token])
        np.testing.assert_allclose(tree.expert_probs[node], probs[0])
        assert (tree.experts[node] == picks[0]).all()


@pytest.mark.parametrize("max_keys", [65536, 40])
def test_history_holds_observations_until_it_predicts_and_counts_them_as_it_would_at_once(max_keys):
    """Cycles that do not draft only hold their observations; the next prediction counts them all
    (also past the backlog bound): the same tables, recency order and predictions as counting each
    observation when it arrives."""
    import specfit.plugins.predictors.history as history

    spec = tiny_model().config
    layers, experts, k = spec.num_hidden_layers, spec.num_experts, spec.num_experts_per_tok
    rng = np.random.default_rng(2)
    lazy, eager = (Engine(tiny_model(), cache=LRUCache(capacity=4), predictor=HistoryPredictor(max_keys=max_keys),
                          device="cpu").predictor for _ in range(2))
    tree = DraftTree(root_token=3)
    tree.add_level([-1, -1], [4, 5], [-0.1, -0.2])
    for step, n in enumerate([60, *[1] * 150, 2, 3, *[1] * 140, 20]):
        tokens = rng.integers(0, 30, size=n).tolist()
        routing = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(layers)]) for _ in range(n)])
        lazy.observe(tokens, routing)
        eager.observe(tokens, routing)
        eager.flush()
        if step in (0, 200, 293):
            assert lazy._backlog_tokens < history._BACKLOG
            lazy.predict(tree, range(len(tree)))
            got = tree.expert_rows(layers, k).copy(), tree.root_experts.copy()
            tree.root_experts = None
            eager.predict(tree, range(len(tree)))
            assert np.array_equal(got[0], tree.expert_rows(layers, k)) and np.array_equal(got[1], tree.root_experts)
            tree.root_experts = None
            for name in ("single", "pairs"):
                a, b = getattr(lazy, name).table, getattr(eager, name).table
                assert list(a) == list(b) and all(np.array_equal(a[key], b[key]) for key in a)
            assert np.array_equal(lazy.overall, eager.overall) and lazy._last_token == eager._last_token


@pytest.mark.parametrize("max_keys", [65536, 40, 8])
def test_history_counts_a_prompt_at_once_as_it_would_token_by_token(max_keys):
    """A long observation (a prompt) is counted per distinct token and pair: the same tables, the
    same recency order and, where the table overflows, the same keys evicted as the token loop."""
    import specfit.plugins.predictors.history as history

    spec = tiny_model().config
    layers, experts = spec.num_hidden_layers, spec.num_experts
    rng = np.random.default_rng(1)
    batched, looped = (Engine(tiny_model(), cache=LRUCache(capacity=4), predictor=HistoryPredictor(max_keys=max_keys),
                              device="cpu").predictor for _ in range(2))
    for n in (200, 1, 3, 40, 17, 2, 300):
        tokens = rng.integers(0, 30, size=n).tolist()
        routing = np.stack([np.stack([rng.permutation(experts)[:spec.num_experts_per_tok + 1] for _ in range(layers)])
                            for _ in range(n)])  # wider than top-k: the predictor keeps the first k
        batched.observe(tokens, routing)
        batched.flush()
        many, history._MANY = history._MANY, 10**9
        try:
            looped.observe(tokens, routing)
            looped.flush()
        finally:
            history._MANY = many
    for name in ("single", "pairs"):
        a, b = getattr(batched, name).table, getattr(looped, name).table
        assert list(a) == list(b)
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    assert np.array_equal(batched.overall, looped.overall) and batched._last_token == looped._last_token


def test_a_head_retrained_in_place_is_another_setup(tmp_path):
    """The gate's and the estimator's stored state belong to one head: the same path with other
    weights must get another setup hash, the same weights the same one."""
    from specfit.files import head_weights_digest

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    assert head_weights_digest(str(head)) is None and head_weights_digest(None) is None  # no weights
    (head / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    first = head_weights_digest(str(head))
    assert first == head_weights_digest(str(head))
    (head / "model.safetensors").write_bytes(bytes(reversed(range(256))) * 4096)  # same size, retrained
    assert head_weights_digest(str(head)) not in (None, first)


class _ChainCosts:
    """A cost model for one layer with no experts: a cycle costs c0 plus the draft time spent."""

    constants = CostConstants(c0=6e-3, c_tok=0.0, c_miss=0.0, c_hit=0.0, c_level=3e-3)

    def problem(self, tree, accept, resident, spent, arriving=None):
        from specfit.search import SearchProblem

        n = len(tree)
        return SearchProblem(parents=np.asarray(tree.parents), accept=accept, node_experts=-np.ones((n, 1, 1)),
                             root_experts=-np.ones((1, 1)), resident=np.zeros((1, 1), dtype=bool),
                             c0=self.constants.c0, c_tok=0.0, c_miss=0.0, c_hit=0.0, draft_time=spent)


def _levels_drafted(selector, accept_of_depth, max_depth=6) -> int:
    """Draft a chain level by level (3 ms a level, modelled) until ``selector`` stops; its levels."""
    from specfit.types.tree import DraftTree
    from specfit.interfaces import SelectionContext

    tree = DraftTree(root_token=0)
    selector.accept_estimates = lambda t: np.array([accept_of_depth(d) for d in t.depths], dtype=float)
    ctx = SelectionContext(resident=np.zeros((1, 1), dtype=bool), draft_seconds=0.0, max_depth=max_depth,
                           max_nodes=64, cost_model=_ChainCosts())
    for depth in range(1, max_depth + 1):
        tree.add_level([-1 if depth == 1 else len(tree) - 1], [depth], [0.0])
        if selector.select(tree, ctx).stop:
            return depth
    return max_depth


def test_projected_stop_rule_drafts_on_while_levels_keep_paying_and_the_method_rule_stops_early():
    """Every drafted token accepted (a_v = 1), a level costs half a pass: each level raises N / T
    (2/12, 3/15, 4/18 ... tokens per ms), but by less than the level before, so the method's rule
    (net gain against one more level's cost) stops at level 2 while the projected one drafts on."""
    sure = lambda depth: 1.0  # noqa: E731
    assert _levels_drafted(SpecFitSelector(draft_time="modelled"), sure) == 2
    assert _levels_drafted(SpecFitSelector(draft_time="modelled", stop_rule="projected"), sure) == 6
    # acceptance halving at each level: the projected gain falls with it, and drafting stops
    halving = lambda depth: 0.5 ** depth  # noqa: E731
    assert _levels_drafted(SpecFitSelector(draft_time="modelled", stop_rule="projected"), halving) <= 2
    with pytest.raises(ConfigError, match="selector.stop_rule='ahead' must be one of method, projected"):
        SpecFitSelector(stop_rule="ahead")


def test_projected_stop_rule_keeps_greedy_output_identical():
    cheap = CostConstants(c0=2e-3, c_tok=1e-6, c_miss=1e-6, c_hit=1e-7, c_level=1e-4)
    out = _specfit_engine(cheap, draft_time="modelled", stop_rule="projected").generate(PROMPT, max_new_tokens=16)
    assert out.token_ids == reference()[len(PROMPT):][:16]
    assert max(c.levels for c in out.cycles) > 1  # it drafted, so the rule was asked
