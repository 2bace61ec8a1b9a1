"""Self-distillation data for a draft head: the target's own greedy continuations of prompts.

A head trained on corpus text learns what the corpus says next. When drafting it must predict
what the *target* says next, on text the target wrote itself: its style, its loops, its wrong
arithmetic. EAGLE's and SpecForge's recipes regenerate the training responses with the target
for this reason. ``specfit distill-data`` draws prompts from the training split the way the
benchmark workloads draw theirs from the held-out split (prose passages, GSM questions; see
:mod:`specfit.data.prompts`), lets the target continue each one greedily, and writes the rows
(prompt + continuation, ``seq_len`` tokens each) as a 2-D ``.npy`` that ``train-drafter
train_files=[...]`` reads. With ``split=heldout`` the same command makes held-out rows for
``train-drafter eval_files=[...]``: agreement on text the target wrote, as drafting sees it.

Prompts are tokenized as the engine tokenizes a prompt (no BOS added; the demo tokenizer adds
none), cut from the left to a multiple of ``LENGTH_STEP`` tokens and batched by their length, so
no row is padded and batches stay large. The continuation does not stop at EOS:
rows keep one length, and the target's behaviour after an EOS is what it does at a document
boundary in training.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.errors import ConfigError
from specfit.training.common import FrozenTargetSettings, check_trainer_config, progress_bar, write_json

#: Prompts are cut (from the left) to a multiple of this many tokens, so that batching prompts of
#: one length finds many of each: 64 prompts of 2,048 share about 10 lengths, not 80.
LENGTH_STEP = 8


@dataclass
class DistillDataConfig(FrozenTargetSettings):
    """Settings of ``specfit distill-data``."""

    target_dir: str = "runs/demo-target"  # a Hugging Face checkpoint with its tokenizer
    out: str = "runs/distill/train.npy"  # the rows; a JSON summary is written beside it (.json)
    data_dir: str | None = None  # default: SPECFIT_DATA_DIR, else <repo>/../shared/data
    split: str = "train"  # "train" for training data; "heldout" for evaluation rows
    num_prompts: int = 2048
    gsm_share: float = 0.37  # share of GSM questions (the training split's token share of GSM)
    prose_chars: int = 240  # prose passage length, as the prose workload's default
    seq_len: int = 256  # tokens a row: the prompt (cut from the left if longer) and its continuation
    min_new_tokens: int = 32  # a prompt is cut so that at least this many tokens are generated
    batch_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        from specfit.data.prompts import check_split

        check_trainer_config(self)
        check_split(self.split)
        if self.gsm_share > 1.0:
            raise ConfigError(f"gsm_share={self.gsm_share} must be in [0, 1]")
        if self.seq_len <= self.min_new_tokens:
            raise ConfigError(f"seq_len={self.seq_len} must exceed min_new_tokens={self.min_new_tokens} "
                              "(a row is a prompt and its continuation)")
        if not self.out.endswith(".npy"):
            raise ConfigError(f"out={self.out}: must name a .npy file (train-drafter reads .npy token rows)")


def training_prompts(cfg: DistillDataConfig) -> list[tuple[str, str]]:
    """(kind, text) prompts of the split: prose passages and GSM questions, seeded."""
    from specfit.data.prompts import gsm_prompts, prose_prompts

    n_gsm = int(round(cfg.num_prompts * cfg.gsm_share))
    prose = prose_prompts(cfg.data_dir, cfg.num_prompts - n_gsm, cfg.prose_chars, cfg.seed, split=cfg.split)
    gsm = gsm_prompts(cfg.data_dir, n_gsm, cfg.seed, split=cfg.split)
    return [("prose", p) for p in prose] + [("gsm", p) for p in gsm]


def greedy_rows(model: Any, prompts: Sequence[Sequence[int]], seq_len: int, batch_size: int,
                progress: Any = None) -> np.ndarray:
    """Each prompt continued greedily to ``seq_len`` tokens, batched by prompt length (no padding).

    Row i is ``prompts[i]`` followed by the target's argmax continuation, as the engine's greedy
    decoding would produce it (up to batched float rounding)."""
    import torch

    rows = np.zeros((len(prompts), seq_len), dtype=np.int32)
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not 0 < len(p) < seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; a row of {seq_len} needs 1 to {seq_len - 1}")
        by_length.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for length, members in sorted(by_length.items()):
            for start in range(0, len(members), batch_size):
                idx = members[start:start + batch_size]
                x = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long, device=model.device)
                out = model(input_ids=x, use_cache=True)
                tokens = [x]
                for step in range(seq_len - length):
                    if step:
                        out = model(input_ids=tokens[-1], cache=out.cache, use_cache=True)
                    tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
                rows[idx] = torch.cat(tokens, dim=1).cpu().numpy()
                if progress is not None:
                    progress.update(len(idx))
    return rows


def _cut(ids: list[int], keep: int) -> list[int]:
    """The last ``keep`` tokens at most, rounded down to a multiple of LENGTH_STEP (all if shorter)."""
    ids = ids[-keep:]
    n = len(ids) - len(ids) % LENGTH_STEP
    return ids[-n:] if n else ids


def distill_data(cfg: DistillDataConfig) -> Path:
    """Write ``cfg.out`` (rows of prompt + greedy continuation) and a JSON summary beside it."""
    from specfit.model.sources import load_tokenizer
    from specfit.files import check_writable
    from specfit.training.drafter import _set_threads, load_frozen_target
    from specfit.training.target import check_model_context, repeated_ngram_fraction
    from specfit.validation import device_arg

    device_arg(cfg.device, key="device")
    check_model_context(cfg.target_dir, cfg.seq_len, key="target_dir")
    out = check_writable(cfg.out, "out")
    _set_threads(cfg.threads)
    tokenizer = load_tokenizer(cfg.target_dir, "target_dir", required=True)
    prompts = training_prompts(cfg)
    keep = cfg.seq_len - cfg.min_new_tokens
    ids = [_cut(tokenizer(text, add_special_tokens=False)["input_ids"], keep) for _, text in prompts]
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:  # a degenerate passage (whitespace the tokenizer drops): one line, not a ValueError deep down
        raise ConfigError(f"{len(empty)} of the prompts tokenize to nothing (the first: {prompts[empty[0]][1]!r:.60}); "
                          "check data_dir's text or raise prose_chars")
    model = load_frozen_target(cfg.target_dir, cfg.target_dtype, cfg.device)

    began = time.perf_counter()
    bar = progress_bar(len(ids), desc="distill-data", unit="prompt", every=max(1, len(ids) // 20))
    try:
        rows = greedy_rows(model, ids, cfg.seq_len, cfg.batch_size, bar)
    finally:
        bar.close()
    seconds = time.perf_counter() - began
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, rows)
    kinds = [k for k, _ in prompts]
    summary: dict[str, Any] = {
        "config": asdict(cfg), "rows": len(rows), "seconds": round(seconds, 1),
        "generated_tokens": int(sum(cfg.seq_len - len(p) for p in ids)),
        "prompt_tokens_mean": round(float(np.mean([len(p) for p in ids])), 1),
    }
    for kind in ("prose", "gsm"):
        picked = [rows[i, len(ids[i]):] for i, k in enumerate(kinds) if k == kind]
        summary[f"{kind}_rows"] = len(picked)
        if picked:
            summary[f"{kind}_repeat4_mean"] = round(float(np.mean([repeated_ngram_fraction(r.tolist()) for r in picked])), 4)
    write_json(out.with_suffix(".json"), summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    return out
