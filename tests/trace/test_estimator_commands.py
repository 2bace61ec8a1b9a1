"""The commands around acceptance estimators and cost profiles on one recorded trace:
`specfit replay replay.cost_profile=...`, `specfit fit-acceptance`, and `specfit report` of their rows."""

from __future__ import annotations

import json
import re

import pytest

from specfit.cli import main
from specfit.types.cost_profiles import COST_PROFILES
from specfit.commands.report import write_report

PROFILE = "qwen3-30b-a3b-h200-pcie5"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    """The tiny model with a random EAGLE-3 head (nothing accepted), no cost model (no calibration)."""
    root = tmp_path_factory.mktemp("est")
    main(["record", "model=tiny", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=4", "~cost_model",
          "workload.prompt_ids=[[5,17,99,3],[12,200,31,7]]", "max_new_tokens=8", f"trace.path={root / 'trace'}",
          f"hydra.run.dir={root / 'rec'}"])
    return root / "trace"


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replay_with_a_profile_charges_its_constants_and_says_time_is_modelled(trace_dir, tmp_path, capsys):
    main(["replay", f"trace.path={trace_dir}", "methods=[ar,specfit_learned]", "cache.capacity=4", "replay.oracle=false",
          f"replay.cost_profile={PROFILE}", "cost_model.c_tok=0.001", "replay.draft_time=measured",
          f"hydra.run.dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert f"time: modelled on cost profile {PROFILE}" in out and "draft time: modelled" in out
    assert f"replay.cost_profile={PROFILE} models the drafting time too: replay.draft_time=measured" in err
    assert "with cost_model.c_tok as given, not measured" in out  # the header says the profile was not all
    rows = {r["method"]: r for r in rows_of(tmp_path / "results.jsonl")}
    profile = COST_PROFILES[PROFILE].constants
    assert set(rows) == {"ar", "specfit_learned"}
    for r in rows.values():
        assert r["time"] == "modelled" and r["cost_profile"] == PROFILE and r["draft_time"] == "modelled"
        assert r["cost_constants"]["c_miss"] == pytest.approx(profile.c_miss)
        assert r["cost_constants"]["c_tok"] == 0.001  # an explicit constant overrides the profile's
    assert rows["ar"]["predicted_seconds"] >= rows["ar"]["cycles"] * (profile.c0 + 0.001)
    learned = rows["specfit_learned"]  # the estimator's forecasts are scored in the replay
    assert learned["acceptance_estimator"] == "learned" and learned["acceptance_nodes"] > 0
    assert "acceptance_brier" not in rows["ar"]
    text = write_report([tmp_path / "results.jsonl"], tmp_path / "report").read_text()  # replays get their table
    assert "0 decoding runs and 2 replayed methods" in text and f"Time predicted by cost profile {PROFILE}" in text
    table = text.split("## Replay of", 1)[1]
    assert "pred tok/s" in table and "specfit_learned" in table and re.search(r"\n\s*ar\s+lru:4\s", table)


def test_fit_acceptance_writes_a_model_replay_uses_and_scores_report_plots(trace_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "fit"
    main(["fit-acceptance", f"trace.path={trace_dir}", f"out_dir={out}", "held_out_fraction=0.5",
          f"hydra.run.dir={tmp_path / 'run'}"])
    printed = capsys.readouterr().out
    assert "learned (fitted)" in printed and "brier" in printed
    model = json.loads((out / "learned.json").read_text())
    assert model["samples"] > 0 and set(model["scores"]) == {"path_prob", "calibrated", "learned", "learned (fitted)"}
    rows = rows_of(out / "results.jsonl")
    assert [r["acceptance_estimator"] for r in rows] == ["path_prob", "calibrated", "learned", "learned (fitted)"]
    assert all(r["acceptance_nodes"] == rows[0]["acceptance_nodes"] > 0 for r in rows)

    main(["replay", f"trace.path={trace_dir}", "selector=specfit", "acceptance=learned",
          f"acceptance.state_file={out / 'learned.json'}", "replay.draft_time=modelled", "cache.capacity=4",
          "cost_model.c0=0.002", "cost_model.c_tok=0.0001", "cost_model.c_miss=0.0004", "cost_model.c_hit=0.00002",
          f"hydra.run.dir={tmp_path / 'rep'}"])
    assert rows_of(tmp_path / "rep" / "results.jsonl")[0]["acceptance_estimator"] == "learned"

    pytest.importorskip("matplotlib")
    from specfit.commands import report as report_module
    drawn = {}
    save = report_module._save

    def keep(fig, where, name):  # noqa: ANN001, ANN202
        drawn[name] = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines]
        return save(fig, where, name)

    monkeypatch.setattr(report_module, "_save", keep)
    report = write_report([out / "results.jsonl", tmp_path / "rep" / "results.jsonl"], tmp_path / "report")
    text = report.read_text()
    assert "## Acceptance estimators" in text and "learned (fitted)" in text and "specfit (learned)" in text
    assert (tmp_path / "report" / "reliability.png").stat().st_size > 1000
    # the diagonal, then one line per scored estimator: its bins' mean forecast and observed frequency
    lines = drawn["reliability.png"]
    assert lines[0][0] == "calibrated" and lines[0][1] == [0, 1]
    scored = {r["acceptance_estimator"]: r["acceptance_reliability"] for r in rows}
    assert {label for label, _, _ in lines[1:]} >= set(scored)
    for label, xs, ys in lines[1:]:
        if label in scored:
            assert xs == pytest.approx([b[0] for b in scored[label]]) and ys == pytest.approx([b[1] for b in scored[label]])
            assert xs and all(0.0 <= v <= 1.0 for v in xs + ys)


def test_fit_acceptance_needs_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit-acceptance", f"out_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2 and "trace.path" in capsys.readouterr().err


def test_fit_acceptance_names_a_missing_held_out_trace(trace_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit-acceptance", f"trace.path={trace_dir}", "held_out=[/nonexistent]", f"out_dir={tmp_path}",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2 and "held_out=/nonexistent: no such directory" in capsys.readouterr().err


def test_fit_acceptance_names_a_held_out_trace_with_nothing_drafted(trace_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    main(["record", "model=tiny", "drafter=none", "~cost_model", "prompt_ids=[5,17,99,3]", "max_new_tokens=4",
          f"trace.path={plain}", f"hydra.run.dir={tmp_path / 'rec'}"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["fit-acceptance", f"trace.path={trace_dir}", f"held_out=[{plain}]", f"out_dir={tmp_path / 'fit'}",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    assert f"held_out=['{plain}']: no drafted trees to score the estimators on" in capsys.readouterr().err


def test_fit_acceptance_refuses_its_trace_as_held_out_and_notes_another_model(trace_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:  # the same trace, by another spelling of its path
        main(["fit-acceptance", f"trace.path={trace_dir}", f"held_out=[{trace_dir}/../{trace_dir.name}]",
              f"out_dir={tmp_path / 'fit'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2 and "is the training trace" in capsys.readouterr().err
    other = tmp_path / "mixtral"
    main(["record", "model=tiny-mixtral", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=4", "~cost_model",
          "prompt_ids=[5,17,99,3]", "max_new_tokens=6", f"trace.path={other}", f"hydra.run.dir={tmp_path / 'rec'}"])
    capsys.readouterr()
    main(["fit-acceptance", f"trace.path={trace_dir}", f"held_out=[{other}]", f"out_dir={tmp_path / 'fit'}",
          f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert f"note: held_out trace {other} was recorded with another model (builtin:tiny-mixtral)" in err


def test_replay_notes_once_that_eagle3_uses_no_acceptance_estimates(trace_dir, tmp_path, capsys):
    """The note is said once per method (not again for the warmup's throwaway plugins), and not for
    the oracle row the replay adds (it knows the outcomes)."""
    main(["replay", f"trace.path={trace_dir}", "selector=eagle3", "acceptance=learned", "replay.warmup=2",
          "cache.capacity=4", "cost_model.c0=0.002", "cost_model.c_tok=0.0001", "cost_model.c_miss=0.0004",
          "cost_model.c_hit=0.00002", f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert err.count("note: acceptance=learned is not used by") == 1 and "selector=eagle3" in err
    assert {r["method"] for r in rows_of(tmp_path / "results.jsonl")} == {"eagle3", "oracle"}


def test_a_fitted_model_records_its_setup_and_another_setup_loading_it_says_so(trace_dir, tmp_path, capsys):
    """fit-acceptance copies the trace's target and head into learned.json; a replay of a trace of
    another model, or a live engine of another model, that loads it notes the difference (used as
    given); the setup it was fitted on loads it without a note."""
    import specfit
    from specfit import messages as config_messages
    out = tmp_path / "fit"
    main(["fit-acceptance", f"trace.path={trace_dir}", f"out_dir={out}", "held_out_fraction=0",
          f"hydra.run.dir={tmp_path / 'run'}"])
    model_file = out / "learned.json"
    setup = json.loads(model_file.read_text())["setup"]
    assert setup["model"] == "builtin:tiny-qwen3-moe" and setup["drafter"]["name"] == "eagle3"
    replay = ["replay", "selector=specfit", "acceptance=learned", f"acceptance.state_file={model_file}",
              "replay.oracle=false", "cache.capacity=4", "cost_model.c0=0.002", "cost_model.c_tok=0.0001",
              "cost_model.c_miss=0.0004", "cost_model.c_hit=0.00002"]
    config_messages._noted.clear()
    capsys.readouterr()
    main([*replay, f"trace.path={trace_dir}", f"hydra.run.dir={tmp_path / 'same'}"])
    assert "fitted on a trace of another setup" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # the out_dir for the file: the estimator's own hint, not a read error
        main([*replay[:2], "acceptance=learned", f"acceptance.state_file={out}", *replay[4:], f"trace.path={trace_dir}",
              f"hydra.run.dir={tmp_path / 'dir'}"])
    assert info.value.code == 2 and "is a directory, not a file (fit-acceptance writes learned.json" in capsys.readouterr().err

    other = tmp_path / "mixtral"
    main(["record", "model=tiny-mixtral", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=4", "~cost_model",
          "prompt_ids=[5,17,99,3]", "max_new_tokens=6", f"trace.path={other}", f"hydra.run.dir={tmp_path / 'rec'}"])
    capsys.readouterr()
    main([*replay, f"trace.path={other}", f"hydra.run.dir={tmp_path / 'other'}"])
    err = capsys.readouterr().err
    assert f"acceptance.state_file={model_file} was fitted on a trace of another setup (its model differs" in err

    config_messages._noted.clear()
    specfit.build(specfit.compose(["model=tiny-mixtral", "drafter=eagle3", "selector=specfit", "cost_model=union",
                                   "predictor=history", "acceptance=learned", f"acceptance.state_file={model_file}"]),
                  calibrate_now=False)
    assert "was fitted on a trace of another setup (its model differs" in capsys.readouterr().err
