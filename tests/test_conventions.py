"""Conventions users bring from other tools: vLLM's and SGLang's drafter keys, Spec-Bench's answer
files, a bench that builds only what each method uses, progress a log can read."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

import specfit
from specfit.errors import ConfigError

EAGLE = ["model=tiny", "drafter=eagle3"]


def drafter(*overrides: str):
    return OmegaConf.to_object(specfit.compose([*EAGLE, *overrides]).drafter)


@pytest.mark.parametrize("overrides", [
    ["drafter.num_speculative_tokens=5"],
    ["drafter.speculative_config='{\"method\": \"eagle3\", \"num_speculative_tokens\": 5}'"],  # JSON, as vLLM takes it
    ["drafter.speculative_config={num_speculative_tokens: 5}"],  # Hydra's mapping syntax
    ["drafter.num_steps=5", "drafter.num_speculative_tokens=5"],  # agreeing aliases
])
def test_vllm_aliases_set_the_depth(overrides):
    d = drafter(*overrides)
    assert (d.top_k, d.depth, d.total_tokens) == (10, 5, 60)


def test_speculative_config_model_is_the_head_path():
    assert drafter("drafter.speculative_config={model: random}").path == "random"
    with pytest.raises(ConfigError, match="drafter.path=a and its alias drafter.speculative_config.model=b disagree"):
        drafter("drafter.path=a", "drafter.speculative_config={model: b}")


def test_a_head_given_by_speculative_config_is_not_replaced_by_the_models_own():
    """model=demo has its own head (model.draft_head), used only where no head is named."""
    def built(*overrides: str):
        return specfit.build(specfit.compose(["model=demo", "drafter=eagle3", *overrides]), calibrate_now=False)

    assert built("drafter.speculative_config={model: random}").drafter.path == "random"
    assert built().drafter.path.endswith("eagle3")  # the demo's own head


@pytest.mark.parametrize(("overrides", "message"), [
    (["drafter.depth=3", "drafter.num_speculative_tokens=5"],
     "drafter.depth=3 and its alias drafter.num_speculative_tokens=5 disagree"),
    (["drafter.num_steps=4", "drafter.speculative_config={num_speculative_tokens: 5}"],
     "drafter.num_steps=4 and drafter.speculative_config.num_speculative_tokens=5 disagree (both set drafter.depth)"),
    (["drafter.total_tokens=10", "drafter.num_draft_tokens=5"],
     "drafter.total_tokens=10 and its alias drafter.num_draft_tokens=5 disagree"),
    (["drafter.speculative_config={draft_tensor_parallel_size: 2}"], "key 'draft_tensor_parallel_size' has no specfit"),
    (["drafter.speculative_config={method: ngram}"], "method 'ngram' is not an EAGLE method"),
    (["drafter.speculative_config='{\"num_speculative_tokens\": 5'"], "drafter.speculative_config: not JSON"),
    (["drafter.num_speculative_tokens=0"], "drafter.num_speculative_tokens"),
    (["drafter.num_speculative_tokens=100"], "drafter.depth=100 exceeds 64"),
])
def test_alias_mistakes_are_one_line_errors_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as info:
        specfit.compose([*EAGLE, *overrides])  # before any model is built
    assert message in str(info.value)


def test_results_record_the_alias_and_the_value_it_set():
    from specfit.results import run_config

    config = run_config(specfit.compose([*EAGLE, "drafter.num_speculative_tokens=3", "drafter.eagle_topk=4"]))
    d = config["drafter"]
    assert (d["depth"], d["num_speculative_tokens"], d["top_k"], d["eagle_topk"]) == (3, 3, 4, 4)
    json.dumps(config)  # a results row


def test_bench_builds_a_cost_model_only_for_selectors_that_use_one():
    from specfit.commands.bench import method_config, without_unused_cost_model

    cfg = specfit.compose(["model=tiny"], config_name="bench")
    kept = {}
    for method in cfg.method_presets:
        c = method_config(cfg, method, None, [])
        assert c.cost_model is not None  # what replay gets: it charges every method's time with it
        c = without_unused_cost_model(c)
        selector = specfit.registry.get_plugins()["selector"].get(c.selector.name).cls
        assert (c.cost_model is not None) == ("cost_model" in getattr(selector, "requires", ())), method
        kept[method] = c.cost_model is not None
    assert not kept["ar"] and not kept["eagle3"] and kept["specfit"] and kept["prefix"]


def test_spec_bench_answers_one_line_per_prompt_one_choice_per_repeat():
    from specfit.results import spec_bench_answers

    rows = [{"method": m, "workload": "gsm", "prompt_index": i, "repeat": r, "cycles": 3, "num_output_tokens": 4,
             "total_seconds": 0.5, "output_ids": [7, 8, 9, 10], "accept_lengths": [1, 2, 1]}
            for r in (0, 1) for i in (0, 1) for m in ("ar", "specfit")]

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return "-".join(map(str, ids))

    answers = spec_bench_answers(rows, {"ar": Tokenizer()})
    assert sorted(answers) == ["ar", "specfit"] and len(answers["ar"]) == 2
    line = answers["ar"][1]
    assert (line["question_id"], line["category"], line["model_id"]) == ("gsm-1", "gsm", "ar")
    assert [c["index"] for c in line["choices"]] == [0, 1]
    choice = line["choices"][0]
    assert choice["turns"] == ["7-8-9-10"] and choice["new_tokens"] == [4] and choice["wall_time"] == [0.5]
    assert choice["decoding_steps"] == [3] and choice["accept_lengths"] == [1, 2, 1]
    assert answers["specfit"][0]["choices"][0]["turns"] == ["7 8 9 10"]  # no tokenizer: the token ids


def test_progress_off_a_terminal_is_one_line_per_step(capsys):
    from specfit.progress import LineProgress, progress

    bar = progress(4, "bench", unit="run")  # stderr is captured: not a terminal
    assert isinstance(bar, LineProgress)
    with bar:
        for _ in range(4):
            bar.update()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [f"bench: {n}/4 runs" for n in (1, 2, 3, 4)]
    bar = progress(100, "train", every=10)
    bar.set_postfix(loss="1.5")
    for _ in range(25):
        bar.update()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("train: 20/100 steps") and lines[1].endswith("loss=1.5")
    bar = progress(100, "distill", unit="prompt", every=20)
    for _ in range(4):
        bar.update(32)  # batches: a line when a multiple of 20 is passed, and at the end
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [f"distill: {n}/100 prompts" for n in (32, 64, 96, 128)]
    assert progress(4, "quiet", disable=True).disable  # progress=false: a disabled tqdm, nothing printed
