"""Train an EAGLE-3 draft head for any Hugging Face MoE target (Qwen3-MoE, OLMoE, Mixtral, ...).

The target is frozen; each batch runs it once to get (a) its residual stream at three layers,
concatenated (the head's input features) and (b) its next-token distribution (the soft labels).
Both are computed on the fly: on the demo shape (Qwen3-MoE, hidden 192, 6 layers, 4096 tokens)
the target's forward is only 12-18% of a training step on a CPU (seven unrolled head steps with
a vocabulary-wide softmax each cost far more), while a disk cache of its distributions would
take ~19 KB a token (tens of GB for a few million tokens).

Training-time test (EAGLE-3): the head is unrolled ``ttt_steps`` times so that it learns from its
own outputs, as it runs when drafting. With tokens ``x[0..L-1]`` and target features ``f[t]``:

* step 0 at position t: pair (fc(f[t]), x[t+1]) at rotary position t, causal attention over the
  step-0 pairs; its output h0[t] predicts x[t+2], against the target's distribution at t+1;
* step i at position t: pair (h_{i-1}[t], x[t+1+i]) at rotary position t+i; it attends to the
  step-0 keys of positions <= t and to its own keys of steps 1..i (the "diagonal"); its output
  predicts x[t+2+i] against the target's distribution at t+1+i.

This is exactly what :class:`~specfit.plugins.drafters.eagle3.drafter.Eagle3Drafter` does for a
chain of the draft tree: t is the last committed position, the committed pairs are in the head's
KV cache, and the depth-d pair sits at position ``committed - 1 + d`` attending to the committed
pairs and its ancestors (a test checks the two agree to float precision). Positions whose step-i
label would lie past the window's end are dropped (the "mask at the sequence end"), which also
lets step i process only the first ``L - 1 - i`` positions.

Loss: soft cross-entropy between the head's draft-vocabulary distribution and the target's
distribution restricted to the draft vocabulary and renormalised, weighted ``decay**i`` at step i.

Data: the corpus/GSM pipeline of :mod:`specfit.training.target` (same tokenization, cache and
deterministic packed windows, so a resumed run sees exactly the batches an uninterrupted one
would), plus pre-tokenized ``.npy`` files for targets whose text we do not have.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.errors import ConfigError
from specfit.training.common import JsonlLog, check_trainer_config, progress_bar, warmup_cosine_lr, write_json
from specfit.training.draft_vocab import DraftVocab, build_draft_vocab, token_counts

#: Fields a resumed run must share with its checkpoint (the head's shape, data stream, schedule).
RESUME_FIELDS = (
    "draft_vocab_size", "aux_layers", "head_intermediate_size", "ttt_steps", "step_weight_decay",
    "include_builtin_data", "gsm_per_template", "gsm_seed", "train_files", "seq_len", "batch_size",
    "max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "seed", "init_from",
)
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainDrafterConfig:
    """Settings of :func:`train_drafter`. Defaults suit the demo target on a CPU."""

    target_dir: str = "runs/demo-target"  # a Hugging Face checkpoint (AutoModelForCausalLM)
    out_dir: str = "runs/demo-head"
    tokenizer_dir: str | None = None  # default: target_dir (needed only for text data)

    # data (the corpus pipeline of specfit.training.target)
    data_dir: str | None = None  # default: <repo>/../shared/data
    include_builtin_data: bool = True  # Shakespeare + KJV train split + GSM train templates
    gsm_per_template: int = 140
    gsm_seed: int = 0
    # extra training data: .txt / .jsonl ({"text": ...}) are tokenized; .npy holds token ids
    # (a 1-D array is one document, EOS included; a 2-D array is one document per row)
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # held-out data in the same formats

    # head
    draft_vocab_size: int = 32000  # >= the target vocabulary: the full vocabulary
    aux_layers: list[int] | None = None  # HF hidden_states indices; None: [2, N//2, N-3] (as the drafter)
    head_intermediate_size: int | None = None  # None: the target's intermediate_size
    vocab_count_tokens: int | None = None  # count frequencies on the first N training tokens (None: all)

    # training-time test
    ttt_steps: int = 7
    step_weight_decay: float = 0.8

    # optimisation
    seq_len: int = 256
    batch_size: int = 8
    max_steps: int = 2000
    max_tokens: int | None = None  # token budget; when set, max_steps = ceil(max_tokens / (batch * seq_len))
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0

    # execution
    threads: int = 1
    device: str = "cpu"
    target_dtype: str = "float32"  # the frozen target's dtype (bfloat16 for large targets on a GPU)
    experts_implementation: str | None = "grouped_mm"  # transformers' experts kernel (None: the model's)

    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 32  # held-out windows for eval loss / per-step accuracy (0: no eval)
    checkpoint_every: int = 100
    resume: bool = False
    # a head directory (public EAGLE-3 layout) whose weights start the run: continue training a
    # shipped head with a new schedule (its shape and draft vocabulary must match this run's)
    init_from: str | None = None
    stop_after_steps: int | None = None  # checkpoint and return at this step (time-sliced runs)
    progress: bool | None = None  # None: a bar on a terminal, else a line per log_every steps; false: neither
    save_dtype: str = "float32"
    # acceptance length at the end, on held-out prompts of the built-in data (0: skip)
    eval_prompts: int = 0
    eval_max_new_tokens: int = 64

    def resolved(self) -> TrainDrafterConfig:
        """A copy with ``max_steps`` derived from ``max_tokens`` when a token budget is given."""
        if self.max_tokens is None:
            return replace(self)
        per_step = self.batch_size * self.seq_len
        return replace(self, max_steps=max(1, math.ceil(self.max_tokens / per_step)), max_tokens=None)

    def __post_init__(self) -> None:
        check_trainer_config(self)


def config_from_dict(d: dict[str, Any]) -> TrainDrafterConfig:
    """A :class:`TrainDrafterConfig` from a dict (e.g. a Hydra node), ignoring unknown keys."""
    names = {f.name for f in fields(TrainDrafterConfig)}
    return TrainDrafterConfig(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------------------------
# target features


@dataclass
class TargetBatch:
    """What the frozen target gives one batch of windows ``x`` [B, L]."""

    features: Any  # [B, L-1, 3H] fused residual streams at positions 0..L-2 (float32)
    probs: Any  # [B, L-1, draft_vocab] target distribution at positions 1..L-1, restricted + renormalised
    top: Any  # [B, L-1] the target's argmax (full vocabulary) at positions 1..L-1


def target_batch(model: Any, input_ids: Any, layers: Sequence[int], draft_ids: Any | None) -> TargetBatch:
    """Run the frozen target once: features for the head's input and soft labels for its loss.

    ``draft_ids`` (target ids of the draft vocabulary) restricts the distribution; None keeps the
    whole vocabulary.
    """
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        features = torch.cat([hs[i][:, :-1] for i in layers], dim=-1).float()
        logits = out.logits[:, 1:].float()
        top = logits.argmax(-1)
        if draft_ids is not None:
            logits = logits.index_select(-1, draft_ids)
        probs = torch.softmax(logits, dim=-1)
    return TargetBatch(features, probs, top)


# ---------------------------------------------------------------------------------------------
# the training-time-test unroll


def ttt_unroll(head: Any, features: Any, input_ids: Any, steps: int) -> list[Any]:
    """Head outputs of each TTT step: element i is [B, L-1-i, H] for positions t = 0..L-2-i.

    ``features`` [B, L-1, 3H] are the target's at positions 0..L-2, ``input_ids`` [B, L] the window.
    Step i pairs the previous step's output at t with token ``x[t+1+i]`` at rotary position t+i;
    attention covers the step-0 keys of positions <= t and the step-1..i keys of the same t.
    """
    import torch

    if head.cfg.num_hidden_layers != 1:
        raise ValueError(f"the TTT unroll follows one-layer heads; this head has {head.cfg.num_hidden_layers} layers")
    n = input_ids.shape[1] - 1
    steps = min(steps, n)
    hidden = head.project(features)
    keys0 = values0 = None
    diag: list[tuple[Any, Any]] = []  # (k, v) of steps 1..i, cut to the current positions
    outs = []
    for i in range(steps):
        m = n - i  # positions whose step-i label is still inside the window
        hidden = hidden[:, :m]
        tokens = input_ids[:, 1 + i:1 + i + m]
        positions = torch.arange(i, i + m, device=input_ids.device)
        q, k, v = _qkv(head, hidden, tokens, positions)
        if i == 0:
            keys0, values0 = k, v
            attn = _causal_attention(q, k, v)
        else:
            diag = [(dk[..., :m, :], dv[..., :m, :]) for dk, dv in diag] + [(k, v)]
            attn = _ttt_attention(q, keys0[..., :m, :], values0[..., :m, :], diag)
        hidden = _finish_layer(head, hidden, attn)
        outs.append(hidden)
    return outs


def _qkv(head: Any, hidden: Any, tokens: Any, positions: Any) -> tuple[Any, Any, Any]:
    """Queries [B, kv, rep, m, hd] and keys / values [B, kv, 1, m, hd] with rotary applied."""
    import torch

    from specfit.plugins.drafters.eagle3.head import _rope

    layer, attn = head.midlayer, head.midlayer.self_attn
    b, m, _ = hidden.shape
    emb = head.embed(tokens).to(hidden.dtype)
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
    rep = attn.heads // attn.kv_heads
    q = attn.q_proj(x).view(b, m, attn.kv_heads, rep, attn.head_dim).permute(0, 2, 3, 1, 4)
    k = attn.k_proj(x).view(b, m, attn.kv_heads, 1, attn.head_dim).permute(0, 2, 3, 1, 4)
    v = attn.v_proj(x).view(b, m, attn.kv_heads, 1, attn.head_dim).permute(0, 2, 3, 1, 4)
    if hasattr(attn, "q_norm"):  # qk_norm: each head's query and key normalised before rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = head.rotary(x, positions[None].expand(b, -1))
    cos, sin = cos[:, None, None], sin[:, None, None]  # [B, 1, 1, m, hd]
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _causal_attention(q: Any, k: Any, v: Any) -> Any:
    """Step 0: plain causal attention over the step-0 pairs (SDPA, GQA heads expanded)."""
    import torch.nn.functional as F

    b, kv, rep, m, hd = q.shape
    heads = kv * rep
    k = k.expand(-1, -1, rep, -1, -1).reshape(b, heads, m, hd)
    v = v.expand(-1, -1, rep, -1, -1).reshape(b, heads, m, hd)
    out = F.scaled_dot_product_attention(q.reshape(b, heads, m, hd), k, v, is_causal=True)
    return out.view(b, kv, rep, m, hd)


def _ttt_attention(q: Any, k0: Any, v0: Any, diag: list[tuple[Any, Any]]) -> Any:
    """Attention of step i > 0: causal over the step-0 keys, plus one key per earlier step at the same t."""
    import torch

    m, hd = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(hd)
    scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, kv, rep, m, m]
    causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    scores_d = torch.stack([(q * dk).sum(-1) for dk, _ in diag], dim=-1) * scale  # [B, kv, rep, m, i]
    probs = torch.softmax(torch.cat([scores0, scores_d], dim=-1), dim=-1)
    out = probs[..., :m] @ v0
    values_d = torch.stack([dv.expand_as(q) for _, dv in diag], dim=-2)  # [B, kv, rep, m, i, hd]
    return out + (probs[..., m:, None] * values_d).sum(-2)


def _finish_layer(head: Any, hidden: Any, attn_out: Any) -> Any:
    """o_proj + residual + MLP, as in :meth:`Eagle3Head.forward` (its ``norm_before_residual`` and
    ``feed_normed`` too: the output is what the next step reads)."""
    layer = head.midlayer
    b, kv, rep, m, hd = attn_out.shape
    residual = layer.hidden_norm(hidden) if head.cfg.norm_before_residual else hidden
    h = residual + layer.self_attn.o_proj(attn_out.permute(0, 3, 1, 2, 4).reshape(b, m, kv * rep * hd))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.norm(h) if head.cfg.feed_normed else h


@dataclass
class TTTResult:
    loss: Any  # weighted sum over steps (a scalar tensor with grad)
    step_loss: list[float]  # soft cross-entropy per step
    step_correct: list[int]  # positions where the head's top-1 equals the target's argmax
    step_count: list[int]  # positions scored per step


def ttt_loss(head: Any, batch: TargetBatch, input_ids: Any, steps: int, decay: float) -> TTTResult:
    """The EAGLE-3 loss of one batch: sum over steps of ``decay**i`` x soft cross-entropy at step i."""
    import torch

    outs = ttt_unroll(head, batch.features, input_ids, steps)
    total = torch.zeros((), device=input_ids.device)
    step_loss, correct, count = [], [], []
    for i, hidden in enumerate(outs):
        m = hidden.shape[1]
        logits = head.logits(hidden).float()
        target = batch.probs[:, i:i + m]
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
        total = total + (decay ** i) * ce
        with torch.no_grad():
            pred = head.to_target_ids(logits.argmax(-1))
            correct.append(int((pred == batch.top[:, i:i + m]).sum()))
        step_loss.append(float(ce.detach()))
        count.append(int(pred.numel()))
    return TTTResult(total, step_loss, correct, count)


# ---------------------------------------------------------------------------------------------
# data


def _special_ids(model: Any, tokenizer: Any | None) -> list[int]:
    """Special tokens the draft vocabulary must hold (EOS above all: drafts must be able to stop)."""
    ids: set[int] = set()
    for source in (getattr(model, "config", None), getattr(model, "generation_config", None), tokenizer):
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(source, name, None)
            if value is None:
                continue
            ids |= {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}
    if tokenizer is not None:
        ids |= {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    return sorted(ids)


def _npy_documents(path: str, key: str = "train_files", vocab_size: int | None = None) -> list[np.ndarray]:
    """A token file's documents; a file that is not an integer token array in range is one line
    naming ``key`` and the file (a float array cast to ids would train on nonsense, silently)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic != b"\x93NUMPY":  # np.load takes any other bytes for a pickle and says so: misleading
            raise ValueError("no .npy header: not a file np.save wrote")
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"{key}: {path} is not a NumPy token array ({type(exc).__name__}: {exc})") from None
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):  # bool is not an integer here
        kind = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ConfigError(f"{key}: {path} holds {kind} values, not token ids (an integer array)")
    if vocab_size is not None and arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise ConfigError(f"{key}: {path} has token ids in [{int(arr.min())}, {int(arr.max())}], outside the "
                          f"target vocabulary [0, {vocab_size})")
    if arr.ndim == 1:
        return [arr.astype(np.int64)]
    if arr.ndim == 2:
        return [row.astype(np.int64) for row in arr]
    raise ConfigError(f"{path}: token arrays must be 1-D (one document) or 2-D (one per row), got {arr.ndim}-D")


def _text_files(paths: Sequence[str]) -> list[str]:
    return [p for p in paths if not p.endswith(".npy")]


def load_train_tokens(cfg: TrainDrafterConfig, tokenizer: Any | None, vocab_size: int) -> Any:
    """Training documents as a :class:`~specfit.training.target.TokenData`.

    Text (built-in corpus and GSM, ``.txt`` / ``.jsonl`` files) goes through the target trainer's
    tokenize-and-cache step (``out_dir/data``); ``.npy`` token files are appended as they are.
    """
    from specfit.training.target import TokenData, TrainTargetConfig, prepare_train_data

    arrays: list[np.ndarray] = []
    kinds: list[str] = []
    text = _text_files(cfg.train_files)
    if cfg.include_builtin_data or text:
        if tokenizer is None:
            raise ConfigError(f"text training data needs a tokenizer; none at {cfg.tokenizer_dir or cfg.target_dir}")
        tcfg = TrainTargetConfig(tokenizer_dir=cfg.tokenizer_dir or cfg.target_dir, data_dir=cfg.data_dir,
                                 include_builtin_data=cfg.include_builtin_data, train_files=text,
                                 gsm_per_template=cfg.gsm_per_template, gsm_seed=cfg.gsm_seed)
        data = prepare_train_data(tcfg, tokenizer, Path(cfg.out_dir) / "data")
        arrays += [data.doc(i).astype(np.int64) for i in range(len(data))]
        kinds += list(data.kinds)
    for path in cfg.train_files:
        if path.endswith(".npy"):
            docs = _npy_documents(path, "train_files", vocab_size)
            arrays += docs
            kinds += ["tokens"] * len(docs)
    if not arrays:
        raise ConfigError("no training data: include_builtin_data is off and train_files is empty")
    tokens = np.concatenate(arrays)
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ConfigError(f"training token ids outside the target vocabulary [0, {vocab_size})")
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return TokenData(tokens.astype(np.int32), offsets, kinds)


def load_eval_windows(cfg: TrainDrafterConfig, tokenizer: Any | None,
                      vocab_size: int | None = None) -> np.ndarray | None:
    """Held-out windows of ``seq_len`` tokens: ``eval_files`` if given, else the built-in held-out
    documents (prose and GSM, half each); None when there is nothing held out or eval is off."""
    from specfit.training.common import read_text_files
    from specfit.training.target import eval_windows, heldout_documents, tokenize_documents

    if cfg.eval_windows <= 0:
        return None
    rows: list[np.ndarray] = []
    if cfg.eval_files:
        docs: list[np.ndarray] = []
        text = _text_files(cfg.eval_files)
        if text:
            arrays, _ = tokenize_documents(tokenizer, read_text_files(text), "eval")
            docs += [a.astype(np.int64) for a in arrays]
        for path in cfg.eval_files:
            if path.endswith(".npy"):
                docs += _npy_documents(path, "eval_files", vocab_size)
        stream = np.concatenate(docs)
        n = len(stream) // cfg.seq_len
        if n == 0:
            raise ConfigError(f"eval_files hold {len(stream)} tokens, fewer than one window of {cfg.seq_len}")
        windows = stream[: n * cfg.seq_len].reshape(n, cfg.seq_len)
        pick = np.unique(np.linspace(0, n - 1, min(n, cfg.eval_windows)).round().astype(int))
        rows.append(windows[pick])
    elif cfg.include_builtin_data and tokenizer is not None:
        prose, gsm = heldout_documents(cfg.data_dir)
        half = max(1, cfg.eval_windows // 2)
        for docs_ in (prose, gsm):
            rows.append(eval_windows(tokenizer, docs_, cfg.seq_len - 1, half))  # seq_len tokens each
    else:
        return None
    return np.concatenate(rows).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# model set-up


def load_frozen_target(target_dir: str, dtype: str = "float32", device: str = "cpu",
                       experts_implementation: str | None = None) -> Any:
    """The target from a Hugging Face checkpoint, frozen and in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ConfigError(f"target_dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(str(Path(target_dir).expanduser()), dtype=getattr(torch, dtype))
    if experts_implementation and hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(experts_implementation)
        except (ValueError, NotImplementedError):
            pass  # a model without switchable experts keeps its own
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def build_head(model: Any, cfg: TrainDrafterConfig, vocab: DraftVocab, layers: Sequence[int]) -> Any:
    """A seeded random head shaped for ``model`` with the draft vocabulary and feature layers set."""
    import torch

    from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, random_head

    hcfg = head_config_for(model)
    hcfg.draft_vocab_size = vocab.size
    hcfg.aux_layer_ids = [int(i) - 1 for i in layers]  # SGLang convention: layer id = HF index - 1
    if cfg.head_intermediate_size:
        hcfg.intermediate_size = cfg.head_intermediate_size
    hcfg.max_position_embeddings = max(hcfg.max_position_embeddings, cfg.seq_len + cfg.ttt_steps)
    hcfg.attention_window = cfg.seq_len  # the windows it is trained on: drafting attends within them
    head = random_head(hcfg, seed=cfg.seed)
    with torch.no_grad():
        head.d2t.copy_(torch.from_numpy(vocab.d2t))
        head.t2d.copy_(torch.from_numpy(vocab.t2d))
    head.set_target_embedding(model.get_input_embeddings())
    return head


def _resolve_layers(n: int, aux_layers: Sequence[int] | None) -> list[int]:
    """The three HF hidden_states indices the head fuses, for an ``n``-layer target."""
    from specfit.plugins.drafters.eagle3.drafter import default_feature_layers

    layers = list(aux_layers) if aux_layers else default_feature_layers(n)
    if len(layers) != 3:
        raise ConfigError(f"aux_layers={layers}: an EAGLE-3 head fuses exactly three target layers")
    if min(layers) < 1 or max(layers) > n:
        raise ConfigError(f"aux_layers={layers}: HF hidden_states indices must be in [1, {n}] for a {n}-layer target")
    return layers


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(max(1, threads))


def _optimizer(head: Any, cfg: TrainDrafterConfig) -> Any:
    import torch

    decay, no_decay = [], []
    for name, p in head.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def _check_resume(saved: dict[str, Any], cfg: TrainDrafterConfig) -> None:
    bad = [f"{k}: checkpoint {saved.get(k)!r} != now {getattr(cfg, k)!r}"
           for k in RESUME_FIELDS if saved.get(k) != getattr(cfg, k)]
    if bad:
        raise ConfigError("cannot resume: the checkpoint was made with different settings (" + "; ".join(bad) + ")")


# ---------------------------------------------------------------------------------------------
# evaluation on held-out windows


def evaluate_head(head: Any, model: Any, windows: np.ndarray, layers: Sequence[int], steps: int,
                  decay: float, batch_size: int = 8, device: str = "cpu") -> dict[str, Any]:
    """Held-out TTT loss and per-step top-1 accuracy (head's top-1 == target's argmax)."""
    import torch

    draft_ids = _draft_ids(head, model)
    was_training = head.training
    head.eval()
    loss_sum, n_batches = 0.0, 0
    correct = np.zeros(steps)
    count = np.zeros(steps)
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[start:start + batch_size]).to(device)
            res = ttt_loss(head, target_batch(model, x, layers, draft_ids), x, steps, decay)
            loss_sum += float(res.loss)
            n_batches += 1
            correct[: len(res.step_correct)] += res.step_correct
            count[: len(res.step_count)] += res.step_count
    head.train(was_training)
    acc = (correct / np.maximum(count, 1)).round(4).tolist()
    return {"eval_loss": loss_sum / max(1, n_batches), "eval_acc": acc}


def _draft_ids(head: Any, model: Any) -> Any | None:
    """Target ids of the draft vocabulary, or None for the full vocabulary."""
    import torch

    if head.cfg.draft_vocab_size >= model.config.vocab_size:
        return None
    return torch.arange(head.cfg.draft_vocab_size, device=head.d2t.device) + head.d2t


# ---------------------------------------------------------------------------------------------
# training


def train_drafter(cfg: TrainDrafterConfig) -> Path:
    """Train (or resume) an EAGLE-3 head for ``cfg.target_dir``; returns ``cfg.out_dir``.

    ``out_dir`` holds the head in the public layout (``config.json`` + ``model.safetensors``,
    loadable by :func:`~specfit.plugins.drafters.eagle3.checkpoint.load_head`, ``Eagle3Drafter``,
    SGLang and vLLM), ``draft_vocab.json`` (size, coverage of the training tokens),
    ``train_config.json``, ``train_log.jsonl`` (loss, per-step accuracy, tokens/s, time in the
    target vs the head), ``checkpoint/state.pt`` and ``training_summary.json``.
    """
    import random

    import torch

    from specfit.plugins.drafters.eagle3.checkpoint import save_head
    from specfit.training.common import load_state, set_rng_state, truncate_log
    from specfit.training.target import WindowSampler, save_checkpoint

    cfg = cfg.resolved()
    if cfg.ttt_steps < 1:
        raise ConfigError(f"ttt_steps={cfg.ttt_steps} must be >= 1")
    if cfg.save_dtype not in DTYPES:
        raise ConfigError(f"save_dtype={cfg.save_dtype!r} is not one of {', '.join(DTYPES)}")
    from specfit.model.sources import check_source, load_tokenizer
    from specfit.files import missing_directory
    from specfit.training.target import _check_saved_target
    from specfit.validation import device_arg

    device_arg(cfg.device, key="device")
    check_source(cfg.target_dir, "target_dir")  # before anything is written: a typo creates no out_dir
    if Path(cfg.target_dir).expanduser().is_dir():  # a hub id: from_pretrained finds its config.json
        layers = _check_saved_target(cfg.target_dir, "target_dir").get("num_hidden_layers")
        if isinstance(layers, int) and not isinstance(layers, bool):
            _resolve_layers(layers, cfg.aux_layers)  # aux_layers out of range: named before out_dir is made
    if cfg.tokenizer_dir:
        check_source(cfg.tokenizer_dir, "tokenizer_dir")
    if cfg.init_from and not Path(cfg.init_from).expanduser().is_dir():
        raise ConfigError(f"init_from={cfg.init_from}: {missing_directory(cfg.init_from)} (name a head saved by train-drafter)")
    _set_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    log = JsonlLog(out / "train_log.jsonl")

    state: dict[str, Any] | None = None
    if cfg.resume and (ckpt_dir / "state.pt").exists():
        state = load_state(ckpt_dir / "state.pt")
        _check_resume(state["config"], cfg)
    elif not cfg.resume and log.path.exists():
        log.path.unlink()  # a fresh run starts a fresh log
    write_json(out / "train_config.json", asdict(cfg))

    model = load_frozen_target(cfg.target_dir, cfg.target_dtype, cfg.device, cfg.experts_implementation)
    vocab_size = int(model.config.vocab_size)
    needs_text = cfg.include_builtin_data or bool(_text_files(cfg.train_files + cfg.eval_files))
    tokenizer_key = "tokenizer_dir" if cfg.tokenizer_dir else "target_dir"
    tokenizer = load_tokenizer(cfg.tokenizer_dir or cfg.target_dir, tokenizer_key) if needs_text else None
    data = load_train_tokens(cfg, tokenizer, vocab_size)
    sampler = WindowSampler(data, cfg.seq_len, cfg.batch_size, cfg.seed)
    heldout = load_eval_windows(cfg, tokenizer, vocab_size)

    counted = data.tokens if cfg.vocab_count_tokens is None else data.tokens[: cfg.vocab_count_tokens]
    counts = token_counts(counted, vocab_size)
    vocab = build_draft_vocab(counts, cfg.draft_vocab_size, _special_ids(model, tokenizer))
    write_json(out / "draft_vocab.json", {"draft_vocab_size": vocab.size, "target_vocab_size": vocab_size,
                                          "full": vocab.full, "train_token_coverage": round(vocab.coverage(counts), 6),
                                          "counted_tokens": int(len(counted))})
    layers = _resolve_layers(model.config.num_hidden_layers, cfg.aux_layers)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    head = build_head(model, cfg, vocab, layers).to(cfg.device)
    head.train()
    optimizer = _optimizer(head, cfg)
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if state is not None:
        head.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens_seen"], state["elapsed"]
        set_rng_state(state["rng"])
        truncate_log(log, step)  # records after the checkpoint belong to a run that was lost
        log.write(event="resume", step=step, tokens=tokens_seen)
    else:
        if cfg.init_from:
            _init_from(head, cfg.init_from, layers, model.config.num_hidden_layers)
        log.write(event="start", init_from=cfg.init_from, head_parameters=sum(p.numel() for p in head.parameters()),
                  draft_vocab_size=vocab.size, feature_layers=layers, train_tokens=int(len(data.tokens)),
                  tokens_planned=cfg.max_steps * cfg.batch_size * cfg.seq_len)
    del state
    draft_ids = _draft_ids(head, model)

    stop = min(cfg.max_steps, cfg.stop_after_steps) if cfg.stop_after_steps is not None else cfg.max_steps
    bar = progress_bar(cfg.max_steps, initial=step, desc="train-drafter", every=cfg.log_every,
                       disable=None if cfg.progress is None else not cfg.progress)
    tokens_per_batch = cfg.batch_size * cfg.seq_len
    t_start = time.perf_counter()
    window = _Window(cfg.ttt_steps)
    try:
        while step < stop:
            lr = warmup_cosine_lr(step, total_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps,
                                  lr=cfg.lr, min_lr_ratio=cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x = torch.from_numpy(sampler.batch(step)).to(cfg.device)
            t0 = time.perf_counter()
            batch = target_batch(model, x, layers, draft_ids)
            t1 = time.perf_counter()
            res = ttt_loss(head, batch, x, cfg.ttt_steps, cfg.step_weight_decay)
            res.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if not math.isfinite(float(res.loss.detach())):
                raise FloatingPointError(f"loss is {float(res.loss)} at step {step}")
            step += 1
            tokens_seen += tokens_per_batch
            window.add(res, tokens_per_batch, t1 - t0, t2 - t1)

            if step % cfg.log_every == 0 or step == cfg.max_steps:
                record = window.flush()
                log.write(step=step, lr=lr, grad_norm=float(grad_norm), tokens=tokens_seen,
                          elapsed_s=round(elapsed_before + time.perf_counter() - t_start, 1), **record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            if heldout is not None and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                t_eval = time.perf_counter()
                ev = evaluate_head(head, model, heldout, layers, cfg.ttt_steps, cfg.step_weight_decay,
                                   cfg.batch_size, cfg.device)
                log.write(step=step, tokens=tokens_seen, eval_s=round(time.perf_counter() - t_eval, 1), **ev)
            if step % cfg.checkpoint_every == 0 or step == stop:
                save_checkpoint(ckpt_dir, model=head, optimizer=optimizer, step=step, tokens_seen=tokens_seen,
                                elapsed=elapsed_before + time.perf_counter() - t_start, cfg=cfg,
                                position=sampler.position(step))
    finally:
        bar.close()

    if step < cfg.max_steps:  # stopped early on purpose: the checkpoint is the result so far
        return out
    head.eval()
    save_head(head, out, dtype=getattr(torch, cfg.save_dtype))
    total = elapsed_before + time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "steps": step, "tokens": tokens_seen, "elapsed_s": round(total, 1),
        "tokens_per_s": round(tokens_seen / max(total, 1e-9), 1), "threads": cfg.threads,
        "draft_vocab_size": vocab.size, "feature_layers": layers,
        "head_parameters": sum(p.numel() for p in head.parameters()),
    }
    if heldout is not None:
        summary.update(evaluate_head(head, model, heldout, layers, cfg.ttt_steps, cfg.step_weight_decay,
                                     cfg.batch_size, cfg.device))
    if cfg.eval_prompts > 0 and cfg.include_builtin_data:
        from specfit.training.target import heldout_prompts

        n_gsm = cfg.eval_prompts // 2
        prompts = [text for _, text in heldout_prompts(cfg.data_dir, n_prose=cfg.eval_prompts - n_gsm, n_gsm=n_gsm)]
        acc = acceptance_length(cfg.target_dir, out, prompts, cfg.eval_max_new_tokens,
                                tokenizer_dir=cfg.tokenizer_dir, threads=cfg.threads, device=cfg.device)
        summary["acceptance_length"] = acc["spec_decode_acceptance_length"]
    write_json(out / "training_summary.json", summary)
    log.write(event="done", **summary)
    return out


def _init_from(head: Any, path: str, layers: Sequence[int], num_layers: int) -> None:
    """Start ``head`` from the weights of the head saved at ``path`` (same shape and vocabulary, and
    the same target layers: fc's shape is the same for any three, so a mismatch would go unnoticed)."""
    import torch

    from specfit.plugins.drafters.eagle3.checkpoint import load_head
    from specfit.plugins.drafters.eagle3.drafter import head_feature_layers

    loaded = load_head(path)
    fused = list(head_feature_layers(loaded.cfg, num_layers))
    if fused != list(layers):
        raise ConfigError(f"init_from={path}: that head fuses the target's hidden_states {fused}, this run "
                          f"{list(layers)}: set aux_layers=[{','.join(map(str, fused))}]")
    saved = loaded.state_dict()
    own = head.state_dict()
    bad = sorted(k for k in own if k in saved and own[k].shape != saved[k].shape)
    missing = sorted(k for k in own if k not in saved and not k.startswith("rotary."))
    if bad or missing:
        raise ConfigError(f"init_from={path}: the head does not match this run's shape "
                         f"(wrong shape: {bad[:4]}, missing: {missing[:4]}); use the same aux_layers, "
                         "draft_vocab_size and head sizes")
    with torch.no_grad():
        for name, tensor in own.items():
            if name in saved:
                tensor.copy_(saved[name].to(tensor.dtype))
    # it was trained on its own windows too; a head that does not say (another trainer's): unknown, so none
    saved_window = loaded.cfg.attention_window
    head.cfg.attention_window = max(head.cfg.attention_window or 0, saved_window) if saved_window else None


class _Window:
    """Running sums between two log lines."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._reset()

    def _reset(self) -> None:
        self.n = 0
        self.loss = 0.0
        self.step_loss = np.zeros(self.steps)
        self.correct = np.zeros(self.steps)
        self.count = np.zeros(self.steps)
        self.tokens = 0
        self.target_s = self.head_s = 0.0

    def add(self, res: TTTResult, tokens: int, target_s: float, head_s: float) -> None:
        k = len(res.step_loss)
        self.n += 1
        self.loss += float(res.loss.detach())
        self.step_loss[:k] += res.step_loss
        self.correct[:k] += res.step_correct
        self.count[:k] += res.step_count
        self.tokens += tokens
        self.target_s += target_s
        self.head_s += head_s

    def flush(self) -> dict[str, Any]:
        seconds = self.target_s + self.head_s
        record = {
            "loss": self.loss / max(1, self.n),
            "step_loss": (self.step_loss / max(1, self.n)).round(4).tolist(),
            "acc": (self.correct / np.maximum(self.count, 1)).round(4).tolist(),
            "tokens_per_s": round(self.tokens / max(seconds, 1e-9), 1),
            "target_share": round(self.target_s / max(seconds, 1e-9), 3),
        }
        self._reset()
        return record


# ---------------------------------------------------------------------------------------------
# acceptance length with the real drafter


def acceptance_length(target_dir: str | os.PathLike[str], head_dir: str | os.PathLike[str] | None,
                      prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64, top_k: int = 10,
                      depth: int = 7, total_tokens: int = 60, *, tokenizer_dir: str | None = None,
                      threads: int = 1, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                      ignore_eos: bool = False, attention_window: int | None = None) -> dict[str, Any]:
    """Mean acceptance length (bonus token included) of greedy EAGLE-3 decoding with this head.

    Runs :class:`specfit.Engine` with :class:`Eagle3Drafter` and the ``eagle3`` selector (verify
    the ``total_tokens`` most probable drafted nodes). ``head_dir=None`` uses a seeded random head
    (a baseline). ``attention_window`` is ``drafter.attention_window`` (None: the head's own).
    ``spec_decode_acceptance_length`` is over all cycles of all prompts; the
    per-prompt figures are in ``per_prompt``. Prompts are text (needs a tokenizer in
    ``tokenizer_dir`` or ``target_dir``) or token ids.
    """
    import torch

    from specfit.api import Engine
    from specfit.model.checkpoint import load_checkpoint
    from specfit.model.sources import load_tokenizer
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
    from specfit.plugins.selectors.eagle3 import TopByPathProbSelector

    _set_threads(threads)
    model = load_checkpoint(str(target_dir), dtype)
    tokenizer = load_tokenizer(str(tokenizer_dir or target_dir))
    drafter = Eagle3Drafter(path=str(head_dir) if head_dir is not None else None, top_k=top_k, depth=depth,
                            total_tokens=total_tokens, seed=seed, attention_window=attention_window)
    engine = Engine(model, tokenizer=tokenizer, drafter=drafter, selector=TopByPathProbSelector(), device=device,
                    ignore_eos=ignore_eos)
    per_prompt, accepted, cycles, tokens = [], 0, 0, 0
    with torch.inference_mode():
        for prompt in prompts:
            res = engine.generate(prompt, max_new_tokens=max_new_tokens)
            per_prompt.append(res.stats["spec_decode_acceptance_length"])
            accepted += sum(c.accepted + 1 for c in res.cycles)
            cycles += len(res.cycles)
            tokens += len(res.token_ids)
    return {"spec_decode_acceptance_length": accepted / max(1, cycles), "per_prompt": per_prompt,
            "cycles": cycles, "output_tokens": tokens, "prompts": len(prompts),
            "top_k": top_k, "depth": depth, "total_tokens": total_tokens}
