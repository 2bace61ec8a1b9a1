"""Target trainer: a tiny run lowers the loss, resume reproduces the uninterrupted run, and the
saved model and tokenizer load with the Auto classes. Needs no shared data (tiny synthetic text)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specfit.training.target import (  # noqa: E402
    TrainTargetConfig, TokenData, WindowSampler, eval_windows, load_tokenizer,
    repeated_ngram_fraction, train_target,
)
from specfit.training.tokenizer import build_tokenizer_object, wrap_tokenizer  # noqa: E402


def _synthetic_text(n_docs: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "king", "said", "unto", "him", "and", "lord", "of", "hosts", "go", "forth",
             "thou", "art", "my", "son", "apples", "cost", "dollars", "each"]
    docs = []
    for _ in range(n_docs):
        a, b = rng.randrange(2, 20), rng.randrange(2, 20)
        prose = " ".join(rng.choice(words) for _ in range(rng.randrange(20, 60)))
        docs.append(f"{prose}.\nQuestion: {a} apples cost {b} dollars each. Total?\n"
                    f"Answer: {a} * {b} = <<{a}*{b}={a * b}>>{a * b}\n#### {a * b}\n")
    return docs


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    docs = _synthetic_text()
    tok = wrap_tokenizer(build_tokenizer_object(docs, vocab_size=300, min_frequency=1))
    tok_dir = root / "tok"
    tok.save_pretrained(str(tok_dir))
    jsonl = root / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"root": root, "tok": tok_dir, "data": jsonl}


def _cfg(setup: dict[str, Path], out: Path, **kw) -> TrainTargetConfig:
    base = dict(
        out_dir=str(out), tokenizer_dir=str(setup["tok"]), include_builtin_data=False,
        train_files=[str(setup["data"])], hidden_size=32, num_layers=2, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, seq_len=32,
        batch_size=4, max_steps=30, lr=5e-3, warmup_steps=3, threads=1, log_every=1,
        eval_every=1000, eval_windows=0, checkpoint_every=10, progress=False,
    )
    base.update(kw)
    return TrainTargetConfig(**base)


def _train_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in rows if "lm_loss" in r]


def test_tiny_run_lowers_loss_and_saves_loadable_model(tiny_setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tiny_setup["root"] / "run"
    train_target(_cfg(tiny_setup, out))
    losses = _train_losses(out)
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 1.0

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.norm_topk_prob is True
    assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    assert model.config.tie_word_embeddings
    ids = tok("Question: 3 apples", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert (out / "data" / "train_tokens.npy").exists()
    assert (out / "checkpoint" / "state.pt").exists()
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 30


def test_resume_matches_uninterrupted_run(tiny_setup):
    full = tiny_setup["root"] / "full"
    part = tiny_setup["root"] / "part"
    train_target(_cfg(tiny_setup, full, max_steps=20, checkpoint_every=5))
    # same schedule (max_steps=20), interrupted after 10 steps: simulate by a run that is
    # stopped at a checkpoint, then resumed
    cfg = _cfg(tiny_setup, part, max_steps=20, checkpoint_every=5)
    _train_until(cfg, stop_after=10)
    train_target(_cfg(tiny_setup, part, max_steps=20, checkpoint_every=5, resume=True))
    a, b = _train_losses(full), _train_losses(part)
    assert len(a) == 20 and len(b) == 20
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    sa = torch.load(full / "checkpoint" / "state.pt", weights_only=True)
    sb = torch.load(part / "checkpoint" / "state.pt", weights_only=True)
    assert sa["step"] == sb["step"] == 20
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=1e-5, atol=1e-6)


def _train_until(cfg: TrainTargetConfig, stop_after: int) -> None:
    """Run train_target but kill it right after the checkpoint of step ``stop_after``, then
    leave a log row beyond the checkpoint (as a kill between checkpoints would)."""
    import specfit.training.target as target

    class Stop(Exception):
        pass

    original = target.save_checkpoint

    def save(path, **kw):
        original(path, **kw)
        if kw["step"] == stop_after:
            raise Stop

    target.save_checkpoint = save
    try:
        with pytest.raises(Stop):
            train_target(cfg)
    finally:
        target.save_checkpoint = original
    state = torch.load(Path(cfg.out_dir) / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == stop_after
    with (Path(cfg.out_dir) / "train_log.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": stop_after + 1, "lm_loss": 123.0}) + "\n")


def test_resume_refuses_changed_model_shape(tiny_setup):
    out = tiny_setup["root"] / "shape"
    train_target(_cfg(tiny_setup, out, max_steps=5, checkpoint_every=5))
    with pytest.raises(ValueError, match="hidden_size"):
        train_target(_cfg(tiny_setup, out, max_steps=5, hidden_size=48, resume=True))


def test_window_sampler_is_deterministic_and_covers_epoch():
    tokens = np.arange(1000, dtype=np.uint16) % 97
    data = TokenData(tokens, np.array([0, 300, 700, 1000]), ["a", "b", "c"])
    s1, s2 = WindowSampler(data, 10, 4, seed=3), WindowSampler(data, 10, 4, seed=3)
    for step in (0, 7, 30, 24):
        np.testing.assert_array_equal(s1.batch(step), s2.batch(step))
    epoch = np.concatenate([s1.batch(i) for i in range(25)])  # 100 windows = one epoch
    assert sorted(epoch.reshape(-1).tolist()) == sorted(tokens.tolist())


def test_token_rows_of_whole_windows_are_never_split():
    """Rows of ``seq_len`` tokens (distill-data's prompt + continuation) are windows of their own;
    text documents around them are packed as before, and an epoch still covers every token once."""
    text = (np.arange(233, dtype=np.int32) % 50) + 1000  # ids 1000-1049: never inside a row
    rows = np.arange(60, dtype=np.int32).reshape(6, 10)  # six rows, ids 0-59: each its own window
    tokens = np.concatenate([text[:117], rows.ravel(), text[117:]])
    offsets = np.array([0, 117, *range(127, 178, 10), 293])
    data = TokenData(tokens, offsets, ["prose", *["tokens"] * 6, "gsm"])
    sampler = WindowSampler(data, 10, 4, seed=1)
    assert sampler.windows_per_epoch == 6 + 23
    windows = {tuple(w) for step in range(7) for w in sampler.batch(step)}  # 28 of the 29 windows
    row_windows = [w for w in windows if min(w) < 1000]
    assert all(w in {tuple(r) for r in rows} for w in row_windows) and len(row_windows) >= 5


def test_eval_windows_and_repeat_metric(tiny_setup):
    tok = load_tokenizer(tiny_setup["tok"])
    w = eval_windows(tok, [("a", "the king said unto him " * 20)], seq_len=16)
    assert w.shape[1] == 17 and w[0, 0] == tok.eos_token_id
    np.testing.assert_array_equal(w[0, -1], w[1, 0])  # consecutive windows overlap by one token
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_fraction([7] * 10) == pytest.approx(1 - 1 / 7)


def test_init_from_continues_a_saved_target(tiny_setup):
    """``init_from`` starts from a saved target: its first loss is the trained model's (far below a
    fresh model's), and a directory without a model or of another shape is a clear error."""
    from specfit.errors import ConfigError

    first = tiny_setup["root"] / "first"
    train_target(_cfg(tiny_setup, first))
    cont = tiny_setup["root"] / "cont"
    train_target(_cfg(tiny_setup, cont, init_from=str(first), max_steps=3, lr=1e-4, warmup_steps=1, seed=1))
    fresh = tiny_setup["root"] / "fresh"
    train_target(_cfg(tiny_setup, fresh, max_steps=3, lr=1e-4, warmup_steps=1, seed=1))
    assert _train_losses(cont)[0] < _train_losses(fresh)[0] - 1.0
    assert _train_losses(cont)[0] < _train_losses(first)[-5] + 0.5  # where the first run ended
    start = [json.loads(line) for line in (cont / "train_log.jsonl").read_text().splitlines()][0]
    assert start["event"] == "start" and start["init_from"] == str(first)
    with pytest.raises(ConfigError, match="init_from=.*no config.json"):
        train_target(_cfg(tiny_setup, tiny_setup["root"] / "bad", init_from=str(tiny_setup["root"]), max_steps=1))
    with pytest.raises(ConfigError, match="init_from=.*does not match"):
        train_target(_cfg(tiny_setup, tiny_setup["root"] / "bad2", init_from=str(first), max_steps=1, hidden_size=64))


def test_init_from_refuses_a_deeper_saved_target(tmp_path):
    """A saved target with more layers than the run is not silently cut to the run's layers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from specfit.errors import ConfigError
    from specfit.training.target import init_from_saved

    def model(layers: int):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64, tie_word_embeddings=True))

    model(3).save_pretrained(str(tmp_path / "deep"))
    same = model(3)
    init_from_saved(same, str(tmp_path / "deep"))  # the same shape loads
    with pytest.raises(ConfigError, match="init_from=.*does not match.*extra: \\['model.layers.2"):
        init_from_saved(model(2), str(tmp_path / "deep"))


def test_eval_target_writes_into_the_run_directory_by_default(tmp_path, monkeypatch, capsys):
    """Never into model_dir: for the shipped demo model that is the installed package's assets."""
    import specfit.training.target as target
    from specfit.cli import main

    model_dir = Path(target.__file__).resolve().parents[1] / "assets" / "demo" / "target"
    before = sorted(p.name for p in model_dir.iterdir())
    figures = {f"{k}_ppl": 2.0 for k in ("prose", "gsm", "unigram_prose", "unigram_gsm", "heldout", "unigram")}
    monkeypatch.setattr(target, "evaluate_target", lambda *a, **k: {
        **figures, "ppl_ratio": 1.0, "repeat4_mean": 0.0, "repeat4_max": 0.0, "samples": [], "meets_bar": False})
    main(["eval-target", f"model_dir={model_dir}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert f"wrote {tmp_path / 'run' / 'evaluation.json'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "evaluation.json").read_text())["ppl_ratio"] == 1.0
    assert sorted(p.name for p in model_dir.iterdir()) == before
