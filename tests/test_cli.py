"""The command line and the programmatic API on a checkpoint saved with save_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model

import specfit
from specfit.cli import main, plain_overrides

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen3-MoE checkpoint in the HF layout (safetensors, config.json), no tokenizer."""
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model().save_pretrained(path)
    return path


def test_programmatic_example_matches_hf_generate(checkpoint):
    cfg = specfit.compose([f"model.path={checkpoint}", "drafter=none", "cache=lru", "cache.capacity=3"])
    engine = specfit.build(cfg)
    out = engine.generate(PROMPT, max_new_tokens=32)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint).generate(
        torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(PROMPT):].tolist()
    assert out.token_ids == reference
    assert out.text is None  # no tokenizer in this checkpoint
    assert out.stats["expert_cache_misses"] > 0
    assert engine.runtime.resident().sum(axis=1).max() <= 3
    with pytest.raises(specfit.errors.ConfigError, match="no tokenizer"):
        engine.generate("hello")


def test_checkpoint_dtype_is_kept_unless_overridden(checkpoint, tmp_path):
    tiny_model(dtype=torch.bfloat16).save_pretrained(tmp_path)
    engine = specfit.build(specfit.compose([f"model.path={tmp_path}", "cache=full"]))
    assert engine.spec.dtype == torch.bfloat16
    engine = specfit.build(specfit.compose([f"model.path={tmp_path}", "cache=full", "model.dtype=float32"]))
    assert engine.spec.dtype == torch.float32


def test_generate_command_writes_results(checkpoint, tmp_path, capsys):
    main(["generate", f"model.path={checkpoint}", "prompt_ids=[5,17,99]", "cache=lru", "cache.capacity=4",
          "max_new_tokens=8", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "tokens=8" in out and "misses=" in out
    row = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    for key in ("output_throughput", "mean_tpot_ms", "spec_decode_acceptance_length", "num_drafts", "draft_tokens",
                "accepted_tokens", "expert_cache_hits", "expert_cache_misses", "h2d_bytes", "h2d_seconds",
                "verified_nodes", "experts_per_layer_union"):
        assert key in row, key
    assert row["num_output_tokens"] == 8 and row["config"]["cache"]["capacity"] == 4


def test_bad_override_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "model=tiny", "cache.capacit=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfit: error:") and "capacit" in err and "\n" not in err


def test_model_error_is_one_line_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["generate", "model.path=/nope/model", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "specfit: error: model.path=/nope/model: no such directory"


def test_multirun_sweep_runs_jobs_in_one_process(tmp_path, capsys):
    main(["generate", "-m", "model=tiny", "prompt_ids=[5,17,99]", "max_new_tokens=4", "cache.capacity=2,4",
          f"hydra.sweep.dir={tmp_path}"])
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/results.jsonl"))]
    assert [r["cache_slots_per_layer"] for r in rows] == [2, 4]


def test_plain_overrides_skip_flags_and_sweeps():
    assert plain_overrides(["--cfg", "job", "a=1", "-m", "b=1,2", "hydra.run.dir=x", "+c=3"]) == ["a=1", "+c=3"]


def test_console_script_cfg_job_and_plugins():
    exe = Path(sys.executable).with_name("specfit")
    cfg = subprocess.run([exe, "generate", "model=tiny", "cache=none", "--cfg", "job"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stderr
    assert "name: none" in cfg.stdout and "builtin: tiny-qwen3-moe" in cfg.stdout
    listed = json.loads(subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, check=True).stdout)
    assert {e["name"] for e in listed if e["kind"] == "cache"} >= {"lru", "none", "full"}


def test_bench_runs_methods_side_by_side(tmp_path, capsys):
    main(["bench", "model=tiny", "methods=[ar,eagle3_nocache,specfit,mine]", "drafter.top_k=3",
          "drafter.num_speculative_tokens=2",  # vLLM's name for the depth
          '+method_presets.mine=["drafter=eagle3","selector=chain","cache=lru"]',  # a preset given inline
          "drafter.total_tokens=6", "prompt_ids=[5,17,99]", "max_new_tokens=6", "cache.copy=torch",
          "cost_model.c0=0.001", "cost_model.c_tok=0.0001", "cost_model.c_miss=0.0004", "cost_model.c_hit=0.00001",
          "answers_dir=answers", f"hydra.run.dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert "output tokens identical across methods: yes" in out and "vs eagle3_nc" in out
    assert err.count("bench: ") == 4 and "bench: 4/4 runs" in err  # not a terminal: one line per run
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["ar", "eagle3_nocache", "specfit", "mine"]
    assert rows[2]["selector"] == "specfit" and "predictor_recall" in rows[2] and rows[3]["selector"] == "chain"
    drafter = rows[2]["config"]["drafter"]
    assert (drafter["depth"], drafter["num_speculative_tokens"]) == (2, 2)  # the alias given and the depth it set
    # only the selector that uses a cost model has one (the others are not calibrated)
    assert [r["config"]["cost_model"] is not None for r in rows] == [False, False, True, False]
    for row in rows:  # Spec-Bench's answer file per method
        answer = json.loads((tmp_path / "answers" / f"{row['method']}.jsonl").read_text())
        choice = answer["choices"][0]
        assert (answer["question_id"], answer["model_id"], choice["new_tokens"]) == ("inline-0", row["method"], [6])
        assert choice["turns"] == [" ".join(map(str, row["output_ids"]))] and choice["wall_time"][0] > 0
        assert sum(choice["accept_lengths"]) + 1 == 6  # tokens committed per cycle, after the prefill's token


def test_bench_warmup_decodes_each_engine_before_the_timed_runs(tmp_path, capsys, monkeypatch):
    from specfit.api import Engine

    calls = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(id(self)) or real(self, *a, **k))
    main(["bench", "model=tiny", "methods=[ar,ar_prefetch]", "prompt_ids=[5,17,99]", "max_new_tokens=4",
          "warmup=2", "repeats=1", f"hydra.run.dir={tmp_path}"])
    assert "output tokens identical across methods: yes" in capsys.readouterr().out
    assert len(calls) == 2 * 2 + 2 and len(set(calls[:4])) == 2  # two untimed rounds over both engines first
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["ar", "ar_prefetch"]  # the warm-up decodes are not results
    assert all(r["config"]["warmup"] == 2 for r in rows)


def test_unknown_method_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "model=tiny", "methods=[warp_drive]", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2 and "warp_drive" in capsys.readouterr().err


def test_bench_typo_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "model=tiny", "drafter.topk=3"])
    err = capsys.readouterr().err.strip()
    assert "topk" in err and "\n" not in err


@pytest.mark.parametrize("command", ["train-tokenizer", "train-target", "train-drafter"])
def test_trainer_commands_are_configured_by_their_dataclass(command, capsys):
    """In-process (the console script itself is covered by test_console_script_cfg_job_and_plugins)."""
    main([command, "--cfg", "job"])
    assert "out_dir:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([command, "no_such_key=1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no_such_key" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cache.copy=foo", "unknown copy engine cache.copy='foo'"),
        ("cache.link.profile=foo", "unknown link profile 'foo'"),
        ("cache.link.bandwidth_gbps=0", "cache.link.bandwidth_gbps must be a finite number > 0"),
        ("cache.link.bandwidth_gbps=inf", "cache.link.bandwidth_gbps must be a finite number > 0, got inf"),
        ("cache.link.latency_us=inf", "cache.link.latency_us must be a finite number >= 0"),
        # waited in wall-clock time: 1e-9 GB/s seemed to hang, 1e-30 overflowed time.sleep
        ("cache.link.bandwidth_gbps=1e-9", "cache.link.bandwidth_gbps=1e-09 is below 0.001 GB/s"),
        ("cache.link.latency_us=1e15", "cache.link.latency_us=1e+15 is above 1e+06"),
        ("model.attn_implementation=flash_attention_2", "model.attn_implementation='flash_attention_2'"),
        ("model.device=tpu", "model.device='tpu' is not a torch device"),
        ("cost_model.c0=-1", "cost_model.c0=-1"),
    ],
)
def test_bad_settings_are_one_line_errors(override, message, tmp_path, capsys):
    extra = ["cache.copy=emulated"] if override.startswith("cache.link") else []
    if override.startswith("cost_model"):
        extra = ["drafter=eagle3", "selector=specfit", "cost_model=union", "predictor=history", "cost_model.c_tok=0",
                 "cost_model.c_miss=0", "cost_model.c_hit=0"]
    with pytest.raises(SystemExit) as info:
        main(["generate", "model=tiny", "prompt_ids=[1,2]", "max_new_tokens=2", *extra, override,
              f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and message in err and "\n" not in err


@pytest.fixture(scope="module")
def trained_head(checkpoint, tmp_path_factory):
    """An EAGLE-3 head that `specfit train-drafter` trains on the checkpoint in a few seconds (the
    target's greedy continuations repeat, so 40 steps on random token rows teach the head them)."""
    root = tmp_path_factory.mktemp("head")
    np.save(root / "train.npy", np.random.default_rng(0).integers(0, 256, (64, 33)))
    main(["train-drafter", f"target_dir={checkpoint}", f"out_dir={root / 'head'}", "include_builtin_data=false",
          f"train_files=[{root / 'train.npy'}]", "seq_len=32", "batch_size=8", "max_steps=40", "lr=1e-2",
          "warmup_steps=5", "ttt_steps=3", "eval_windows=0", "progress=false", f"hydra.run.dir={root / 'run'}"])
    return root / "head"


def eagle3_engine(checkpoint, head, cache="lru"):
    return specfit.build(specfit.compose([f"model.path={checkpoint}", "drafter=eagle3", f"drafter.path={head}",
                                          "selector=eagle3", f"cache={cache}", "cache.capacity=3", "drafter.top_k=4",
                                          "drafter.depth=3", "drafter.total_tokens=12"]))


@pytest.mark.parametrize("cache", ["lru", "none", "full"])
def test_eagle3_on_a_saved_checkpoint_matches_hf_generate(checkpoint, trained_head, cache):
    """The issue's acceptance check: a save_pretrained Qwen3-MoE, an EAGLE-3 head, every cache; the
    head `specfit train-drafter` made, so verification both accepts and rejects drafted tokens."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint).generate(
        torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(PROMPT):].tolist()
    engine = eagle3_engine(checkpoint, trained_head, cache)
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == reference
    assert out.stats["spec_decode_acceptance_length"] > 1.5 and out.stats["verified_nodes_per_cycle"] == 12
    assert len(out.stats["experts_per_layer_union_by_layer"]) == engine.spec.num_layers
    assert out.stats["experts_per_layer_union"] > engine.spec.top_k  # a 13-token pass needs more than one token's experts


def test_a_head_trained_by_the_cli_beats_a_random_head(checkpoint, trained_head):
    """Tokens committed per cycle over two prompts (about 45 tokens): the random head of the same
    shape commits about 1.05 (almost nothing accepted), the trained one about 1.9; same output."""
    runs = {}
    for head in ("random", trained_head):
        engine = eagle3_engine(checkpoint, head)
        runs[head] = [engine.generate(p, max_new_tokens=24) for p in (PROMPT, [12, 200, 31, 7, 99, 140, 3])]
    per_cycle = {head: sum(c.committed for o in outs for c in o.cycles) / sum(len(o.cycles) for o in outs)
                 for head, outs in runs.items()}
    assert [o.token_ids for o in runs[trained_head]] == [o.token_ids for o in runs["random"]]
    assert per_cycle[trained_head] > per_cycle["random"] + 0.5, per_cycle


def test_demo_runs_its_comparison_on_the_users_prompt(tmp_path, capsys):
    """`specfit demo prompt=...`: the prompt replaces the demo's workload (naming a workload too is an error)."""
    main(["demo", "prompt=Once upon a time", "methods=[ar]", "max_new_tokens=2", "repeats=1",
          f"hydra.run.dir={tmp_path}"])
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["ar"] and rows[0]["num_output_tokens"] == 2
    # the rows and the table say the prompt was the user's, not the demo's prompts file
    assert (rows[0]["workload"], rows[0]["workload_kind"], rows[0]["workload_split"]) == ("inline", "inline", "prompt")
    assert "workload inline (prompt)" in capsys.readouterr().out


def test_a_key_only_some_methods_have_reaches_them_through_their_presets(tmp_path):
    """The base's prefetch=none has no gate, ar_prefetch's prefetch=auto has: Hydra composes the base
    with every override first, so the override joins the presets that take it instead of failing."""
    main(["bench", "model=tiny", "prompt_ids=[1,2,3]", "methods=[ar,ar_prefetch]", "prefetch.gate=false",
          "prefetch.source=own", "max_new_tokens=2", f"hydra.run.dir={tmp_path}"])
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows["ar"]["config"]["prefetch"] == {"name": "none"}
    assert rows["ar_prefetch"]["config"]["prefetch"]["gate"] is False
    assert rows["ar_prefetch"]["config"]["prefetch"]["source"] == "own"


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_a_folded_key_keeps_how_the_user_added_a_preset(prefix):
    from specfit.commands.bench import fold_method_overrides

    given = ["model=tiny", f'{prefix}method_presets.mine=["prefetch=lookahead"]', "methods=[ar,mine]",
             "prefetch.gate=false"]
    assert fold_method_overrides(given, "bench") == [
        "model=tiny", "methods=[ar,mine]", f'{prefix}method_presets.mine=["prefetch=lookahead","prefetch.gate=false"]']


def test_sweep_jobs_expand_as_hydras_basic_sweeper():
    from specfit.cli import sweep_jobs

    jobs = sweep_jobs(["-m", "model=tiny", "max_new_tokens=2,3", "seed=range(0,2)", "hydra.sweep.dir=x"])
    assert jobs == [["model=tiny", "max_new_tokens=2", "seed=0"], ["model=tiny", "max_new_tokens=2", "seed=1"],
                    ["model=tiny", "max_new_tokens=3", "seed=0"], ["model=tiny", "max_new_tokens=3", "seed=1"]]
    assert sweep_jobs(["+extra=1,2"]) == [["+extra=1"], ["+extra=2"]]
    assert sweep_jobs(["model=tiny", "x=interval(0,1)"]) == []  # only its sweeper enumerates it


def test_generate_says_when_the_context_limit_cut_the_output_short(tmp_path, capsys) -> None:
    from specfit.cli import main

    main(["generate", "model=tiny", "prompt_ids=[1,2,3,4,5]", "max_new_tokens=4", "model.max_model_len=6",
          f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert ("stopped after 1 of max_new_tokens=4: the prompt (5 tokens) and output reached the context limit, "
            "6 (model.max_model_len=6)") in out
    main(["generate", "model=tiny", "prompt_ids=[1,2,3]", "max_new_tokens=2", f"hydra.run.dir={tmp_path}/b"])
    assert "stopped after" not in capsys.readouterr().out  # max_new_tokens reached: nothing to say
