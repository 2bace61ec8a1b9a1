"""Loading the target: a local Hugging Face checkpoint, or a small model built in code.

Weights load on the host in the checkpoint's own dtype unless ``model.dtype`` says otherwise; the
engine then moves everything but the experts to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specfit.config import ModelConfig
from specfit.errors import ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any | None
    source: str


def resolve_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ModelError(f"model.dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


ATTENTION = ("sdpa", "eager")  # the implementations tree verification supports (mask semantics known)


def check_device(device: str) -> None:
    """``model.device``: auto, cpu, cuda or cuda:N, and CUDA only where there is a GPU."""
    if device in ("auto", "cpu"):
        return
    if not device.startswith("cuda") or not (device == "cuda" or device[5:6] == ":" and device[6:].isdigit()):
        raise ModelError(f"model.device={device!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ModelError(f"model.device={device}: no CUDA device is available (torch {torch.__version__})")


def load_target(cfg: ModelConfig) -> LoadedModel:
    check_device(cfg.device)
    if cfg.attn_implementation not in ATTENTION:
        raise ModelError(f"model.attn_implementation={cfg.attn_implementation!r}: tree verification supports "
                         f"{' and '.join(ATTENTION)}")
    if cfg.builtin and cfg.path:
        raise ModelError("set model.path or model.builtin, not both")
    if cfg.builtin:
        from specfit.core.builtin_models import build_builtin

        dtype = resolve_dtype(cfg.dtype)
        model = build_builtin(cfg.builtin, seed=cfg.seed, dtype=torch.float32 if dtype == "auto" else dtype,
                              attn_implementation=cfg.attn_implementation)
        return LoadedModel(model, None, f"builtin:{cfg.builtin}")
    if not cfg.path:
        raise ModelError("no model: set model.path=DIR (a Hugging Face checkpoint) or model=<preset>")
    return LoadedModel(
        load_checkpoint(cfg.path, cfg.dtype, cfg.attn_implementation),
        load_tokenizer(cfg.tokenizer or cfg.path),
        cfg.path,
    )


def load_checkpoint(path: str, dtype: str = "auto", attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelError(f"model.path={path}: not a directory")
        if not (local / "config.json").is_file():
            raise ModelError(f"model.path={path}: no config.json there, so not a Hugging Face checkpoint")
        path = str(local)
    elif path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ModelError(f"model.path={path}: no such directory")
    from transformers.utils import logging as hf_logging

    # a progress bar per load only clutters comparisons of small models (the demo loads one per method)
    quiet = local.is_dir() and sum(f.stat().st_size for f in local.glob("*.safetensors")) < 2**30
    bar_was_on = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, device_map=None
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model.path={path}: cannot load the checkpoint: {first}") from exc
    finally:
        if quiet and bar_was_on:
            hf_logging.enable_progress_bar()
    return model.eval()


def load_tokenizer(path: str) -> Any | None:
    """The checkpoint's tokenizer, or None when it has none (prompts must then be token ids)."""
    local = Path(path).expanduser()
    if local.is_dir() and not any(
        (local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"tokenizer at {path} cannot be loaded: {str(exc).splitlines()[0]}") from exc
