"""The EAGLE-3 head trainer: draft vocabulary, the training-time-test unroll against the drafter,
loss, resume, the public layout, and acceptance against a random head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from safetensors.torch import load_file

from specfit import Engine
from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, load_head, random_head
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
from specfit.plugins.drafters.eagle3.drafter import default_feature_layers
from specfit.plugins.drafters.eagle3.head import KVBuffer
from specfit.data.paths import default_data_dir
from specfit.training.draft_vocab import build_draft_vocab, token_counts
from specfit.training.drafter import (
    TrainDrafterConfig, acceptance_length, target_batch, train_drafter, ttt_unroll,
)

VOCAB = 256


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _cycle(seed: int) -> np.ndarray:
    """A permutation of the vocabulary that is one cycle (no fixed points: no token repeats itself)."""
    order = np.random.default_rng(seed).permutation(VOCAB)
    nxt = np.empty(VOCAB, dtype=np.int64)
    nxt[order] = np.roll(order, -1)
    return nxt


def _chains(nxt: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` rows following ``nxt`` from random starts: a corpus with learnable structure."""
    rng = np.random.default_rng(seed)
    rows = np.empty((n, length), dtype=np.int64)
    rows[:, 0] = rng.integers(0, VOCAB, n)
    for j in range(1, length):
        rows[:, j] = nxt[rows[:, j - 1]]
    return rows


@pytest.fixture(scope="module")
def patterned(tmp_path_factory):
    """A tiny Qwen3-MoE target trained briefly to follow a fixed token cycle, and a corpus of it."""
    root = tmp_path_factory.mktemp("patterned")
    nxt = _cycle(0)
    torch.manual_seed(0)
    model = tiny_model("tiny-qwen3-moe")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):
        x = torch.from_numpy(_chains(nxt, 16, 33, seed=100 + step))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(root / "target")
    np.save(root / "train.npy", _chains(nxt, 200, 64, seed=1))
    return {"root": root, "target": root / "target", "train": root / "train.npy", "next": nxt}


def _config(p: dict, out: Path, **kw) -> TrainDrafterConfig:
    args = dict(target_dir=str(p["target"]), out_dir=str(out), include_builtin_data=False,
                train_files=[str(p["train"])], seq_len=32, batch_size=8, max_steps=50, lr=1e-2,
                warmup_steps=5, log_every=10, eval_windows=0, checkpoint_every=25, progress=False)
    return TrainDrafterConfig(**{**args, **kw})


@pytest.fixture(scope="module")
def trained_head(patterned):
    out = patterned["root"] / "head"
    train_drafter(_config(patterned, out, eval_files=[str(patterned["train"])], eval_windows=8, eval_every=50))
    return out


# ------------------------------------------------------------------------------ draft vocabulary


def test_draft_vocab_keeps_the_most_frequent_tokens_and_the_special_ones():
    counts = np.array([0, 5, 9, 1, 9, 0, 7, 2])
    vocab = build_draft_vocab(counts, 4, always_include=[5])
    # 5 is forced in; then by frequency 2, 4 (tie broken to the lower id), 6
    assert vocab.draft_ids.tolist() == [2, 4, 5, 6]
    assert (np.arange(4) + vocab.d2t).tolist() == vocab.draft_ids.tolist()  # target = draft + d2t[draft]
    assert vocab.d2t.tolist() == [2, 3, 3, 3]
    assert vocab.t2d.tolist() == [False, False, True, False, True, True, True, False]
    assert vocab.coverage(counts) == pytest.approx(25 / 33)
    full = build_draft_vocab(counts, 8)
    assert full.full and not full.d2t.any() and full.t2d.all()
    assert build_draft_vocab(counts, 100).size == 8  # larger than the target vocabulary: all of it
    unseen = build_draft_vocab(np.array([0, 0, 3, 0]), 3)
    assert unseen.draft_ids.tolist() == [0, 1, 2]  # places left over go to the lowest unseen ids
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        token_counts(np.array([1, 9]), 8)


# ------------------------------------------------------------------------------ the TTT unroll


@pytest.mark.parametrize("arch,flag", [(arch, None) for arch in ARCHITECTURES]
                         + [(ARCHITECTURES[0], flag) for flag in ("qk_norm", "norm_before_residual", "feed_normed")])
def test_ttt_unroll_equals_what_the_drafter_computes_along_a_chain(arch, flag):
    """Step i at position t == the drafter's depth-(i+1) pair after committing x[0..t]:
    KV cache of the committed pairs, position committed-1+i, mask = committed + ancestors + self.
    Also for the layouts of other trainers' heads (speculators': feed_normed, norm_before_residual;
    Qwen3-style qk_norm), whose states fit-probe learns from."""
    model = tiny_model(arch)
    cfg = head_config_for(model)
    if flag is not None:
        setattr(cfg, flag, True)
    head = random_head(cfg, seed=1, std=0.1)
    head.set_target_embedding(model.get_input_embeddings())
    length, steps = 14, 4
    x = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))
    tb = target_batch(model, x, default_feature_layers(model.config.num_hidden_layers), None)
    outs = ttt_unroll(head, tb.features, x, steps)
    assert [o.shape[1] for o in outs] == [length - 1 - i for i in range(steps)]
    worst = 0.0
    with torch.no_grad():
        for b in range(2):
            for t in range(0, length - steps, 3):
                kv = KVBuffer(cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
                prev = head(head.project(tb.features[b, : t + 1]), x[b, 1 : t + 2], torch.arange(t + 1), kv)[-1]
                committed, ancestors = kv.length, []
                worst = max(worst, float((prev - outs[0][b, t]).abs().max()))
                for i in range(1, steps):
                    mask = torch.zeros(1, kv.length + 1, dtype=torch.bool)
                    mask[0, :committed] = True
                    mask[0, ancestors] = True
                    mask[0, -1] = True
                    ancestors.append(kv.length)
                    prev = head(prev[None], x[b, t + 1 + i][None], torch.tensor([committed - 1 + i]), kv, mask)[0]
                    worst = max(worst, float((prev - outs[i][b, t]).abs().max()))
    assert worst < 1e-4


# ------------------------------------------------------------------------------ training


def test_training_lowers_the_loss_and_raises_accuracy(trained_head):
    log = _log(trained_head)
    steps = [r for r in log if "loss" in r]
    assert len(steps) == 5 and len(steps[0]["acc"]) == 7 and len(steps[0]["step_loss"]) == 7
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]
    assert steps[-1]["acc"][0] > steps[0]["acc"][0] + 0.3
    evals = [r for r in log if "eval_loss" in r]
    assert evals and len(evals[-1]["eval_acc"]) == 7
    done = log[-1]
    assert done["event"] == "done" and done["tokens"] == 50 * 8 * 32


def test_saved_head_is_in_the_public_layout_and_drives_the_drafter_losslessly(patterned, trained_head):
    config = json.loads((trained_head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VOCAB
    layers = default_feature_layers(4)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in layers]
    state = load_file(str(trained_head / "model.safetensors"))
    assert "embed_tokens.weight" not in state and not state["d2t"].any() and state["t2d"].all()
    head = load_head(trained_head)
    assert head.cfg.aux_layer_ids == [i - 1 for i in layers]
    # trained on windows of seq_len tokens: drafting attends within them (drafter.attention_window)
    assert config["attention_window"] == head.cfg.attention_window == _config(patterned, trained_head).seq_len

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(patterned["target"])).eval()
    prompt = _chains(patterned["next"], 1, 10, seed=7)[0].tolist()
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0]
    drafter = Eagle3Drafter(path=str(trained_head), top_k=4, depth=5, total_tokens=12)
    out = Engine(target, drafter=drafter, device="cpu").generate(prompt, max_new_tokens=24)
    assert out.token_ids == ref[len(prompt):].tolist()
    assert out.stats["spec_decode_acceptance_length"] > 1.5  # drafts were accepted, not just verified


def test_trained_head_beats_a_random_head(patterned, trained_head):
    prompts = [row.tolist() for row in _chains(patterned["next"], 3, 10, seed=11)]
    kw = dict(max_new_tokens=24, top_k=4, depth=5, total_tokens=16)
    trained = acceptance_length(patterned["target"], trained_head, prompts, **kw)
    random = acceptance_length(patterned["target"], None, prompts, **kw)
    assert trained["prompts"] == 3 and len(trained["per_prompt"]) == 3
    assert trained["spec_decode_acceptance_length"] > random["spec_decode_acceptance_length"] + 1.0


def test_resume_continues_exactly_with_a_reduced_draft_vocabulary(patterned, tmp_path):
    kw = dict(max_steps=6, warmup_steps=2, log_every=1, checkpoint_every=3, draft_vocab_size=48,
              train_files=[str(patterned["train"])])
    straight = train_drafter(_config(patterned, tmp_path / "a", **kw))
    part = train_drafter(_config(patterned, tmp_path / "b", stop_after_steps=3, **kw))
    assert not (part / "model.safetensors").exists() and (part / "checkpoint" / "state.pt").exists()
    with (part / "train_log.jsonl").open("a") as fh:  # a step logged after the checkpoint, then lost
        fh.write(json.dumps({"step": 5, "loss": 99.0}) + "\n")
    resumed = train_drafter(_config(patterned, tmp_path / "b", resume=True, **kw))
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda out: {r["step"]: r["loss"] for r in _log(out) if "loss" in r}  # noqa: E731
    assert losses(resumed) == losses(straight)
    assert any(r.get("event") == "resume" and r["step"] == 3 for r in _log(resumed))
    # the draft vocabulary: the 48 most frequent training tokens, in the public d2t / t2d layout
    expected = build_draft_vocab(token_counts(np.load(patterned["train"]).ravel(), VOCAB), 48)
    assert a["d2t"].tolist() == expected.d2t.tolist() and a["t2d"].tolist() == expected.t2d.tolist()
    assert load_head(straight).cfg.draft_vocab_size == 48
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train_drafter(_config(patterned, tmp_path / "b", resume=True, **{**kw, "draft_vocab_size": 64}))


def test_init_from_starts_at_the_saved_head_and_continues_training(patterned, trained_head, tmp_path):
    """``init_from`` continues a shipped head: step 0 is the saved head (same held-out loss), then it trains."""
    evaluated = dict(eval_files=[str(patterned["train"])], eval_windows=8, eval_every=1, lr=1e-3)
    zero = train_drafter(_config(patterned, tmp_path / "zero", init_from=str(trained_head), max_steps=1,
                                 lr=1e-12, warmup_steps=1, **{k: v for k, v in evaluated.items() if k != "lr"}))
    saved, started = load_head(trained_head).state_dict(), load_head(zero).state_dict()
    assert all(torch.allclose(saved[k].float(), started[k].float(), atol=1e-6) for k in saved)
    fresh = train_drafter(_config(patterned, tmp_path / "fresh", max_steps=2, warmup_steps=1, **evaluated))
    cont = train_drafter(_config(patterned, tmp_path / "cont", init_from=str(trained_head), max_steps=2,
                                 warmup_steps=1, **evaluated))
    loss = lambda out: json.loads((out / "training_summary.json").read_text())["eval_loss"]  # noqa: E731
    assert loss(cont) < loss(fresh)  # it starts from the trained head, not from a random one
    # it was trained on the saved head's windows too: the longer of the two (32 against 16), and a saved
    # head that does not say (another trainer's) leaves the window unknown
    shorter = train_drafter(_config(patterned, tmp_path / "shorter", init_from=str(trained_head), max_steps=1,
                                    warmup_steps=1, seq_len=16))
    assert load_head(shorter).cfg.attention_window == load_head(trained_head).cfg.attention_window == 32
    unsaid = tmp_path / "unsaid"
    shutil.copytree(trained_head, unsaid)
    config = json.loads((unsaid / "config.json").read_text())
    (unsaid / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "attention_window"}))
    again = train_drafter(_config(patterned, tmp_path / "again", init_from=str(unsaid), max_steps=1, warmup_steps=1))
    assert load_head(again).cfg.attention_window is None
    assert any(r.get("event") == "start" and r["init_from"] == str(trained_head) for r in _log(cont))
    with pytest.raises(ValueError, match="init_from"):
        train_drafter(_config(patterned, tmp_path / "bad", init_from=str(trained_head), max_steps=1,
                              draft_vocab_size=48))
    # other target layers give fc the same shape: named, not continued on the wrong features
    fused = list(load_head(trained_head).cfg.aux_layer_ids or [])
    other = [1, 1, 1] if [i + 1 for i in fused] != [1, 1, 1] else [2, 2, 2]
    with pytest.raises(ValueError, match=r"init_from=.*hidden_states.*set aux_layers="):
        train_drafter(_config(patterned, tmp_path / "layers", init_from=str(trained_head), max_steps=1,
                              aux_layers=other))


def test_token_budget_and_text_files_with_the_target_tokenizer(tmp_path):
    """Text data goes through the target's tokenizer; ``max_tokens`` sets the step count."""
    from specfit.training.tokenizer import build_tokenizer_object, wrap_tokenizer

    text = "".join(f"Question: what is {a} plus {a + 1}? Answer: {2 * a + 1}\n" for a in range(40))
    tok = wrap_tokenizer(build_tokenizer_object([text], vocab_size=300, min_frequency=1))
    model = tiny_model("tiny-olmoe", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "train.txt").write_text(text * 3)
    cfg = TrainDrafterConfig(target_dir=str(tmp_path / "target"), out_dir=str(tmp_path / "head"),
                             include_builtin_data=False, train_files=[str(tmp_path / "train.txt")],
                             eval_files=[str(tmp_path / "train.txt")], eval_windows=2, eval_every=100,
                             seq_len=16, batch_size=4, max_tokens=200, ttt_steps=3, warmup_steps=1,
                             draft_vocab_size=64, progress=False)
    out = train_drafter(cfg)
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["eval_acc"]) == 3  # ceil(200 / (4 * 16))
    head = load_head(out)
    eos = tok.eos_token_id
    assert head.t2d[eos] and eos in (torch.arange(64) + head.d2t).tolist()  # EOS is always draftable


@pytest.mark.slow
@pytest.mark.skipif(not (default_data_dir() / "corpus").is_dir(), reason="needs ../shared/data")
def test_builtin_corpus_and_heldout_eval(tmp_path):  # pragma: no cover - data-dependent
    """The summary's acceptance length is measured on held-out prompts: after 40 steps on the built-in
    corpus the head commits about 2.4 tokens per cycle on them (the random target's continuations
    repeat), where a random head of the same shape commits 1.0."""
    from specfit.training.target import heldout_prompts
    from specfit.training.tokenizer import build_tokenizer_object, wrap_tokenizer

    tok = wrap_tokenizer(build_tokenizer_object(["the cat sat on the mat. And the LORD said 12 + 3 = 15\n"],
                                                vocab_size=300, min_frequency=1))
    model = tiny_model("tiny-qwen3-moe", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    cfg = TrainDrafterConfig(target_dir=str(tmp_path / "target"), out_dir=str(tmp_path / "head"),
                             gsm_per_template=2, seq_len=32, batch_size=4, max_steps=40, ttt_steps=2,
                             eval_windows=4, eval_prompts=4, eval_max_new_tokens=32, progress=False)
    out = train_drafter(cfg)
    summary = json.loads((out / "training_summary.json").read_text())
    assert len(summary["eval_acc"]) == 2
    prompts = [text for _, text in heldout_prompts(cfg.data_dir, n_prose=2, n_gsm=2)]  # the trainer's eval prompts
    random = acceptance_length(tmp_path / "target", None, prompts, 32)["spec_decode_acceptance_length"]
    assert summary["acceptance_length"] > random + 0.7, (summary["acceptance_length"], random)


@pytest.mark.parametrize("content,message", [
    (lambda: np.random.default_rng(0).random((4, 8), dtype=np.float32), "holds float32 values, not token ids"),
    (lambda: np.array([[1, 2], [3, 5000]]), r"token ids in \[1, 5000\], outside the target vocabulary \[0, 64\)"),
    (lambda: np.array([{"a": 1}], dtype=object), "is not a NumPy token array"),
    (lambda: b"hello world", r"is not a NumPy token array \(ValueError: no \.npy header"),  # not "pickled data"
])
def test_a_bad_token_file_is_named_before_training(tmp_path, content, message):
    """A float array cast to ids would train on nonsense without a word; text or pickles raised deep inside numpy."""
    import re

    from specfit.errors import ConfigError
    from specfit.training.drafter import load_eval_windows, load_train_tokens

    path = tmp_path / "tokens.npy"
    value = content()
    if isinstance(value, bytes):
        path.write_bytes(value)
    else:
        np.save(path, value, allow_pickle=True)
    cfg = TrainDrafterConfig(include_builtin_data=False, train_files=[str(path)], out_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=f"train_files: {re.escape(str(path))}.*{message}"):
        load_train_tokens(cfg, None, 64)
    held_out = TrainDrafterConfig(include_builtin_data=False, eval_files=[str(path)], eval_windows=2, seq_len=2)
    with pytest.raises(ConfigError, match=f"eval_files: {re.escape(str(path))}.*{message}"):  # held out alike
        load_eval_windows(held_out, None, 64)


# ------------------------------------------------------------------------------ the acceptance probe


def test_fit_probe_writes_a_probe_the_drafter_uses_losslessly(patterned, trained_head, tmp_path, capsys):
    import shutil

    from specfit.plugins.drafters.eagle3.probe import PROBE_FILE, load_probe
    from specfit.training.probe import FitProbeConfig, fit_probe

    head_dir = tmp_path / "head"
    shutil.copytree(trained_head, head_dir)
    rows = _chains(patterned["next"], 40, 33, seed=11)
    rows[::3, 16:] = np.random.default_rng(3).integers(0, VOCAB, (len(rows[::3]), 17))  # off the cycle: misses
    np.save(tmp_path / "rows.npy", rows)
    fit_probe(FitProbeConfig(target_dir=str(patterned["target"]), head_dir=str(head_dir), seq_len=32, steps=3,
                             train_files=[str(tmp_path / "rows.npy")], max_windows=40, batch_size=8))
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert 0 < result["held_out_top1_rate"] < 1 and set(result["held_out_by_step"]) == {"0", "1", "2"}
    assert result["held_out"]["auc"] > 0.5 and result["train_samples"] > 0
    probe = load_probe(head_dir, load_head(head_dir).cfg.hidden_size)
    assert probe.metrics["held_out"] == result["held_out"] and (head_dir / PROBE_FILE).is_file()

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(patterned["target"])).eval()
    prompt = _chains(patterned["next"], 1, 10, seed=7)[0].tolist()
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0]
    drafter = Eagle3Drafter(path=str(head_dir), top_k=4, depth=4, total_tokens=12)
    assert drafter.probe is not None
    from specfit.types.costs import CostConstants
    from specfit.plugins.cost_models.union import UnionCostModel
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.selectors.specfit import SpecFitSelector

    out = Engine(target, drafter=drafter, selector=SpecFitSelector(acceptance="learned", draft_gate=False),
                 cost_model=UnionCostModel(constants=CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5)),
                 predictor=HistoryPredictor(), device="cpu").generate(prompt, max_new_tokens=16)
    assert out.token_ids == ref[len(prompt):].tolist()


@pytest.mark.parametrize("settings, message", [
    ({"train_files": []}, "train_files is empty"),
    ({"train_files": ["a.npy"]}, "train_files: a.npy: no such file"),
    ({"train_files": [__file__]}, "fit-probe reads .npy token rows"),
    ({"train_files": ["x.npy"], "max_windows": 0}, "max_windows=0 must be >= 1"),
    ({"train_files": ["x.npy"], "seq_len": 1}, "seq_len=1 must be >= 2"),
])
def test_fit_probe_names_a_bad_setting(settings, message, tmp_path, monkeypatch):
    from specfit.errors import ConfigError
    from specfit.training.probe import FitProbeConfig

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((2, 8), dtype=np.int64))

    with pytest.raises(ConfigError, match=message):
        FitProbeConfig(**settings)


def test_eval_rows_that_are_training_rows_are_noted(tmp_path, monkeypatch, capsys):
    from specfit.training.probe import FitProbeConfig

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((2, 8), dtype=np.int64))
    FitProbeConfig(train_files=["x.npy"], eval_files=[str(tmp_path / "x.npy")])  # one file, spelt two ways
    err = capsys.readouterr().err
    assert f"eval_files: {tmp_path / 'x.npy'} is also in train_files, so the held-out figures are on training" in err


def test_fit_probe_names_a_missing_target_or_head_by_its_key(patterned, tmp_path):
    from specfit.errors import ModelError
    from specfit.training.probe import FitProbeConfig, fit_probe

    np.save(tmp_path / "rows.npy", _chains(patterned["next"], 4, 33, seed=1))
    rows = [str(tmp_path / "rows.npy")]
    with pytest.raises(ModelError, match=f"target_dir={tmp_path}/none: no such directory"):
        fit_probe(FitProbeConfig(target_dir=str(tmp_path / "none"), head_dir=str(tmp_path), train_files=rows))
    with pytest.raises(ModelError, match=f"head_dir={tmp_path}/none: no such directory"):
        fit_probe(FitProbeConfig(target_dir=str(patterned["target"]), head_dir=str(tmp_path / "none"), train_files=rows,
                                 seq_len=32))
    with pytest.raises(ModelError, match=f"head_dir={tmp_path}: no config.json"):
        fit_probe(FitProbeConfig(target_dir=str(patterned["target"]), head_dir=str(tmp_path), train_files=rows, seq_len=32))


def test_fit_probe_refuses_a_head_of_more_layers_than_its_unroll_follows(patterned, trained_head, tmp_path):
    from specfit.errors import ConfigError
    from specfit.plugins.drafters.eagle3.checkpoint import save_head
    from specfit.training.probe import FitProbeConfig, fit_probe

    cfg = load_head(trained_head).cfg
    cfg.num_hidden_layers = 2
    save_head(random_head(cfg), tmp_path / "deep")
    np.save(tmp_path / "rows.npy", _chains(patterned["next"], 4, 33, seed=1))
    with pytest.raises(ConfigError, match=f"head_dir={tmp_path / 'deep'}: fit-probe unrolls one-layer EAGLE-3 heads; "
                                          "this one has 2 layers"):
        fit_probe(FitProbeConfig(target_dir=str(patterned["target"]), head_dir=str(tmp_path / "deep"),
                                 train_files=[str(tmp_path / "rows.npy")], seq_len=32))
