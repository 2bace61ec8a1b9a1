"""`specfit record` and `specfit replay` from the command line."""

from __future__ import annotations

import json

import pytest

from specfit.cli import main
from specfit.config import compose
from specfit.errors import ConfigError
from specfit.trace.replay import draft_time_mode

COSTS = ["cost_model.c0=0.002", "cost_model.c_tok=0.0001", "cost_model.c_miss=0.0004", "cost_model.c_hit=0.00002",
         "cost_model.c_level=0.0005"]
DRAFTER = ["drafter.top_k=3", "drafter.depth=3", "drafter.total_tokens=6"]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    """A trace of the tiny model with a random EAGLE-3 head, recorded without a cost model (so no
    calibration runs: replays then give their constants)."""
    root = tmp_path_factory.mktemp("rec")
    main(["record", "model=tiny", *DRAFTER, "~cost_model", "prompt_ids=[5,17,99,3,42]", "max_new_tokens=12",
          f"trace.path={root / 'trace'}", f"hydra.run.dir={root / 'run'}"])
    row = json.loads((root / "run" / "results.jsonl").read_text())
    assert row["command"] == "record" and row["positions"] == 11 and row["cost_constants"] is None
    return root / "trace"


def test_record_writes_a_loadable_trace(trace_dir, tmp_path, capsys):
    from specfit.trace import load_trace

    trace = load_trace(trace_dir)
    assert trace.positions == 11 and trace.meta.drafter == {"name": "eagle3", "depth": 3, "total_tokens": 6}
    assert trace.meta.config["model"]["builtin"] == "tiny-qwen3-moe"
    with pytest.raises(SystemExit) as info:  # an existing trace is not overwritten by mistake
        main(["record", "model=tiny", "~cost_model", "prompt_ids=[5]", f"trace.path={trace_dir}",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2 and "trace.overwrite=true" in capsys.readouterr().err


def test_resuming_a_complete_trace_checks_its_config(trace_dir, tmp_path, capsys):
    """resume=true on a complete trace: nothing to do with the same config, an error with another one."""
    same = ["record", "model=tiny", *DRAFTER, "~cost_model", "prompt_ids=[5,17,99,3,42]", "max_new_tokens=12",
            f"trace.path={trace_dir}", "resume=true", f"hydra.run.dir={tmp_path / 'same'}"]
    main(same)
    assert "already complete" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([a.replace("prompt_ids=[5,17,99,3,42]", "prompt_ids=[5]") for a in same])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err
    assert f"trace.path={trace_dir}: the complete trace there was recorded with another config (prompt_ids" in err


def test_replay_prints_the_table_against_the_oracle(trace_dir, tmp_path, capsys):
    main(["replay", f"trace.path={trace_dir}", "methods=[ar,eagle3,specfit]", "cache.capacity=4", *COSTS,
          "replay.draft_time=modelled", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "of oracle" in out and "pred tok/s" in out and "positions/s" in out
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"ar", "eagle3", "specfit", "oracle"}
    assert rows["ar"]["draft_levels_per_cycle"] == 0 and rows["ar"]["tokens_per_cycle"] == 1.0
    assert rows["oracle"]["oracle_fraction"] == 1.0 and rows["oracle"]["selector"] == "oracle"
    assert 0 < rows["eagle3"]["oracle_fraction"] <= 1.0
    for r in rows.values():
        assert r["positions"] == 11 and r["decode_tokens"] == 11 and r["cache_slots_per_layer"] == 4
        assert r["cost_constants"]["c_miss"] == 0.0004 and r["config"]["cache"]["capacity"] == 4
    assert rows["specfit"]["predictor"] == "history" and "predictor_recall" in rows["specfit"]


def test_replay_never_relabels_another_drafters_trees(trace_dir, tmp_path, capsys):
    """The trace holds EAGLE-3's trees: a method that drafts with ngram, or asks for other draft
    settings, is refused naming both, before anything is replayed."""
    for run, (methods, needle) in enumerate((("[ar,ngram]", "method ngram drafts with drafter=ngram, but the trace"),
                                             ("[ar,deeper]", "method deeper sets drafter.depth=5, but the trace"))):
        with pytest.raises(SystemExit) as info:
            main(["replay", f"trace.path={trace_dir}", f"methods={methods}", *COSTS,
                  '+method_presets.deeper=["drafter=eagle3","drafter.depth=5","selector=eagle3"]',
                  f"hydra.run.dir={tmp_path / str(run)}"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and "\n" not in err and needle in err, err
        assert "holds the trees of drafter=eagle3" in err or "was drafted with depth=3" in err
        assert not (tmp_path / str(run) / "results.jsonl").exists()
    main(["replay", f"trace.path={trace_dir}", "methods=[ar,same]", *COSTS, "cache.capacity=4",
          '+method_presets.same=["drafter=eagle3","drafter.depth=3","selector=eagle3"]', f"hydra.run.dir={tmp_path / 'ok'}"])
    assert "same" in capsys.readouterr().out  # the settings it was recorded with replay


def test_replay_single_method_with_oracle_predictor(trace_dir, tmp_path, capsys):
    main(["replay", f"trace.path={trace_dir}", "selector=specfit", "selector.draft_gate=false", "predictor=oracle",
          "cache=none", *COSTS,
          f"hydra.run.dir={tmp_path}"])
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["specfit", "oracle"]
    assert rows[0]["predictor_recall"] == 1.0 and rows[0]["draft_time"] == "measured"  # the default


@pytest.mark.parametrize("args,message", [
    (["trace.path=null"], "set trace.path=DIR"),
    (["trace.path=/nonexistent/trace"], "no such directory"),
    (["trace.path={trace}"], "carries no cost constants"),
    (["trace.path={trace}", *COSTS, "replay.draft_time=wall"], "replay.draft_time='wall'"),
    (["trace.path={trace}", *COSTS, "drafter.depth=5"], "only drafter=none (plain decoding) applies"),
    (["trace.path={trace}", *COSTS, "model=demo"], "recorded with a model of 4 MoE layers, 16 experts"),
])
def test_replay_errors_are_one_line(trace_dir, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["replay", *[a.format(trace=trace_dir) for a in args], f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfit: error:") and message in err and "\n" not in err


def test_a_trace_with_a_token_outside_the_models_vocabulary_is_refused(trace_dir, tmp_path, capsys):
    import shutil

    import numpy as np

    damaged = tmp_path / "trace"
    shutil.copytree(trace_dir, damaged)
    seq = sorted(damaged.glob("seq-*.npz"))[0]
    with np.load(seq) as npz:
        arrays = dict(npz)
    assert arrays["verified_argmax"].size  # the recorder verified drafted nodes
    arrays["verified_argmax"][0] = 10**8  # a hand edit the format checks cannot see: no vocabulary recorded
    np.savez(seq, **arrays)
    with pytest.raises(SystemExit) as info:
        main(["replay", f"trace.path={damaged}", *COSTS, f"hydra.run.dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    assert "the trace holds token id 100000000, outside the vocabulary of" in capsys.readouterr().err


def test_oracle_selector_in_a_live_run_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "model=tiny", "drafter=eagle3", *DRAFTER, "selector=oracle", "prompt_ids=[5,17]",
              "max_new_tokens=4", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2 and "specfit replay" in capsys.readouterr().err


def test_configs_compose_with_trace_keys():
    cfg = compose(["model=tiny", "trace.path=/x", "trace.overwrite=true"], config_name="record")
    assert cfg.trace.path == "/x" and cfg.drafter.name == "eagle3" and cfg.cost_model.name == "union"
    cfg = compose(["trace.path=/x", "replay.draft_time=modelled", "cache.capacity=8"], config_name="replay")
    assert cfg.replay.draft_time == "modelled" and cfg.selector.name == "specfit" and cfg.predictor.name == "history"
    # the selector's vocabulary (measured|modelled); "recorded", the earlier name of measured, still composes
    assert compose(["trace.path=/x"], config_name="replay").replay.draft_time == "measured"
    assert compose(["trace.path=/x", "replay.draft_time=recorded"], config_name="replay").replay.draft_time == "recorded"
    assert draft_time_mode("recorded") == draft_time_mode("measured") == "measured"
    with pytest.raises(ConfigError, match="replay.draft_time='wall'"):
        draft_time_mode("wall")
    with pytest.raises(Exception, match="trace.pth"):
        compose(["trace.pth=/x"], config_name="replay")
