"""Train a Qwen3-MoE target model from scratch, and evaluate it on held-out text.

The demo target must be a *real* language model: acceptance lengths measured on a model that
loops or predicts noise say nothing about speculative decoding. So the trainer optimises the LM
loss plus the router load-balancing loss (expert-union sizes are what the project measures, and
a collapsed router would make every union tiny), and :func:`evaluate_target` checks the quality
bar: held-out perplexity against a unigram baseline with the same tokenizer, and the fraction of
repeated 4-grams in greedy continuations.

Data order is a pure function of (seed, step): each epoch shuffles the documents, packs them
with ``<|endoftext|>`` separators into fixed-length windows and shuffles the windows. A
checkpoint therefore only needs the step to find its place in the data, and a resumed run sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specfit.errors import ConfigError
from specfit.training.common import (
    JsonlLog, check_trainer_config, load_state, progress_bar, read_text_files, rng_state, set_rng_state, truncate_log, warmup_cosine_lr,
    write_json,
)
from specfit.model.sources import load_tokenizer  # the one tokenizer loader (tests import it from here too)
from specfit.data.paths import default_data_dir

TOKENIZER_HINT = " (train one with `specfit train-tokenizer` first)"

#: Fields of :class:`TrainTargetConfig` that define the model; a resumed run must match them.
MODEL_FIELDS = (
    "hidden_size", "num_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rope_theta", "rms_norm_eps", "initializer_range",
)
#: Fields that define the data stream and the schedule; a resumed run must match them too.
STREAM_FIELDS = ("seq_len", "batch_size", "seed", "max_steps", "warmup_steps", "lr",
                 "min_lr_ratio", "gsm_per_template", "gsm_seed", "train_files",
                 "include_builtin_data", "init_from")


@dataclass
class TrainTargetConfig:
    """Settings of :func:`train_target`. Defaults are the demo target's shape and schedule."""

    out_dir: str = "runs/demo-target"
    tokenizer_dir: str = "runs/demo-tokenizer"
    data_dir: str | None = None  # default: <repo>/../shared/data

    # model (Qwen3-MoE)
    hidden_size: int = 192
    num_layers: int = 6
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 96
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.01

    # data
    seq_len: int = 256
    batch_size: int = 16
    gsm_per_template: int = 140  # problems per training template (GSM ~36% of the tokens)
    gsm_seed: int = 0
    train_files: list[str] = field(default_factory=list)  # extra .txt / .jsonl ({"text": ...}) files
    include_builtin_data: bool = True  # Shakespeare + KJV train split + GSM train templates

    # optimisation
    max_steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0

    # execution
    threads: int = 2
    device: str = "cpu"
    autocast_bf16: bool = False  # bf16 autocast (slower than fp32 on the 2-core CPU measured here)
    experts_implementation: str = "grouped_mm"
    compile: bool = False

    # bookkeeping
    log_every: int = 10
    eval_every: int = 250
    eval_windows: int = 64  # held-out windows (seq_len tokens each) for the eval loss in the log
    checkpoint_every: int = 100
    resume: bool = False
    # a saved target directory (``save_pretrained`` layout, e.g. specfit/assets/demo/target) whose
    # weights start the run: continue training a shipped target with a new schedule (same shape)
    init_from: str | None = None
    progress: bool | None = None  # None: a bar on a terminal, else a line per log_every steps; false: neither
    save_dtype: str = "float32"  # dtype of the final safetensors ("float32" or "bfloat16")

    def __post_init__(self) -> None:
        check_trainer_config(self)
        _check_model_shape(self)


def _check_model_shape(cfg: TrainTargetConfig) -> None:
    """Shape constraints of the Qwen3-MoE config, one line naming the key (else a tensor error mid-training)."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                          f"num_key_value_heads={cfg.num_key_value_heads} (grouped-query attention)")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim={cfg.head_dim} must be even (rotary embeddings rotate pairs of dimensions)")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")


# ---------------------------------------------------------------------------------------------
# data


@dataclass
class TokenData:
    """Tokenized documents: ``tokens[offsets[i]:offsets[i+1]]`` is document i, EOS included."""

    tokens: np.ndarray
    offsets: np.ndarray
    kinds: list[str]  # per document: "prose", "gsm" or "file"

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def token_share(self) -> dict[str, float]:
        lengths = np.diff(self.offsets)
        total = float(lengths.sum()) or 1.0
        out: dict[str, float] = {}
        for kind in sorted(set(self.kinds)):
            mask = np.array([k == kind for k in self.kinds])
            out[kind] = float(lengths[mask].sum()) / total
        return out



def tokenize_documents(tokenizer: Any, docs: Sequence[tuple[str, str]], kind: str,
                       batch: int = 256) -> tuple[list[np.ndarray], list[str]]:
    """Token ids of each document followed by EOS."""
    eos = tokenizer.eos_token_id
    out: list[np.ndarray] = []
    texts = [t for _, t in docs]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast path, no length warnings
    for start in range(0, len(texts), batch):
        chunk = texts[start:start + batch]
        if backend is not None:
            enc = [e.ids for e in backend.encode_batch(chunk, add_special_tokens=False)]
        else:
            enc = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        out.extend(np.asarray(list(ids) + [eos], dtype=np.int32) for ids in enc)
    return out, [kind] * len(out)


def _pack(arrays: list[np.ndarray], kinds: list[str], vocab_size: int) -> TokenData:
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    dtype = np.uint16 if vocab_size <= 65535 else np.int32
    tokens = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
    return TokenData(tokens, offsets, kinds)


def _fingerprint(cfg: TrainTargetConfig, tokenizer_dir: Path, data_dir: Path | None) -> str:
    h = hashlib.sha256()
    tok_file = tokenizer_dir / "tokenizer.json"
    h.update(tok_file.read_bytes() if tok_file.exists() else b"")
    h.update(json.dumps({
        "gsm_per_template": cfg.gsm_per_template, "gsm_seed": cfg.gsm_seed,
        "train_files": list(cfg.train_files), "builtin": cfg.include_builtin_data,
        "data_dir": str(data_dir), "version": 2,
    }, sort_keys=True).encode())
    return h.hexdigest()[:16]


def prepare_train_data(cfg: TrainTargetConfig, tokenizer: Any, cache_dir: Path) -> TokenData:
    """Tokenize the training split once and cache it as ``.npy`` files in ``cache_dir``.

    The cache is keyed by a fingerprint of the tokenizer and the data settings, so changing
    either re-tokenizes instead of silently reusing stale tokens.
    """
    from specfit.training.tokenizer import training_documents

    data_dir = Path(cfg.data_dir) if cfg.data_dir else (default_data_dir() if cfg.include_builtin_data else None)
    fp = _fingerprint(cfg, Path(cfg.tokenizer_dir), data_dir)
    meta_path = cache_dir / "train_meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fp:
            return TokenData(np.load(cache_dir / "train_tokens.npy"),
                             np.load(cache_dir / "train_offsets.npy"), meta["kinds"])
    arrays: list[np.ndarray] = []
    kinds: list[str] = []
    gsm_report: dict[str, Any] = {}
    if cfg.include_builtin_data:
        from specfit.data.gsm import GenerationReport

        report = GenerationReport()
        corpus, gsm = training_documents(cfg.data_dir, cfg.gsm_per_template, cfg.gsm_seed, report)
        for docs, kind in ((corpus, "prose"), (gsm, "gsm")):
            a, k = tokenize_documents(tokenizer, docs, kind)
            arrays += a
            kinds += k
        gsm_report = {"skipped": report.skipped, "generated": report.generated}
    if cfg.train_files:
        a, k = tokenize_documents(tokenizer, read_text_files(cfg.train_files), "file")
        arrays += a
        kinds += k
    if not arrays:
        raise ConfigError("no training data: include_builtin_data is off and train_files is empty")
    data = _pack(arrays, kinds, len(tokenizer))
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache_dir / "train_tokens.npy", data.tokens)
    np.save(cache_dir / "train_offsets.npy", data.offsets)
    write_json(meta_path, {"fingerprint": fp, "kinds": kinds, "documents": len(kinds),
                           "tokens": int(len(data.tokens)), "token_share": data.token_share(),
                           "gsm": gsm_report})
    return data


def heldout_documents(data_dir: str | os.PathLike[str] | None, gsm_per_template: int = 20,
                      seed: int = 1234) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Held-out evaluation text: (held-out corpus documents, held-out GSM problems as text)."""
    from specfit.data.corpus import load_corpus
    from specfit.data.gsm import HELDOUT_TEMPLATES, format_problem, generate_problems

    prose = load_corpus(data_dir).heldout
    problems = generate_problems(data_dir, HELDOUT_TEMPLATES, gsm_per_template, seed)
    gsm = [(f"gsm/{p.template_id:04d}", format_problem(p)) for p in problems]
    return prose, gsm


class WindowSampler:
    """Deterministic packed windows: batch ``step`` is a pure function of (seed, step).

    Documents are shuffled per epoch, joined and cut into ``seq_len`` windows, except token rows
    (kind ``tokens``, e.g. ``specfit distill-data``'s prompt-and-continuation rows) whose length is a
    multiple of ``seq_len``: they are cut on their own, so a window holds a continuation with the
    prompt that produced it instead of the tail of one row and the start of another.
    """

    def __init__(self, data: TokenData, seq_len: int, batch_size: int, seed: int) -> None:
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed
        lengths = np.diff(data.offsets)
        self._whole = np.array([kind == "tokens" for kind in data.kinds], dtype=bool) & (lengths % seq_len == 0)
        self.windows_per_epoch = int(lengths[self._whole].sum() // seq_len + lengths[~self._whole].sum() // seq_len)
        if self.windows_per_epoch < batch_size:
            raise ConfigError(f"training data ({len(data.tokens)} tokens) is smaller than one batch "
                             f"({batch_size} x {seq_len})")
        self._epoch = -1
        self._stream: np.ndarray | None = None
        self._order: np.ndarray | None = None

    def _load_epoch(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        rng = np.random.default_rng([self.seed, epoch])
        doc_order = rng.permutation(len(self.data))
        packed = [self.data.doc(i) for i in doc_order if not self._whole[i]]
        stream = np.concatenate(packed) if packed else np.zeros(0, dtype=self.data.tokens.dtype)
        packed_windows = stream[: len(stream) // self.seq_len * self.seq_len].reshape(-1, self.seq_len)
        whole = [self.data.doc(i).reshape(-1, self.seq_len) for i in doc_order if self._whole[i]]
        self._stream = np.concatenate([*whole, packed_windows]) if whole else packed_windows
        self._order = rng.permutation(self.windows_per_epoch)
        self._epoch = epoch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, window index within the epoch) of the first window of batch ``step``."""
        g = step * self.batch_size
        return g // self.windows_per_epoch, g % self.windows_per_epoch

    def batch(self, step: int) -> np.ndarray:
        rows = []
        for g in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, idx = divmod(g, self.windows_per_epoch)
            self._load_epoch(epoch)
            assert self._stream is not None and self._order is not None
            rows.append(self._stream[self._order[idx]])
        return np.stack(rows).astype(np.int64)


def eval_windows(tokenizer: Any, docs: Sequence[tuple[str, str]], seq_len: int,
                 max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows over the documents, each document preceded by EOS (so its first
    token is predicted in context of a document start, as in training). Windows are taken
    evenly across the stream when ``max_windows`` caps them."""
    arrays, _ = tokenize_documents(tokenizer, docs, "eval")
    eos = tokenizer.eos_token_id
    stream = np.concatenate([np.concatenate([[eos], a[:-1]]) for a in arrays] + [[eos]])
    n = (len(stream) - 1) // seq_len
    windows = stream[: n * seq_len + 1]
    # windows of seq_len+1 tokens overlapping by one so every token after the first is a target
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    out = windows[idx]
    if max_windows is not None and n > max_windows:
        pick = np.linspace(0, n - 1, max_windows).round().astype(int)
        out = out[np.unique(pick)]
    return out.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# model


def build_model_config(cfg: TrainTargetConfig, tokenizer: Any):
    """The ``Qwen3MoeConfig`` of the target (``norm_topk_prob`` set explicitly: HF defaults to False)."""
    from transformers import Qwen3MoeConfig

    eos = tokenizer.eos_token_id
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,  # unused: every layer is sparse
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps, initializer_range=cfg.initializer_range,
        tie_word_embeddings=True, router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False, use_cache=True, attention_bias=False, attention_dropout=0.0,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (only allowed once per process)


def _optimizer(model: Any, cfg: TrainTargetConfig):
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
    )


def save_checkpoint(path: Path, *, model: Any, optimizer: Any, step: int, tokens_seen: int,
                    elapsed: float, cfg: TrainTargetConfig, position: tuple[int, int]) -> None:
    """Write ``path/state.pt`` atomically (temp file, then rename): a kill mid-write keeps the old one."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        "tokens_seen": tokens_seen, "elapsed": elapsed, "rng": rng_state(),
        "config": asdict(cfg), "data_position": {"epoch": position[0], "window": position[1]},
        "lr_schedule": {"kind": "warmup_cosine", "warmup_steps": cfg.warmup_steps,
                        "total_steps": cfg.max_steps, "lr": cfg.lr, "min_lr_ratio": cfg.min_lr_ratio},
    }
    tmp = path / "state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path / "state.pt")



def _check_resume_config(saved: dict[str, Any], cfg: TrainTargetConfig) -> None:
    bad = [f"{k}: checkpoint {saved.get(k)!r} != now {getattr(cfg, k)!r}"
           for k in MODEL_FIELDS + STREAM_FIELDS if saved.get(k) != getattr(cfg, k)]
    if bad:
        raise ConfigError("cannot resume: the checkpoint was made with different settings ("
                         + "; ".join(bad) + ")")


def _forward_loss(model: Any, input_ids: Any, cfg: TrainTargetConfig) -> tuple[Any, Any, Any]:
    """(total loss, LM loss, aux loss) of one batch."""
    import contextlib

    import torch

    ctx = (torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16)
           if cfg.autocast_bf16 else contextlib.nullcontext())
    with ctx:
        out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
    lm = out.loss - cfg.router_aux_loss_coef * aux
    return out.loss, lm, aux


def _eval_loss(model: Any, windows: np.ndarray, batch_size: int, device: str) -> float:
    """Mean next-token cross-entropy over ``windows`` (rows of seq_len+1 tokens)."""
    import torch

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[start:start + batch_size]).to(device)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    if was_training:
        model.train()
    return total / max(1, count)


# ---------------------------------------------------------------------------------------------
# training


def train_target(cfg: TrainTargetConfig) -> Path:
    """Train (or resume) the target and save it with ``save_pretrained`` in ``cfg.out_dir``.

    Layout of ``out_dir``: ``config.json`` + ``model.safetensors`` + tokenizer files (the final
    model, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``), ``train_config.json``,
    ``train_log.jsonl`` (train loss, eval loss, tokens/s), ``checkpoint/state.pt``,
    ``data/`` (token cache), ``unigram_counts.npy`` (for the perplexity baseline) and
    ``training_summary.json``.
    """
    import torch

    from specfit.model.sources import TOKENIZER_HUB_FILES, check_source
    from specfit.validation import device_arg

    # before anything is written: a mistyped path creates no out_dir and deletes no earlier log
    device_arg(cfg.device, key="device")
    check_source(cfg.tokenizer_dir, "tokenizer_dir", TOKENIZER_HINT, files=TOKENIZER_HUB_FILES)
    if cfg.init_from:
        _check_saved_target(cfg.init_from)
    _set_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    log = JsonlLog(out / "train_log.jsonl")

    state: dict[str, Any] | None = None
    if cfg.resume and (ckpt_dir / "state.pt").exists():
        state = load_state(ckpt_dir / "state.pt")
        _check_resume_config(state["config"], cfg)
        truncate_log(log, state["step"])
    elif not cfg.resume and (out / "train_log.jsonl").exists():
        (out / "train_log.jsonl").unlink()  # a fresh run starts a fresh log
    tokenizer = load_tokenizer(cfg.tokenizer_dir, "tokenizer_dir", required=True, hint=TOKENIZER_HINT)
    write_json(out / "train_config.json", asdict(cfg))

    data = prepare_train_data(cfg, tokenizer, out / "data")
    counts = np.bincount(data.tokens, minlength=len(tokenizer)).astype(np.int64)
    np.save(out / "unigram_counts.npy", counts)
    sampler = WindowSampler(data, cfg.seq_len, cfg.batch_size, cfg.seed)

    heldout: np.ndarray | None = None
    if cfg.include_builtin_data and cfg.eval_windows > 0:
        prose, gsm = heldout_documents(cfg.data_dir)
        half = max(1, cfg.eval_windows // 2)
        heldout = np.concatenate([eval_windows(tokenizer, prose, cfg.seq_len, half),
                                  eval_windows(tokenizer, gsm, cfg.seq_len, half)])

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    from transformers import Qwen3MoeForCausalLM

    model_config = build_model_config(cfg, tokenizer)
    model = Qwen3MoeForCausalLM._from_config(model_config, dtype=torch.float32)
    model.set_experts_implementation(cfg.experts_implementation)
    model.to(cfg.device)
    model.train()
    optimizer = _optimizer(model, cfg)
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens_seen"], state["elapsed"]
        set_rng_state(state["rng"])
        log.write(event="resume", step=step, tokens=tokens_seen)
    else:
        if cfg.init_from:
            init_from_saved(model, cfg.init_from)
        log.write(event="start", init_from=cfg.init_from, parameters=count_parameters(model),
                  train_tokens=int(len(data.tokens)),
                  token_share=data.token_share(), windows_per_epoch=sampler.windows_per_epoch,
                  tokens_planned=cfg.max_steps * cfg.batch_size * cfg.seq_len)
    del state

    forward = _forward_loss
    train_model = torch.compile(model) if cfg.compile else model

    bar = progress_bar(cfg.max_steps, initial=step, desc="train-target", every=cfg.log_every, disable=(
        None if cfg.progress is None else not cfg.progress))
    t_start = time.perf_counter()
    t_window, tok_window = time.perf_counter(), 0
    tokens_per_batch = cfg.batch_size * cfg.seq_len
    loss_acc = lm_acc = aux_acc = 0.0
    n_acc = 0
    try:
        while step < cfg.max_steps:
            lr = warmup_cosine_lr(step, total_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps,
                                  lr=cfg.lr, min_lr_ratio=cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x = torch.from_numpy(sampler.batch(step)).to(cfg.device)
            loss, lm, aux = forward(train_model, x, cfg)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_batch
            tok_window += tokens_per_batch
            loss_f, lm_f, aux_f = float(loss.detach()), float(lm.detach()), float(aux.detach())
            loss_acc += loss_f
            lm_acc += lm_f
            aux_acc += aux_f
            n_acc += 1
            if not math.isfinite(loss_f):
                raise FloatingPointError(f"loss is {loss_f} at step {step}")

            if step % cfg.log_every == 0 or step == cfg.max_steps:
                now = time.perf_counter()
                tps = tok_window / max(1e-9, now - t_window)
                log.write(step=step, loss=loss_acc / n_acc, lm_loss=lm_acc / n_acc,
                          aux_loss=aux_acc / n_acc, lr=lr, grad_norm=float(grad_norm),
                          tokens=tokens_seen, tokens_per_s=round(tps, 1),
                          elapsed_s=round(elapsed_before + now - t_start, 1))
                bar.set_postfix(loss=f"{lm_acc / n_acc:.3f}", tok_s=f"{tps:.0f}")
                t_window, tok_window = now, 0
                loss_acc = lm_acc = aux_acc = 0.0
                n_acc = 0
            bar.update(1)
            if heldout is not None and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                t0 = time.perf_counter()
                ev = _eval_loss(model, heldout, cfg.batch_size, cfg.device)
                log.write(step=step, eval_loss=ev, eval_ppl=math.exp(min(ev, 50)),
                          tokens=tokens_seen, eval_s=round(time.perf_counter() - t0, 1))
                t_window += time.perf_counter() - t0  # keep eval time out of tokens/s
            if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
                save_checkpoint(ckpt_dir, model=model, optimizer=optimizer, step=step,
                                tokens_seen=tokens_seen,
                                elapsed=elapsed_before + time.perf_counter() - t_start,
                                cfg=cfg, position=sampler.position(step))
    finally:
        bar.close()

    save_final_model(model, tokenizer, out, cfg.save_dtype)
    total_elapsed = elapsed_before + time.perf_counter() - t_start
    summary = {
        "parameters": count_parameters(model), "steps": step, "tokens": tokens_seen,
        "train_tokens_per_epoch": int(len(data.tokens)), "epochs": tokens_seen / max(1, len(data.tokens)),
        "token_share": data.token_share(), "elapsed_s": round(total_elapsed, 1),
        "tokens_per_s": round(tokens_seen / max(1e-9, total_elapsed), 1),
        "threads": cfg.threads, "experts_implementation": cfg.experts_implementation,
        "autocast_bf16": cfg.autocast_bf16, "compile": cfg.compile,
    }
    write_json(out / "training_summary.json", summary)
    log.write(event="done", **{k: v for k, v in summary.items() if k != "token_share"})
    return out


def _check_saved_target(path: str, key: str = "init_from") -> dict[str, Any]:
    """``key`` (``init_from``, train-drafter's ``target_dir``, eval-target's ``model_dir``) must be a
    directory written by train-target (it holds config.json); returns that config, which the callers
    check their settings against before any weights load."""
    from specfit.files import read_json_object

    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}={path}: no config.json there, so no saved model; name a directory written by "
                          "train-target (or specfit/assets/demo/target)")
    return read_json_object(config, f"{key}={path}: config.json")


def init_from_saved(model: Any, path: str) -> None:
    """Start ``model`` from the target saved at ``path`` (same shape; any saved dtype is cast).

    transformers loads it, so the saved layout (per-expert or fused tensors) does not matter."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    _check_saved_target(path)
    loaded, info = Qwen3MoeForCausalLM.from_pretrained(str(Path(path).expanduser()), dtype=torch.float32, output_loading_info=True)
    saved = loaded.state_dict()
    own = model.state_dict()
    bad = sorted(k for k in own if k in saved and own[k].shape != saved[k].shape)
    # missing: not in the saved model, or not in its files (from_pretrained drew those at random);
    # extra: in the saved model only (a deeper target would otherwise be cut to this run's layers)
    missing = sorted({k for k in own if k not in saved} | set(info.get("missing_keys", ())))
    extra = sorted(k for k in saved if k not in own)
    if bad or missing or extra:
        raise ConfigError(f"init_from={path}: the saved target does not match this run's shape "
                          f"(wrong shape: {bad[:4]}, missing: {missing[:4]}, extra: {extra[:4]}); "
                          "use the same model settings")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(saved[name].to(tensor.dtype))


def save_final_model(model: Any, tokenizer: Any, out: Path, dtype: str = "float32") -> None:
    """``save_pretrained`` (safetensors) of the model in ``dtype`` plus the tokenizer beside it."""
    import copy

    import torch

    target_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    to_save = model if target_dtype == torch.float32 else copy.deepcopy(model).to(target_dtype)
    to_save.config.output_router_logits = False
    to_save.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


# ---------------------------------------------------------------------------------------------
# evaluation


def repeated_ngram_fraction(tokens: Sequence[int], n: int = 4) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same sequence (0: no repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def greedy_generate(model: Any, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with a KV cache; does not stop at EOS (the loop check needs all tokens)."""
    import torch

    with torch.no_grad():
        x = torch.tensor([list(input_ids)], dtype=torch.long, device=model.device)
        out = model(input_ids=x, use_cache=True)
        generated: list[int] = []
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(max_new_tokens):
            generated.append(nxt)
            if len(generated) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[nxt]], device=model.device), cache=out.cache,
                        use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
    return generated


def heldout_prompts(data_dir: str | os.PathLike[str] | None, n_prose: int = 5, n_gsm: int = 5,
                    seed: int = 4321, prose_chars: int = 240) -> list[tuple[str, str]]:
    """Deterministic held-out prompts: (kind, text), prose first (see :mod:`specfit.data.prompts`)."""
    from specfit.data.prompts import gsm_prompts, prose_prompts

    return ([("prose", p) for p in prose_prompts(data_dir, n_prose, prose_chars, seed)]
            + [("gsm", p) for p in gsm_prompts(data_dir, n_gsm, seed)])


def _unigram_counts(model_dir: Path, tokenizer: Any, data_dir: str | os.PathLike[str] | None,
                    gsm_per_template: int) -> np.ndarray:
    cached = model_dir / "unigram_counts.npy"
    if cached.exists():
        counts = np.load(cached)
        if len(counts) == len(tokenizer):
            return counts
    from specfit.training.tokenizer import training_documents

    corpus, gsm = training_documents(data_dir, gsm_per_template)
    arrays, _ = tokenize_documents(tokenizer, corpus + gsm, "train")
    return np.bincount(np.concatenate(arrays), minlength=len(tokenizer)).astype(np.int64)


def evaluate_target(model_dir: str | os.PathLike[str], data_dir: str | os.PathLike[str] | None = None,
                    *, seq_len: int = 512, max_windows: int = 200, gsm_per_template: int = 20,
                    n_prompts: int = 10, gen_tokens: int = 128, threads: int = 2,
                    batch_size: int = 8, train_gsm_per_template: int = 140) -> dict[str, Any]:
    """Held-out quality of a trained target.

    Returns perplexities on held-out corpus documents (``prose_ppl``), held-out GSM templates
    (``gsm_ppl``) and both (``heldout_ppl``), the same for a unigram model estimated on the
    training tokens with add-one smoothing (``unigram_*``), their ratio, and the mean fraction of
    repeated 4-grams in ``gen_tokens`` greedy tokens from ``n_prompts`` held-out prompts.
    ``meets_bar`` applies the issue's bar: perplexity <= unigram / 5 and repeats < 0.5.
    """
    import torch
    from transformers import AutoModelForCausalLM

    check_model_context(str(model_dir), seq_len)
    _set_threads(threads)
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir, "model_dir", required=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    counts = _unigram_counts(model_dir, tokenizer, data_dir, train_gsm_per_template)
    logp_uni = np.log((counts + 1.0) / (counts.sum() + len(counts)))

    prose, gsm = heldout_documents(data_dir, gsm_per_template)
    result: dict[str, Any] = {"model_dir": str(model_dir), "seq_len": seq_len}
    tot_nll = tot_uni = 0.0
    tot_n = 0
    for name, docs in (("prose", prose), ("gsm", gsm)):
        windows = eval_windows(tokenizer, docs, seq_len, max_windows)
        nll = _eval_loss(model, windows, batch_size, "cpu")
        targets = windows[:, 1:].reshape(-1)
        uni = float(-logp_uni[targets].mean())
        result[f"{name}_ppl"] = math.exp(nll)
        result[f"unigram_{name}_ppl"] = math.exp(uni)
        result[f"{name}_tokens"] = int(targets.size)
        tot_nll += nll * targets.size
        tot_uni += uni * targets.size
        tot_n += targets.size
    result["heldout_ppl"] = math.exp(tot_nll / tot_n)
    result["unigram_ppl"] = math.exp(tot_uni / tot_n)
    result["ppl_ratio"] = result["heldout_ppl"] / result["unigram_ppl"]

    n_gsm = n_prompts // 2
    prompts = heldout_prompts(data_dir, n_prose=n_prompts - n_gsm, n_gsm=n_gsm)
    samples = []
    for kind, text in prompts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        gen = greedy_generate(model, [tokenizer.eos_token_id] + ids, gen_tokens)
        samples.append({"kind": kind, "prompt": text, "continuation": tokenizer.decode(gen),
                        "repeat4": repeated_ngram_fraction(gen, 4)})
    result["repeat4_mean"] = float(np.mean([s["repeat4"] for s in samples])) if samples else 0.0
    result["repeat4_max"] = float(np.max([s["repeat4"] for s in samples])) if samples else 0.0
    result["samples"] = samples
    result["meets_bar"] = bool(result["ppl_ratio"] <= 0.2 and result["repeat4_mean"] < 0.5)
    return result


def check_model_context(model_dir: str, seq_len: int, key: str = "model_dir") -> None:
    """``model_dir`` (the setting ``key``) is a saved model whose context holds ``seq_len`` tokens
    (before minutes of work)."""
    from specfit.model.sources import check_source

    check_source(model_dir, key)
    context = _check_saved_target(model_dir, key).get("max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and seq_len > context:
        raise ConfigError(f"seq_len={seq_len} exceeds the model's context: max_position_embeddings={context} "
                          f"in {model_dir}/config.json")


def config_from_dict(d: dict[str, Any]) -> TrainTargetConfig:
    """A :class:`TrainTargetConfig` from a dict (e.g. ``train_config.json``), ignoring unknown keys."""
    names = {f.name for f in fields(TrainTargetConfig)}
    return TrainTargetConfig(**{k: v for k, v in d.items() if k in names})


@dataclass
class EvalTargetConfig:
    """Settings of ``specfit eval-target`` (the model card's quality figures)."""

    model_dir: str = "runs/demo-target"
    data_dir: str | None = None
    seq_len: int = 512
    max_windows: int = 200
    gsm_per_template: int = 20
    n_prompts: int = 10
    gen_tokens: int = 128
    threads: int = 2
    # JSON with every figure and the generated samples; default: evaluation.json in the run's output
    # directory (Hydra's run dir, outputs/<date>/<time>/; the current directory outside the CLI), never
    # the model directory, which may be the installed package's specfit/assets/demo/target
    out: str | None = None

    def __post_init__(self) -> None:
        check_trainer_config(self)
        if self.n_prompts < 1:
            raise ConfigError(f"n_prompts={self.n_prompts} must be >= 1 (the repetition figure needs samples)")
        if self.gen_tokens < 4:
            raise ConfigError(f"gen_tokens={self.gen_tokens} must be >= 4 (a repeated 4-gram needs 4 tokens)")


def _default_eval_out() -> Path:
    """``evaluation.json`` in Hydra's run directory (where the CLI's other commands write), else here."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir) / "evaluation.json"
    return Path("evaluation.json")


def eval_target(cfg: EvalTargetConfig) -> Path:
    """Run :func:`evaluate_target`, print the figures the issue's bar is about, store them all in
    ``cfg.out`` (default: ``evaluation.json`` in the run's output directory, see :class:`EvalTargetConfig`)."""
    from specfit.files import check_writable

    out = check_writable(cfg.out, "out") if cfg.out else _default_eval_out()  # before the evaluation runs
    result = evaluate_target(cfg.model_dir, cfg.data_dir, seq_len=cfg.seq_len, max_windows=cfg.max_windows,
                             gsm_per_template=cfg.gsm_per_template, n_prompts=cfg.n_prompts,
                             gen_tokens=cfg.gen_tokens, threads=cfg.threads)
    for kind in ("prose", "gsm"):
        print(f"{kind}: perplexity {result[f'{kind}_ppl']:.1f}, unigram {result[f'unigram_{kind}_ppl']:.1f} "
              f"(ratio {result[f'{kind}_ppl'] / result[f'unigram_{kind}_ppl']:.3f})")
    print(f"held-out: perplexity {result['heldout_ppl']:.1f}, unigram {result['unigram_ppl']:.1f}, ratio "
          f"{result['ppl_ratio']:.3f}; repeated 4-grams in {cfg.gen_tokens} greedy tokens: mean "
          f"{result['repeat4_mean']:.3f}, max {result['repeat4_max']:.3f}; meets the bar: {result['meets_bar']}")
    write_json(out, result)
    return out
