"""Bad files get one clear line: checkpoints, EAGLE-3 heads, workloads, calibrations, results (issue 11).

Each case builds its bad file in ``tmp_path`` (from a tiny saved checkpoint or head) and is run
twice: through the API (``specfit.compose`` + ``specfit.build`` or the reader itself), which must
raise the right exception type with a message naming the file or key, and through the CLI in
process (``specfit.cli.main``), which must exit 2 with a single ``specfit: error:`` line on
stderr and no traceback. Every case must finish within a few seconds.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import tiny_model

import specfit
from specfit.cli import main
from specfit.errors import ConfigError, ModelError

PROMPT = "prompt_ids=[5,17,99]"
SECONDS = 20  # per case, API or CLI: a bad file must fail fast, not after a long load or a hang


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3-MoE checkpoint and an EAGLE-3 head for it, saved once; cases copy and break them."""
    from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, random_head, save_head

    root = tmp_path_factory.mktemp("good")
    model = tiny_model()
    model.save_pretrained(root / "ckpt")
    save_head(random_head(head_config_for(model)), root / "head")
    return {"ckpt": root / "ckpt", "head": root / "head"}


@dataclass
class Case:
    """``make(tmp_path, good)`` writes the bad file and returns the overrides (or report paths) using it."""

    make: Callable[[Path, dict[str, Path]], list[str]]
    error: type[Exception]
    message: str  # a fragment of the one-line message; "{dir}" stands for the bad file or directory
    command: str = "generate"  # "report": the overrides are results files
    api: str = "build"  # "build": compose + build (+ generate); "report": read_rows; "workload": load_workload
    generate: bool = False  # the problem shows only when decoding (non-finite logits)
    extra: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- helpers


def ckpt(tmp: Path, good: dict[str, Path]) -> Path:
    d = tmp / "ckpt"
    shutil.copytree(good["ckpt"], d)
    return d


def edit_json(file: Path, **changes: object) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def edit_weights(d: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def model_case(breaker: Callable[[Path], object], *extra: str) -> Callable[[Path, dict[str, Path]], list[str]]:
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        d = ckpt(tmp, good)
        breaker(d)
        return [f"model.path={d}", *extra]
    return make


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def shard(d: Path, missing: bool) -> None:
    """Rename the weights to a shard and write an index naming them (and a second shard, if ``missing``)."""
    from safetensors import safe_open

    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as fh:
        weight_map = {k: "model-00001-of-00002.safetensors" for k in fh.keys()}
    if missing:
        weight_map[sorted(weight_map)[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def dense(d: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shutil.rmtree(d)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(d)


def ungated_moe(d: Path) -> None:
    """A config of an MoE architecture whose experts have no gate (Nemotron-H: up and down only)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("nemotron_h", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, hybrid_override_pattern="*E")
    config.save_pretrained(d)


def corrupt_bin(d: Path) -> None:
    """Weights as a PyTorch file that is not one (a cut-off download of pytorch_model.bin)."""
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip archive")


def d2t_beyond_vocab(d: Path) -> None:
    """A reduced-vocabulary head whose draft-to-target offsets point past the target's vocabulary."""
    other_head(draft_vocab_size=32)(d)
    edit_weights(d, lambda s: s["d2t"].fill_(1000))


def head_case(breaker: Callable[[Path], object]) -> Callable[[Path, dict[str, Path]], list[str]]:
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        d = tmp / "head"
        shutil.copytree(good["head"], d)
        breaker(d)
        return ["model=tiny", "drafter=eagle3", "selector=eagle3", f"drafter.path={d}"]
    return make


def other_head(**changes: object) -> Callable[[Path], None]:
    """A head saved for a differently shaped model (its files are consistent, it fits another target)."""
    def breaker(d: Path) -> None:
        from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, random_head, save_head

        shutil.rmtree(d)
        save_head(random_head(replace(head_config_for(tiny_model()), **changes)), d)
    return breaker


def workload(content: bytes, message: str) -> Case:
    """A jsonl workload file holding ``content``; the API case reads it with load_workload."""
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        f = tmp / "prompts.jsonl"
        f.write_bytes(content)
        return ["model=tiny", "workload=jsonl", f"workload.path={f}"]
    return Case(make, ConfigError, message, api="workload")


GOOD_CONSTANTS = {"c0": 0.001, "c_tok": 0.0001, "c_miss": 0.0004, "c_hit": 0.00001}


def calibration_case(content: bytes) -> Callable[[Path, dict[str, Path]], list[str]]:
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        f = tmp / "calibration.json"
        f.write_bytes(content)
        return ["model=tiny", "drafter=eagle3", "selector=specfit", "cost_model=union", "predictor=history",
                f"cost_model.calibration={f}"]
    return make


def constants(**changes: object) -> bytes:
    data = {**GOOD_CONSTANTS, **changes}
    return json.dumps({"constants": {k: v for k, v in data.items() if v is not None}}).encode()


GOOD_ROW = {"output_throughput": 10.0, "num_output_tokens": 8, "total_seconds": 0.8, "method": "ar", "workload": "w",
            "cycles": 8, "config": {}}


def results_case(*lines: bytes) -> Callable[[Path, dict[str, Path]], list[str]]:
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        f = tmp / "results.jsonl"
        f.write_bytes(b"".join(line + b"\n" for line in lines))
        return [str(f)]
    return make


def torn_results_case(make_row: Callable[[], bytes]) -> Callable[[Path, dict[str, Path]], list[str]]:
    """A results file whose only line stops mid-row (a run interrupted while writing it)."""
    def make(tmp: Path, good: dict[str, Path]) -> list[str]:
        f = tmp / "results.jsonl"
        f.write_bytes(make_row()[:40])
        return [str(f)]
    return make


def row(**changes: object) -> bytes:
    return json.dumps({**GOOD_ROW, **changes}).encode()


# ----------------------------------------------------------------------------- the table

CASES: dict[str, Case] = {
    # checkpoints
    "model_missing_dir": Case(lambda tmp, good: [f"model.path={tmp / 'nope'}"], ModelError, "no such directory"),
    "model_path_is_file": Case(lambda tmp, good: [f"model.path={good['ckpt'] / 'config.json'}"], ModelError,
                               "not a directory"),
    "model_no_config": Case(model_case(lambda d: (d / "config.json").unlink()), ModelError, "no config.json"),
    "model_config_bad_json": Case(model_case(lambda d: (d / "config.json").write_text('{"model_type": "qwen3_moe",')),
                                  ModelError, "config.json: not valid JSON"),
    "model_config_not_utf8": Case(model_case(lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xff"}')),
                                  ModelError, "config.json: not UTF-8"),
    "model_config_not_object": Case(model_case(lambda d: (d / "config.json").write_text("[1, 2]")), ModelError,
                                    "config.json: holds a JSON list"),
    "model_unknown_architecture": Case(model_case(lambda d: edit_json(d / "config.json", model_type="warp_drive")),
                                       ModelError, "warp_drive"),
    "model_dense_llama": Case(model_case(dense), ModelError, "is not a mixture-of-experts model"),
    "model_unsupported_moe": Case(model_case(ungated_moe), ModelError, "unsupported MoE architecture"),
    "model_truncated_safetensors": Case(model_case(lambda d: truncate(d / "model.safetensors")), ModelError,
                                        "model.safetensors is truncated"),
    "model_empty_safetensors": Case(model_case(lambda d: (d / "model.safetensors").write_bytes(b"")), ModelError,
                                    "model.safetensors is not a safetensors file"),
    "model_garbage_safetensors": Case(model_case(lambda d: (d / "model.safetensors").write_bytes(b"\x10" + b"\0" * 99)),
                                      ModelError, "model.safetensors is not a safetensors file"),
    "model_corrupt_bin": Case(model_case(corrupt_bin), ModelError, "cannot load the checkpoint"),
    "model_no_weights": Case(model_case(lambda d: (d / "model.safetensors").unlink()), ModelError, "no weights there"),
    "model_index_missing_shard": Case(model_case(lambda d: shard(d, missing=True)), ModelError,
                                      "names shard model-00002-of-00002.safetensors, which is missing"),
    "model_index_bad_json": Case(
        model_case(lambda d: (shard(d, missing=False), (d / "model.safetensors.index.json").write_text("{"))),
        ModelError, "model.safetensors.index.json: not valid JSON"),
    "model_missing_tensor": Case(model_case(lambda d: edit_weights(d, lambda s: s.pop("model.norm.weight"))),
                                 ModelError, "lacks tensors the config needs: model.norm.weight"),
    "model_hidden_size_mismatch": Case(model_case(lambda d: edit_json(d / "config.json", hidden_size=128)), ModelError,
                                       "weights do not fit config.json"),
    "model_expert_count_mismatch": Case(model_case(lambda d: edit_json(d / "config.json", num_local_experts=32)),
                                        ModelError, "the config implies (32,"),
    "model_fewer_layers_than_weights": Case(model_case(lambda d: edit_json(d / "config.json", num_hidden_layers=2)),
                                            ModelError, "has tensors the config does not use: model.layers.2."),
    "model_broken_tokenizer": Case(model_case(lambda d: (d / "tokenizer.json").write_text('{"version": ')), ModelError,
                                   "tokenizer.json: not valid JSON"),
    "model_tokenizer_missing": Case(lambda tmp, good: [f"model.path={good['ckpt']}", f"model.tokenizer={tmp / 'tok'}"],
                                    ModelError, "model.tokenizer={dir}: no such directory"),
    "model_nan_weights": Case(
        model_case(lambda d: edit_weights(d, lambda s: s["model.layers.2.post_attention_layernorm.weight"].fill_(
            float("nan")))),
        ModelError, "decoder layer 2 (model.layers.2) first produced non-finite values", generate=True),
    "model_inf_lm_head": Case(
        model_case(lambda d: edit_weights(d, lambda s: s["lm_head.weight"][7].fill_(float("inf")))),
        ModelError, "the output head (lm_head) first produced non-finite values", generate=True),
    # EAGLE-3 heads
    "head_missing_dir": Case(head_case(shutil.rmtree), ModelError, "drafter.path={dir}: no such directory"),
    "head_no_weights": Case(head_case(lambda d: (d / "model.safetensors").unlink()), ModelError,
                            "drafter.path={dir}: no weights"),
    "head_config_bad_json": Case(head_case(lambda d: (d / "config.json").write_text("{oops")), ModelError,
                                 "config.json: not valid JSON"),
    "head_config_not_utf8": Case(head_case(lambda d: (d / "config.json").write_bytes(b"\xfe{}")), ModelError,
                                 "config.json: not UTF-8"),
    "head_config_wrong_type": Case(head_case(lambda d: edit_json(d / "config.json", hidden_size="wide")), ModelError,
                                   "config.json: not an EAGLE-3 head config"),
    "head_truncated_safetensors": Case(head_case(lambda d: truncate(d / "model.safetensors", 0.3)), ModelError,
                                       "drafter.path={dir}: model.safetensors is truncated"),
    "head_vocab_mismatch": Case(head_case(other_head(vocab_size=300, draft_vocab_size=300)), ModelError,
                                "drafter.path={dir}: head vocab_size 300 differs from the target's 256"),
    "head_target_hidden_mismatch": Case(head_case(other_head(target_hidden_size=96)), ModelError,
                                        "drafter.path={dir}: head expects target hidden size 96, the target has 64"),
    "head_hidden_without_embedding": Case(head_case(other_head(hidden_size=32, head_dim=8)), ModelError,
                                          "drafter.path={dir}: head has no embed_tokens and its hidden_size 32"),
    "head_aux_layers_out_of_range": Case(
        head_case(lambda d: edit_json(d / "config.json", eagle_aux_hidden_state_layer_ids=[0, 1, 9])), ModelError,
        "drafter.path={dir}: head eagle_aux_hidden_state_layer_ids [0, 1, 9] do not fit the target's 4 layers"),
    "head_d2t_out_of_range": Case(head_case(d2t_beyond_vocab), ModelError,
                                  "drafter.path={dir}: head d2t maps draft tokens outside the target's vocabulary"),
    # workloads
    "workload_not_utf8": workload(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "workload.path={dir} line 2: not UTF-8"),
    "workload_bad_json_line": workload(b'{"prompt": "ok"}\n\n{"prompt": "no end}\n', "workload.path={dir} line 3: not JSON"),
    "workload_no_prompt_field": workload(b'{"text": "hello"}\n',
                                         "workload.path={dir} line 1: needs a 'prompt' or 'prompt_ids' field"),
    "workload_ids_not_ints": workload(b'{"prompt_ids": [1, "two", 3]}\n',
                                      "workload.path={dir} line 1: 'prompt_ids' holds \"two\""),
    "workload_ids_floats": workload(b'{"prompt_ids": [1, 2.5]}\n', "line 1: 'prompt_ids' holds 2.5"),
    "workload_prompt_not_string": workload(b'{"prompt": ["a", "b"]}\n', "line 1: 'prompt' must be a non-empty string"),
    "workload_row_not_object": workload(b'"just a string"\n', "line 1: a JSON str, not an object"),
    "workload_empty_file": workload(b"\n\n", "workload.path={dir}: no prompts in the file"),
    "workload_prompt_and_ids": workload(b'{"prompt": "ok"}\n{"prompt": "hi", "prompt_ids": [1, 2]}\n',
                                        "workload.path={dir} line 2: has both 'prompt' and 'prompt_ids'"),
    # calibration files
    "calibration_bad_json": Case(calibration_case(b'{"constants": {"c0": 1,'), ConfigError,
                                 "cost_model.calibration={dir}: not valid JSON"),
    "calibration_not_utf8": Case(calibration_case(b'{"constants": "\xff"}'), ConfigError,
                                 "cost_model.calibration={dir}: not UTF-8"),
    "calibration_no_constants": Case(calibration_case(b'{"setup": {}}'), ConfigError, 'no "constants" object'),
    "calibration_missing_constant": Case(calibration_case(constants(c_miss=None)), ConfigError,
                                         "constants.c_miss is missing"),
    "calibration_negative_constant": Case(calibration_case(constants(c_tok=-0.5)), ConfigError,
                                          "constants.c_tok=-0.5 must be a finite number >= 0"),
    "calibration_nan_constant": Case(calibration_case(b'{"constants": {"c0": NaN, "c_tok": 0, "c_miss": 0, "c_hit": 0}}'),
                                     ConfigError, "constants.c0=NaN must be a finite number"),
    "calibration_string_constant": Case(calibration_case(constants(c_hit="fast")), ConfigError,
                                        'constants.c_hit="fast" must be a finite number'),
    # results files for `specfit report`
    "results_bad_json_line": Case(results_case(row(), b'{"output_throughput": 3,'), ConfigError,
                                  "{dir}: line 2 is not JSON", command="report", api="report"),
    "results_not_utf8": Case(results_case(row(), b'{"method": "\xff"}'), ConfigError, "{dir}: not UTF-8",
                             command="report", api="report"),
    "results_row_not_object": Case(results_case(row(), b"[1, 2]"), ConfigError, "{dir}: line 2 is not a JSON object",
                                   command="report", api="report"),
    "results_figure_not_number": Case(results_case(row(), row(total_seconds="slow")), ConfigError,
                                      "{dir} line 2: total_seconds=\"slow\" is not a number", command="report",
                                      api="report"),
    "results_no_results_rows": Case(results_case(b'{"a": 1}'), ConfigError, "{dir}: holds no specfit results rows",
                                    command="report", api="report"),
    "results_empty_file": Case(results_case(), ConfigError, "{dir}: holds no specfit results rows (it is empty)",
                               command="report", api="report"),
    "results_only_a_torn_line": Case(torn_results_case(lambda: row()), ConfigError,
                                     "{dir}: holds no specfit results rows (its only line is cut short",
                                     command="report", api="report"),
    "results_bench_summary": Case(results_case(row(outputs_identical=True), row(workload="all")), ConfigError,
                                  "{dir} is a bench summary (each method's means), not its runs",
                                  command="report", api="report"),
    "results_bench_row_without_throughput": Case(results_case(row(), b'{"command": "bench", "method": "ar"}'),
                                                 ConfigError, "{dir} line 2: a bench row without output_throughput",
                                                 command="report", api="report"),
    "results_workload_not_a_name": Case(results_case(row(), row(workload=5)), ConfigError,
                                        "{dir} line 2: workload=5 is not a name", command="report", api="report"),
    "results_run_without_tokens": Case(results_case(row(), b'{"output_throughput": 1.0, "total_seconds": 1}'),
                                       ConfigError, "{dir} line 2: a run row without num_output_tokens",
                                       command="report", api="report"),
}


def bad_path(args: list[str]) -> str:
    """The file or directory a case broke: the value of its last ``key=PATH`` override (or the results file)."""
    last = args[-1]
    return last.split("=", 1)[1] if "=" in last else last


def expected(case: Case, args: list[str]) -> str:
    return case.message.replace("{dir}", bad_path(args))


# ----------------------------------------------------------------------------- API


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_through_the_api(name, good, tmp_path):
    case = CASES[name]
    args = case.make(tmp_path, good)
    start = time.monotonic()
    with pytest.raises(case.error) as info:
        if case.api == "report":
            from specfit.commands.report import read_rows

            read_rows(args)
        elif case.api == "workload":
            from specfit.workloads import load_workload

            load_workload(specfit.compose(args).workload)
        else:
            engine = specfit.build(specfit.compose([*args, *case.extra, "max_new_tokens=2"]))
            if case.generate:
                engine.generate([5, 17, 99])
    message = str(info.value)
    assert expected(case, args) in message
    assert "\n" not in message
    assert bad_path(args) in message  # the file (or directory) it concerns, whatever else it says
    assert time.monotonic() - start < SECONDS


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_file_through_the_cli(name, good, tmp_path, capsys):
    case = CASES[name]
    args = case.make(tmp_path, good)
    if case.command == "report":
        argv = ["report", *args, "--out", str(tmp_path / "report")]
    else:
        argv = [case.command, *args, *case.extra, *([] if case.api == "workload" else [PROMPT]),
                "max_new_tokens=2", f"hydra.run.dir={tmp_path / 'run'}"]
    capsys.readouterr()  # what building the bad file printed (progress bars) is not the command's output
    start = time.monotonic()
    with pytest.raises(SystemExit) as info:
        main(argv)
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert info.value.code == 2, err
    assert err.startswith("specfit: error:") and "\n" not in err, err
    assert "Traceback" not in captured.err + captured.out
    assert expected(case, args) in err
    assert elapsed < SECONDS


def test_a_results_file_that_holds_a_workload_is_refused(tmp_path, capsys):
    """results_file= naming a JSON-lines workload: appending result rows would corrupt it."""
    workload = tmp_path / "prompts.jsonl"
    workload.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    before = workload.read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["generate", "model=tiny", PROMPT, "max_new_tokens=2", f"results_file={workload}",
              f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "\n" not in err, err
    assert f"results_file={workload}: row 1 is not a specfit results row" in err
    assert workload.read_bytes() == before
