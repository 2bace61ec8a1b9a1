"""Loading the target: a local Hugging Face checkpoint, or a small model built in code.

Weights load on the host in the checkpoint's own dtype unless ``model.dtype`` says otherwise; the
engine then moves everything but the experts to the device.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specfit.config import ModelConfig
from specfit.errors import ModelError
from specfit.files import read_json_object
from specfit.validation import device_arg

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
    """``model.device``: auto, or any torch device (cpu, cuda, cuda:N), CUDA only where there is a GPU."""
    if device != "auto":
        device_arg(device, key="model.device")


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
        load_tokenizer(cfg.tokenizer, "model.tokenizer", required=True) if cfg.tokenizer else load_tokenizer(cfg.path),
        cfg.path,
    )


def load_checkpoint(path: str, dtype: str = "auto", attn_implementation: str = "sdpa") -> nn.Module:
    """A local (or cached hub) checkpoint; every problem is one ModelError naming the file or tensor.

    The cheap checks (config.json, the weight files' headers, the architecture on the meta device)
    run before any weights are read, so a bad checkpoint fails in seconds whatever its size."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelError(f"model.path={path}: not a directory")
        if not (local / "config.json").is_file():
            raise ModelError(f"model.path={path}: no config.json there, so not a Hugging Face checkpoint")
        read_json(local / "config.json", f"model.path={path}")
        check_weight_files(local, f"model.path={path}")
        path = str(local)
    elif path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ModelError(f"model.path={path}: no such directory")
    check_architecture(path)

    # A checkpoint of a GiB or more (or one from the hub) takes a while: transformers' bar on a terminal,
    # one line before and after otherwise. Small ones load in a second: a bar per load would only
    # clutter comparisons (the demo loads one per method).
    size = sum(f.stat().st_size for f in local.glob("*.safetensors")) if local.is_dir() else None
    slow = size is None or size >= 2**30
    bar = slow and sys.stderr.isatty()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    if not bar:
        hf_logging.disable_progress_bar()
    if slow and not bar:
        weights = f" ({size / 1e9:.1f} GB)" if size is not None else ""
        print(f"specfit: loading the checkpoint model.path={path}{weights}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    hf_logging.set_verbosity_error()  # transformers' load report becomes our one-line error below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, device_map=None,
            ignore_mismatched_sizes=True, output_loading_info=True,
        )
    except Exception as exc:  # noqa: BLE001 - corrupt files raise many types (OSError, SafetensorError, ...)
        raise ModelError(f"model.path={path}: cannot load the checkpoint: {_first_line(exc)}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bar and bar_was_on:
            hf_logging.enable_progress_bar()
    if slow and not bar:
        print(f"specfit: loaded model.path={path} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    _check_loading_info(path, info)
    return model.eval()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``file``, or a ModelError naming ``what``, the file, the line and the problem."""
    return read_json_object(file, f"{what}: {file.name}", ModelError)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_weight_files(local: Path, what: str) -> None:
    """Weights exist, an index names only shards that exist, and no safetensors file is cut short.

    Reads only the headers (a few KiB per file): a truncated download otherwise fails deep inside
    loading with a message that names no file."""
    index = local / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index, what).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{what}: {SAFETENSORS_INDEX} has no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        for shard in shards:
            if not (local / shard).is_file():
                raise ModelError(f"{what}: {SAFETENSORS_INDEX} names shard {shard}, which is missing")
        files = [local / s for s in shards]
    else:
        files = sorted(local.glob("*.safetensors"))
    if not files and not any(local.glob("*.bin")) and not any(local.glob("*.pt")):
        raise ModelError(f"{what}: no weights there (model.safetensors, {SAFETENSORS_INDEX} or pytorch_model.bin)")
    for file in files:
        check_safetensors(file, what)


def check_safetensors(file: Path, what: str = "") -> None:
    """The header parses and the file is as long as the header says (else: truncated or not safetensors)."""
    prefix = f"{what}: " if what else ""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelError(f"{prefix}{file.name} is not a safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise ModelError(f"{prefix}{file.name} is truncated or not a safetensors file "
                             f"({size} bytes, its header alone claims {header_len})")
        try:
            header = json.loads(fh.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelError(f"{prefix}{file.name} is not a safetensors file (unreadable header)") from exc
    if 8 + header_len + end > size:
        raise ModelError(f"{prefix}{file.name} is truncated: {size} bytes, its header needs {8 + header_len + end}")


def check_architecture(path: str) -> None:
    """The config builds a causal LM with experts specfit can offload; built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specfit.core.moe import SUPPORTED, find_experts

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, bad values: transformers raises many types
        raise ModelError(f"model.path={path}: config.json is not a usable model config: {_first_line(exc)}") from exc
    kind = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):  # the default attention: whether it supports ours is from_pretrained's to say
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"model.path={path}: model_type {kind!r} cannot be built as a causal LM: {_first_line(exc)}") from exc
    try:
        experts = find_experts(model)
    except ModelError as exc:
        raise ModelError(f"model.path={path}: model_type {kind!r} is an unsupported MoE architecture: {exc}") from exc
    if not experts:
        raise ModelError(f"model.path={path}: {type(model).__name__} (model_type {kind!r}) is not a mixture-of-experts "
                         f"model; supported: {SUPPORTED}")


def _check_loading_info(path: str, info: dict[str, Any]) -> None:
    """Weights that do not fit the config are an error, not a silent random initialisation."""
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, ckpt, model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ModelError(f"model.path={path}: weights do not fit config.json: {key} has shape {tuple(ckpt)} in the "
                         f"checkpoint, the config implies {tuple(model)}{more}")
    for kind, what in (("missing_keys", "lacks tensors the config needs"),
                       ("unexpected_keys", "has tensors the config does not use")):
        keys = sorted(info.get(kind) or ())
        if keys:
            more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
            raise ModelError(f"model.path={path}: the checkpoint {what}: {', '.join(keys[:3])}{more}")
    if info.get("error_msgs"):
        raise ModelError(f"model.path={path}: cannot load the checkpoint: {str(info['error_msgs'][0]).splitlines()[0]}")


def load_tokenizer(path: str | Path, key: str = "model.path", required: bool = False, hint: str = "") -> Any | None:
    """The tokenizer in ``path`` (a directory, or a hub id), or None when a checkpoint has none (prompts
    must then be token ids). ``required``: no tokenizer there is a ModelError naming ``key`` (and
    ``hint``, how to make one). The one tokenizer loader: the engine's and the trainers'."""
    path = str(path)
    local = Path(path).expanduser()
    if required and not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise ModelError(f"{key}={path}: no such directory{hint}")
    if local.is_dir() and not any(
        (local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        if required:
            raise ModelError(f"{key}={path}: no tokenizer files there (tokenizer.json, tokenizer_config.json, ...){hint}")
        return None
    if local.is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (local / name).is_file():
                read_json(local / name, f"{key}={path}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types
        raise ModelError(f"{key}={path}: the tokenizer cannot be loaded: {_first_line(exc)}") from exc
