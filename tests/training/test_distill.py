"""``specfit distill-data``: the target's own greedy continuations, as rows train-drafter reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specfit.errors import ConfigError
from specfit.training.distill import LENGTH_STEP, DistillDataConfig, distill_data, greedy_rows, training_prompts
from specfit.training.target import greedy_generate

DEMO_TARGET = Path(__file__).resolve().parents[2] / "specfit" / "assets" / "demo" / "target"


@pytest.fixture(scope="module")
def demo_target():
    from specfit.training.drafter import load_frozen_target

    return load_frozen_target(str(DEMO_TARGET))


def test_rows_are_the_targets_greedy_continuations(demo_target):
    """Batched by length, each row equals the prompt followed by plain greedy decoding of it."""
    prompts = [[5, 9, 200, 31], [7, 7, 1000, 42], [300, 12, 8, 99, 4, 17]]
    rows = greedy_rows(demo_target, prompts, seq_len=20, batch_size=2)
    assert rows.shape == (3, 20)
    for prompt, row in zip(prompts, rows):
        assert row[: len(prompt)].tolist() == prompt
        assert row[len(prompt):].tolist() == greedy_generate(demo_target, prompt, 20 - len(prompt))


def test_a_prompt_as_long_as_the_row_is_refused(demo_target):
    with pytest.raises(ValueError, match="prompt 0 has 8 tokens"):
        greedy_rows(demo_target, [[1] * 8], seq_len=8, batch_size=1)


def test_prompts_come_from_the_split_asked_for():
    """Training data never holds the benchmarks' held-out documents or templates."""
    train = training_prompts(DistillDataConfig(num_prompts=8, gsm_share=0.5, split="train"))
    heldout = training_prompts(DistillDataConfig(num_prompts=8, gsm_share=0.5, split="heldout"))
    assert [k for k, _ in train] == ["prose"] * 4 + ["gsm"] * 4
    assert not {t for _, t in train} & {t for _, t in heldout}
    assert all(t.rstrip().endswith("Answer:") for k, t in train if k == "gsm")
    from specfit.data.corpus import load_corpus

    corpus = load_corpus()  # each prose prompt lies in a document of its own split, and of no other
    for split, prompts in (("train", train), ("heldout", heldout)):
        own = corpus.train if split == "train" else corpus.heldout
        other = corpus.heldout if split == "train" else corpus.train
        for kind, text in prompts:
            if kind == "prose":
                assert any(text in doc for _, doc in own) and not any(text in doc for _, doc in other)


def test_distill_data_writes_rows_and_a_summary(tmp_path, monkeypatch, capsys):
    from specfit.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "d" / "rows.npy"
    main(["distill-data", f"target_dir={DEMO_TARGET}", f"out={out}", "num_prompts=3", "seq_len=96",
          "min_new_tokens=16", "threads=1", f"hydra.run.dir={tmp_path / 'run'}"])
    rows = np.load(out)
    assert rows.shape == (3, 96) and rows.dtype == np.int32
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["rows"] == 3 and summary["prose_rows"] + summary["gsm_rows"] == 3
    assert summary["generated_tokens"] >= 3 * 16
    assert summary["generated_tokens"] == 3 * 96 - round(summary["prompt_tokens_mean"] * 3)
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    ({"split": "test"}, "split='test' is not one of heldout, train"),
    ({"out": "rows.txt"}, "out=rows.txt: must name a .npy file"),
    ({"seq_len": 32, "min_new_tokens": 32}, "seq_len=32 must exceed min_new_tokens=32"),
    ({"num_prompts": 0}, "num_prompts=0 must be positive"),
    ({"gsm_share": -0.1}, "gsm_share=-0.1 must be >= 0"),
    ({"gsm_share": 1.5}, "gsm_share=1.5 must be in"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DistillDataConfig(**overrides)


def test_a_row_past_the_targets_context_is_named(tmp_path):
    with pytest.raises(ConfigError, match="seq_len=4096 exceeds the model's context: max_position_embeddings=2048"):
        distill_data(DistillDataConfig(target_dir=str(DEMO_TARGET), out=str(tmp_path / "r.npy"), seq_len=4096))


def test_length_step_keeps_batches_large():
    from specfit.training.distill import _cut

    assert _cut(list(range(21)), keep=100) == list(range(5, 21))  # 16 tokens: a multiple of LENGTH_STEP
    assert len(_cut(list(range(300)), keep=200)) == 200 - 200 % LENGTH_STEP
    assert _cut([1, 2, 3], keep=100) == [1, 2, 3]  # shorter than one step: kept whole
