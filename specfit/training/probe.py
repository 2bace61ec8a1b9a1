"""``specfit fit-probe``: fit a trained EAGLE-3 head's acceptance probe on the target's own text.

The head is unrolled over token windows exactly as in training (:func:`ttt_unroll`, ``steps``
drafting depths); at each position and step, the label is whether the head's top-1 is the
target's argmax there, the input its output state with the summaries of its distribution
(:func:`~specfit.plugins.drafters.eagle3.probe.probe_inputs`). A logistic model is fit on
``train_files`` and scored on ``eval_files`` against the same model on the summaries alone, so the
output says what the hidden state adds. Rows of the target's greedy text (``specfit distill-data``)
are what drafting sees; the head should not have been trained on the rows the probe is fit on, or
the probe learns how sure the head is of text it has memorised.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specfit.errors import ConfigError
from specfit.training.common import FrozenTargetSettings, check_trainer_config, progress_bar


@dataclass
class FitProbeConfig(FrozenTargetSettings):
    """Settings of ``specfit fit-probe``."""

    target_dir: str = "runs/demo-target"  # a Hugging Face checkpoint (AutoModelForCausalLM)
    head_dir: str = "runs/demo-head"  # the trained head; the probe is written into it
    train_files: list[str] = field(default_factory=list)  # .npy token rows (specfit distill-data)
    eval_files: list[str] = field(default_factory=list)  # held-out rows; none: every tenth window
    seq_len: int = 256  # window length (a 1-D file is cut into windows; a row longer than this too)
    max_windows: int = 512  # training windows used at most (drawn at random from the files)
    steps: int = 4  # drafting depths learnt from (the head's TTT steps 0..steps-1)
    max_samples: int = 200_000  # (position, step) samples kept, drawn evenly at random
    l2: float = 1e-3  # L2 penalty on the standardised weights
    batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_trainer_config(self)
        for key, least in (("max_windows", 1), ("seq_len", 2)):
            if getattr(self, key) < least:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= {least}")
        if not self.train_files:
            raise ConfigError("train_files is empty: give .npy token rows of the target's own text "
                              "(specfit distill-data target_dir=DIR out=F.npy)")
        for key in ("train_files", "eval_files"):
            for name in getattr(self, key):
                if not str(name).endswith(".npy"):
                    raise ConfigError(f"{key}: {name}: fit-probe reads .npy token rows (specfit distill-data)")


def _windows(files: list[str], key: str, seq_len: int, vocab_size: int) -> np.ndarray:
    from specfit.training.drafter import _npy_documents

    rows = []
    for path in files:
        for doc in _npy_documents(path, key, vocab_size):
            n = len(doc) // seq_len
            rows += [doc[i * seq_len:(i + 1) * seq_len] for i in range(n)]
    if not rows:
        raise ConfigError(f"{key}: no window of seq_len={seq_len} tokens in {', '.join(files)}")
    return np.stack(rows).astype(np.int64)


def probe_samples(head: Any, model: Any, windows: np.ndarray, layers: Any, steps: int, keep: float,
                  batch_size: int, seed: int, progress: Any = None) -> tuple[Any, Any, Any]:
    """(inputs [n, H+3], labels [n], step [n]) over ``windows``, a ``keep`` share of the samples."""
    import torch

    from specfit.plugins.drafters.eagle3.probe import probe_inputs, summarise
    from specfit.training.drafter import target_batch, ttt_unroll

    gen = torch.Generator().manual_seed(seed)
    xs, ys, ss = [], [], []
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[start:start + batch_size]).to(model.device)
            batch = target_batch(model, x, layers, None)
            for i, hidden in enumerate(ttt_unroll(head, batch.features.to(head.norm.weight.dtype), x, steps)):
                m = hidden.shape[1]
                pick = torch.rand(hidden.shape[:2], generator=gen) < keep
                h = hidden[pick.to(hidden.device)].float()
                logp = torch.log_softmax(head.logits(h.to(head.norm.weight.dtype)).float(), -1)
                guess = head.to_target_ids(logp.argmax(-1))
                truth = batch.top[:, i:i + m][pick.to(hidden.device)]
                xs.append(probe_inputs(h, *summarise(logp)).cpu())
                ys.append((guess == truth).float().cpu())
                ss.append(torch.full((len(h),), i))
            if progress is not None:
                progress.update(len(x))
    return torch.cat(xs), torch.cat(ys), torch.cat(ss)


def scores(logit: Any, y: Any) -> dict[str, float]:
    """Log loss, Brier score and AUC of logits against 0/1 labels."""
    import torch
    import torch.nn.functional as F

    p = torch.sigmoid(logit.double())
    y = y.double()
    ranks = torch.empty(len(p), dtype=torch.float64)
    ranks[torch.argsort(logit)] = torch.arange(len(p), dtype=torch.float64)
    pos = y > 0.5
    npos, nneg = int(pos.sum()), int((~pos).sum())
    auc = float((ranks[pos].sum() - npos * (npos - 1) / 2) / (npos * nneg)) if npos and nneg else float("nan")
    return {"log_loss": round(float(F.binary_cross_entropy(p.clamp(1e-9, 1 - 1e-9), y)), 4),
            "brier": round(float(((p - y) ** 2).mean()), 4), "auc": round(auc, 4)}


def fit_probe(cfg: FitProbeConfig) -> Path:
    """Fit the probe, print its held-out scores beside the summaries-only model's, save it in head_dir."""
    import torch

    from specfit.plugins.drafters.eagle3.checkpoint import check_head_fits, load_head
    from specfit.plugins.drafters.eagle3.drafter import head_feature_layers
    from specfit.files import check_writable
    from specfit.plugins.drafters.eagle3.probe import PROBE_FILE, SUMMARIES, fit_logistic, save_probe
    from specfit.training.drafter import _set_threads, load_frozen_target
    from specfit.training.target import check_model_context
    from specfit.validation import device_arg

    device_arg(cfg.device, key="device")
    check_model_context(cfg.target_dir, cfg.seq_len, key="target_dir")
    head = load_head(cfg.head_dir, key="head_dir")  # its problems before the target loads
    if head.cfg.num_hidden_layers != 1:  # the unroll that gives the states follows one-layer heads
        raise ConfigError(f"head_dir={cfg.head_dir}: fit-probe unrolls one-layer EAGLE-3 heads; this one has "
                          f"{head.cfg.num_hidden_layers} layers")
    check_writable(Path(cfg.head_dir).expanduser() / PROBE_FILE, "head_dir")
    _set_threads(cfg.threads)
    model = load_frozen_target(cfg.target_dir, cfg.target_dtype, cfg.device)
    check_head_fits(head, model.config)
    head = head.to(device=model.device, dtype=model.dtype).eval()
    if head.embed_tokens is None:
        head.set_target_embedding(model.get_input_embeddings())
    if head.lm_head is None:
        head.set_target_lm_head(model.get_output_embeddings())
    layers = head_feature_layers(head.cfg, model.config.num_hidden_layers)
    vocab = model.config.vocab_size
    windows = _windows(cfg.train_files, "train_files", cfg.seq_len, vocab)
    rng = np.random.default_rng(cfg.seed)
    if cfg.eval_files:
        held = _windows(cfg.eval_files, "eval_files", cfg.seq_len, vocab)
    else:
        held, windows = windows[::10], np.delete(windows, np.s_[::10], axis=0)
        if not len(windows):
            raise ConfigError("train_files hold too few windows to hold every tenth out; give eval_files")
    windows = windows[np.sort(rng.permutation(len(windows))[: cfg.max_windows])]
    held = held[: max(1, cfg.max_windows // 4)]
    per_window = (cfg.seq_len - 1) * cfg.steps
    keep = min(1.0, cfg.max_samples / max(1, per_window * len(windows)))

    began = time.perf_counter()
    bar = progress_bar(len(windows) + len(held), desc="fit-probe", unit="window", every=max(1, len(windows) // 10))
    try:
        x, y, _ = probe_samples(head, model, windows, layers, cfg.steps, keep, cfg.batch_size, cfg.seed, bar)
        hx, hy, hs = probe_samples(head, model, held, layers, cfg.steps, 1.0, cfg.batch_size, cfg.seed + 1, bar)
    finally:
        bar.close()
    for name, labels in (("train_files", y), ("eval_files" if cfg.eval_files else "train_files (held out)", hy)):
        if len(labels) == 0 or float(labels.min()) == float(labels.max()):  # one class: nothing to separate
            seen = "no samples" if len(labels) == 0 else f"the head's top-1 {'right' if labels[0] else 'wrong'} on all {len(labels)}"
            raise ConfigError(f"{name}: {seen}: nothing to fit or score a probe on (more rows, or raise max_samples)")
    probe = fit_logistic(x, y, cfg.l2)
    summaries = fit_logistic(x[:, -len(SUMMARIES):], y, cfg.l2)  # the same model without the hidden state
    with torch.no_grad():
        full, base = probe.score(hx), summaries.score(hx[:, -len(SUMMARIES):])
    result: dict[str, Any] = {
        "train_samples": len(y), "held_out_samples": len(hy), "held_out_top1_rate": round(float(hy.mean()), 4),
        "held_out": scores(full, hy), "held_out_summaries_only": scores(base, hy),
        "held_out_by_step": {str(i): scores(full[hs == i], hy[hs == i]) for i in range(cfg.steps)},
        "seconds": round(time.perf_counter() - began, 1),
    }
    probe.metrics = {"config": asdict(cfg), **result}
    if not all(bool(torch.isfinite(t).all()) for t in (probe.mean, probe.scale, probe.weight, probe.bias)):
        raise ConfigError("fit-probe: the fit diverged (non-finite weights); raise l2, or check the rows")
    replaced = (Path(cfg.head_dir).expanduser() / PROBE_FILE).is_file()
    path = save_probe(probe, Path(cfg.head_dir).expanduser())
    print(json.dumps(result))
    print(f"fit-probe: wrote {path}" + (" (replacing the probe it held)" if replaced else ""))
    return path
