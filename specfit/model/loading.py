"""Loading the target: a local Hugging Face checkpoint, or a small model built in code.

A checkpoint directory of safetensors files is streamed (:mod:`specfit.model.streaming`): the model
is built on the meta device, dense weights go straight to the device, the experts into a
:class:`~specfit.offload.store.HostExpertStore`, their only host copy, which the engine's
runtime takes over. Weights keep the checkpoint's dtype unless ``model.dtype`` says otherwise;
``model.numerics=exact`` upcasts the dense ones of a half-precision model to float32
(:mod:`specfit.model.numerics`). Other checkpoints (``.bin`` files, hub ids) and callers that want
the whole module (:func:`load_checkpoint`) go through transformers' ``from_pretrained``.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specfit.model.config import ModelConfig
from specfit.model.numerics import check_numerics, dense_dtype, map_dense_tensors
from specfit.errors import ModelError
from specfit.files import check_safetensors, missing_directory, read_json_object
from specfit.validation import device_arg

if TYPE_CHECKING:
    from specfit.offload.store import HostExpertStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any | None
    source: str
    # a streamed checkpoint's experts (the model's experts modules then hold meta tensors); None: in the model
    expert_store: HostExpertStore | None = None
    # the `model` settings it was loaded with, where engines of several configs share it (share_experts)
    settings: dict[str, Any] | None = None


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


def share_experts(loaded: LoadedModel, pin: bool, settings: dict[str, Any]) -> LoadedModel:
    """``loaded`` with its experts in one host store that several engines read (the bench's
    methods, side by side): each engine gets its own copy of the rest (:func:`engine_copy`), so N
    methods hold the experts, nearly all of an MoE model's bytes, once and not N times. ``pin``: pin
    a store built here from the model's modules (the engines copy from it to a GPU). The dense
    weights it keeps to copy from wait in host memory: each engine moves its own copy to its device."""
    from specfit.offload.store import HostExpertStore
    from specfit.offload.discovery import find_experts, moe_spec

    store = loaded.expert_store
    if store is None:  # experts still in the model (a built-in or from_pretrained model): moved out once
        experts = find_experts(loaded.model)
        store = HostExpertStore.from_modules(experts, moe_spec(loaded.model, experts), pin=pin)
    store.shared = True  # an engine with every expert in its slots (cache=full) keeps the host copy
    # a streamed checkpoint's dense weights were loaded to the device
    map_dense_tensors(loaded.model, lambda _module, _name, t: t.cpu() if t.device.type != "cpu" else None)
    return LoadedModel(loaded.model, loaded.tokenizer, loaded.source, store, settings)


def engine_copy(shared: LoadedModel) -> LoadedModel:
    """One engine's model over a shared store (:func:`share_experts`): the dense weights copied,
    since an engine moves, upcasts and hooks its own model; the experts, meta tensors there, are not."""
    import copy

    memo = {id(shared.expert_store): shared.expert_store}  # never a second copy of the experts, whatever refers to it
    return LoadedModel(copy.deepcopy(shared.model, memo), shared.tokenizer, shared.source, shared.expert_store)


def load_target(cfg: ModelConfig) -> LoadedModel:
    check_device(cfg.device)
    check_numerics(cfg.numerics)
    if cfg.attn_implementation not in ATTENTION:
        raise ModelError(f"model.attn_implementation={cfg.attn_implementation!r}: tree verification supports "
                         f"{' and '.join(ATTENTION)}")
    if cfg.builtin and cfg.path:
        raise ModelError("set model.path or model.builtin, not both")
    if cfg.tokenizer:  # before any weights: a mistyped model.tokenizer is named, never ignored
        check_source(cfg.tokenizer, "model.tokenizer", files=TOKENIZER_HUB_FILES)
    if cfg.builtin:
        from specfit.model.builtin import build_builtin

        dtype = resolve_dtype(cfg.dtype)
        model = build_builtin(cfg.builtin, seed=cfg.seed, dtype=torch.float32 if dtype == "auto" else dtype,
                              attn_implementation=cfg.attn_implementation)
        tokenizer = load_tokenizer(cfg.tokenizer, "model.tokenizer", required=True) if cfg.tokenizer else None
        return LoadedModel(model, tokenizer, f"builtin:{cfg.builtin}")
    if not cfg.path:
        raise ModelError("no model: set model.path=DIR (a Hugging Face checkpoint) or model=<preset>")
    path = hub_snapshot(cfg.path) or cfg.path
    model, store = stream_checkpoint(path, cfg.dtype, cfg.attn_implementation, cfg.numerics, cfg.device)
    tokenizer = load_tokenizer(cfg.tokenizer, "model.tokenizer", required=True) if cfg.tokenizer else load_tokenizer(path)
    return LoadedModel(model, tokenizer, cfg.path, store)


#: What a hub checkpoint needs to be streamed: configs, safetensors weights and the tokenizer's files.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def hub_snapshot(path: str) -> str | None:
    """A hub id's files in the local hub cache (fetched first where the hub is reachable, as
    ``from_pretrained`` would), so that a hub checkpoint streams like a local one; None for a local
    path, or when there is no snapshot with safetensors weights (``from_pretrained`` then loads it,
    or says why it cannot)."""
    if not _hub_id(path):
        return None
    check_hub_id(path)
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(path, allow_patterns=HUB_FILES))
    except Exception:  # noqa: BLE001 - offline, unknown repo, gated: from_pretrained reports it in one line
        return None
    return str(local) if (local / "config.json").is_file() and safetensors_files(local) else None


def _hub_id(path: str) -> bool:
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
    if local.exists() or not _hub_id(path):
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


def check_checkpoint(path: str) -> Path | None:
    """The cheap checks of ``model.path`` (config.json, the weight files' headers, the architecture on
    the meta device), run before any weights are read so a bad checkpoint fails in seconds whatever
    its size. Returns the local directory, or None for a hub id."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelError(f"model.path={path}: not a directory")
        if not (local / "config.json").is_file():
            raise ModelError(f"model.path={path}: no config.json there, so not a Hugging Face checkpoint")
        read_json(local / "config.json", f"model.path={path}")
        check_weight_files(local, f"model.path={path}")
    elif not _hub_id(path):
        raise ModelError(f"model.path={path}: no such directory")
    else:
        check_hub_id(path)
    check_architecture(str(local) if local.exists() else path)
    return local if local.exists() else None


def stream_checkpoint(path: str, dtype: str = "auto", attn_implementation: str = "sdpa", numerics: str = "exact",
                      device: str = "auto") -> tuple[nn.Module, HostExpertStore | None]:
    """The model of checkpoint ``path`` with its experts in a host store (None: they stay in the model).

    Safetensors files are read tensor by tensor: the model's parameters are built on the meta
    device, dense weights land on ``device`` (``model.device``) in the model's dtype (float32 for a
    half-precision model under ``numerics=exact``), the experts in a store pinned on CUDA. Every
    problem is one ModelError naming the file or tensor. A checkpoint without safetensors files
    (``.bin``) or a hub id loads through transformers (saying so for ``.bin``)."""
    check_numerics(numerics)
    local = check_checkpoint(path)
    files = safetensors_files(local) if local is not None else []
    if not files:
        model = _from_pretrained(path, dtype, attn_implementation, local)
        if local is not None:  # after the load: a broken file's error stays the one line
            print(f"specfit: model.path={path} has no safetensors files: loaded with transformers' from_pretrained "
                  f"(the engine copies its experts into the host store: a second host copy while it builds)",
                  file=sys.stderr, flush=True)
        return model, None
    return _stream(str(local), files, dtype, attn_implementation, numerics, _load_device(device))


def load_checkpoint(path: str, dtype: str = "auto", attn_implementation: str = "sdpa") -> nn.Module:
    """A local (or cached hub) checkpoint as a whole module, experts included (transformers'
    ``from_pretrained``), for callers that use the model itself; every problem is one ModelError
    naming the file or tensor. :func:`load_target` streams instead (one copy of the weights)."""
    local = check_checkpoint(path)
    return _from_pretrained(str(local) if local is not None else path, dtype, attn_implementation, local)


def _from_pretrained(path: str, dtype: str, attn_implementation: str, local: Path | None) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # A checkpoint of a GiB or more (or one from the hub) takes a while: transformers' bar on a terminal,
    # one line before and after otherwise. Small ones load in a second: a bar per load would only
    # clutter comparisons (the demo loads one per method).
    size = _weights_size(local) if local is not None else None
    slow = size is None or size >= 2**30
    bar = slow and sys.stderr.isatty()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    if not bar:
        hf_logging.disable_progress_bar()
    if slow and not bar:
        _say_loading(path, size)
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


def _stream(path: str, files: list[Path], dtype_name: str, attn_implementation: str, numerics: str,
            device: torch.device) -> tuple[nn.Module, HostExpertStore]:
    from specfit.offload.store import HostExpertStore
    from specfit.offload.discovery import find_experts, moe_spec
    from specfit.model.streaming import CheckpointPlan, SafetensorsReader, stream_into

    what = f"model.path={path}"
    size = sum(f.stat().st_size for f in files)
    slow = size >= 2**30
    if slow:
        _say_loading(path, size)
    start = time.perf_counter()
    config = _config(path)
    reader = SafetensorsReader(files, what)
    dtype = _stream_dtype(dtype_name, config, reader)
    model = _meta_model(path, config, dtype, attn_implementation)
    experts = find_experts(model)
    spec = moe_spec(model, experts)
    plan = CheckpointPlan(model, experts, spec, dtype, what)
    quantization = _quantization(config, what)
    try:
        if quantization is None:
            names = reader.names()
            targets = {name: plan.target(name, reader.entries[name].shape) for name in names}  # shapes: headers only
            unexpected = [n for n, t in targets.items() if t is None and not plan.ignored(n)]
            for t in targets.values():
                if t is not None:
                    plan.record(t)
            _check_complete(what, _missing(model, plan), unexpected)  # before reading a byte of data
            tensors = ((n, lambda n=n: reader.get(n), reader.entries[n].shape) for n in names if targets[n] is not None)
        else:
            from specfit.model.quantized import dequantized

            pairs = dequantized(reader.names(), reader.get, config.to_dict(), dtype)
            tensors = ((n, lambda t=t: t, tuple(t.shape)) for n, t in pairs)
        store = HostExpertStore(spec, pin=device.type == "cuda")
        plan.loaded_dense.clear()
        plan.covered.clear()
        unexpected = stream_into(model, store, plan, tensors, device, lambda d: dense_dtype(d, numerics))
    finally:
        reader.close()
    missing = _missing(model, plan) or [_store_name(spec, m) for m in store.missing(limit=4)]
    _check_complete(what, missing, unexpected)
    if hasattr(model, "tie_weights"):
        model.tie_weights(missing_keys=set(plan.dense) - plan.loaded_dense, recompute_mapping=False)
    left = [name for name, d in plan.dense.items() if _tensor(d).is_meta]
    if left:
        raise ModelError(f"{what}: the checkpoint lacks tensors the config needs: {_few(left)}")
    if slow:
        print(f"specfit: loaded model.path={path} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return model.eval(), store


def _load_device(device: str) -> torch.device:
    """Where dense weights land: ``model.device`` (auto: CUDA when there is one), as the engine decides."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_arg(device, key="model.device"))


def _stream_dtype(name: str, config: Any, reader: Any) -> torch.dtype:
    """``model.dtype``, or for auto the checkpoint's (config.json's ``dtype``, else its first floating tensor),
    as transformers' ``dtype="auto"`` decides it."""
    dtype = resolve_dtype(name)
    if dtype != "auto":
        return dtype
    declared = getattr(config, "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str) and declared in DTYPES:
        return DTYPES[declared]
    for entry in reader.entries.values():
        if entry.dtype.is_floating_point:
            return entry.dtype
    return torch.float32


def _quantization(config: Any, what: str) -> str | None:
    """The checkpoint's quantization method, dequantized at load (None: not quantized); any other
    is a ModelError naming it."""
    from specfit.model.quantized import quantization_of

    return quantization_of(config.to_dict(), what)


def _missing(model: nn.Module, plan: Any) -> list[str]:
    """Dense tensors and expert parts the checkpoint does not cover; one of a tied pair is enough."""
    absent = set(plan.dense) - plan.loaded_dense
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if (target in absent) != (source in absent):
            absent.discard(target)
            absent.discard(source)
    return sorted(absent) + plan.missing_experts()


def _check_complete(what: str, missing: list[str], unexpected: list[str]) -> None:
    if missing:
        raise ModelError(f"{what}: the checkpoint lacks tensors the config needs: {_few(missing)}")
    if unexpected:
        raise ModelError(f"{what}: the checkpoint has tensors the config does not use: {_few(sorted(unexpected))}")


def _few(names: list[str]) -> str:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more}"


def _store_name(spec: Any, entry: str) -> str:
    """The store's ``layer 3 expert 17 up`` under the experts module's name."""
    words = entry.split()
    if len(words) >= 2 and words[0] == "layer" and words[1].isdigit() and int(words[1]) < len(spec.module_names):
        return " ".join([spec.module_names[int(words[1])], *words[2:]])
    return entry


def _tensor(d: Any) -> torch.Tensor:
    return d.module._parameters[d.attr] if d.attr in d.module._parameters else d.module._buffers[d.attr]


def _say_loading(path: str, size: int | None) -> None:
    weights = f" ({size / 1e9:.1f} GB)" if size is not None else ""
    print(f"specfit: loading the checkpoint model.path={path}{weights}", file=sys.stderr, flush=True)


def _weights_size(local: Path) -> int:
    return sum(f.stat().st_size for f in local.glob("*.safetensors"))


def _first_line(exc: BaseException) -> str:
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


def _config(path: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, bad values: transformers raises many types
        raise ModelError(f"model.path={path}: config.json is not a usable model config: {_first_line(exc)}") from exc


def _meta_model(path: str, config: Any, dtype: torch.dtype | None = None, attn_implementation: str | None = None) -> nn.Module:
    """The causal LM of ``config`` with its parameters on the meta device (no memory) and real buffers."""
    from transformers import AutoModelForCausalLM

    from specfit.model.streaming import parameters_on_meta

    kind = getattr(config, "model_type", "?")
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)  # gpt-oss: its sinks are eager-only
    if attn_implementation == "sdpa" and model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        raise ModelError(f"model.attn_implementation=sdpa: {model_class.__name__} (model_type {kind!r}) does not support "
                         "sdpa attention in transformers; set model.attn_implementation=eager")
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"model.path={path}: model_type {kind!r} cannot be built as a causal LM: {_first_line(exc)}") from exc


def check_architecture(path: str) -> None:
    """The config builds a causal LM with experts specfit can offload; built on the meta device (no memory)."""
    from specfit.types.moe import SUPPORTED
    from specfit.offload.discovery import find_experts

    config = _config(path)
    kind = getattr(config, "model_type", "?")
    model = _meta_model(path, config)  # the default attention: whether it supports ours is the load's to say
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
        raise ModelError(f"{key}={path}: the tokenizer cannot be loaded: {_first_line(exc)}") from exc
