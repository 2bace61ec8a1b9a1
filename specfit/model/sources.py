"""Where a checkpoint or tokenizer comes from: a local directory or a Hugging Face hub id, checked
before anything is loaded (a mistyped path, an unreachable hub, truncated or missing weight files
are one ModelError naming the setting), and the one tokenizer loader.

Split from checkpoint reading (:mod:`specfit.model.checkpoint`) because the trainers and the
engine's tokenizer need these checks without loading a model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from specfit.errors import ModelError
from specfit.files import check_safetensors, missing_directory, read_json_object


#: What a hub checkpoint needs to be streamed: configs, safetensors weights and the tokenizer's files.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def hub_snapshot(path: str) -> str | None:
    """A hub id's files in the local hub cache (fetched first where the hub is reachable, as
    ``from_pretrained`` would), so that a hub checkpoint streams like a local one; None for a local
    path, or when there is no snapshot with safetensors weights (``from_pretrained`` then loads it,
    or says why it cannot)."""
    if not is_hub_id(path):
        return None
    check_hub_id(path)
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(path, allow_patterns=HUB_FILES))
    except Exception:  # noqa: BLE001 - offline, unknown repo, gated: from_pretrained reports it in one line
        return None
    return str(local) if (local / "config.json").is_file() and safetensors_files(local) else None


def is_hub_id(path: str) -> bool:
    """Whether ``model.path`` names a hub repository (``owner/name``) rather than a local directory."""
    return not (Path(path).expanduser().exists() or path.startswith((".", "/", "~")) or path.count("/") != 1)


def check_hub_id(path: str, key: str = "model.path", hint: str = "",
                 files: tuple[str, ...] = ("config.json",)) -> None:
    """A hub id must be in the local hub cache or the hub reachable; otherwise say so at once
    (offline, the hub client retries for half a minute, then transformers blames config.json)."""
    owner = path.split("/", 1)[0]
    if Path(owner).is_dir():  # models/Qwen3-30B with a local models/ folder: a mistyped local path
        raise ModelError(f"{key}={path}: no such directory (nothing named {path.split('/', 1)[1]!r} in {owner}/){hint}")
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(path, f), str) for f in files) or hub_reachable():
        return
    raise ModelError(f"{key}={path}: no such local directory, and as a Hugging Face hub id it is not in the "
                     f"local hub cache and the hub cannot be reached from here (offline); give a local checkpoint{hint}")


#: Any of these in the hub cache shows a tokenizer repo is there (a tokenizer-only repo has no config.json).
TOKENIZER_HUB_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")


def check_source(path: str, key: str, hint: str = "", files: tuple[str, ...] = ("config.json",)) -> None:
    """``key=path`` names a local directory, or a hub id that can be had; else one line naming ``key``
    (before transformers' words about repo ids, which name neither the setting nor the path's problem)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return
    if local.exists() or not is_hub_id(path):
        raise ModelError(f"{key}={path}: {missing_directory(local)}{hint}")
    check_hub_id(path, key, hint, files)


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (False under ``HF_HUB_OFFLINE``)."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``file``, or a ModelError naming ``what``, the file, the line and the problem."""
    return read_json_object(file, f"{what}: {file.name}", ModelError)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(local: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, else every ``*.safetensors``."""
    index = local / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index, f"model.path={local}").get("weight_map") or {}
        return [local / s for s in sorted(set(map(str, weight_map.values())))]
    return sorted(local.glob("*.safetensors"))


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


def load_tokenizer(path: str | Path, key: str = "model.path", required: bool = False, hint: str = "") -> Any | None:
    """The tokenizer in ``path`` (a directory, or a hub id), or None when a checkpoint has none (prompts
    must then be token ids). ``required``: no tokenizer there is a ModelError naming ``key`` (and
    ``hint``, how to make one). The one tokenizer loader: the engine's and the trainers'."""
    path = str(path)
    local = Path(path).expanduser()
    if required and not local.is_dir():  # a tokenizer-only repo may have no config.json cached
        check_source(path, key, hint, files=TOKENIZER_HUB_FILES)
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
        raise ModelError(f"{key}={path}: the tokenizer cannot be loaded: {first_line(exc)}") from exc
