"""Reading a checkpoint: the cheap checks of ``model.path`` first, then its safetensors files streamed
into a model built on the meta device (:mod:`specfit.model.streaming`: dense weights straight to
the device, the experts into a :class:`~specfit.offload.store.HostExpertStore`, their only host
copy), or the whole module through transformers' ``from_pretrained`` (``.bin`` files, hub ids
without a safetensors snapshot, and :func:`load_checkpoint`'s callers).

Weights keep the checkpoint's dtype unless ``model.dtype`` says otherwise; ``model.numerics=exact``
upcasts the dense ones of a half-precision model to float32 (:mod:`specfit.model.numerics`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specfit.errors import ModelError
from specfit.model.numerics import check_numerics, dense_dtype
from specfit.model.sources import (
    check_hub_id,
    check_weight_files,
    first_line,
    is_hub_id,
    read_json,
    safetensors_files,
)
from specfit.validation import device_arg

if TYPE_CHECKING:
    from specfit.offload.store import HostExpertStore


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ModelError(f"model.dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


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
    elif not is_hub_id(path):
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
        raise ModelError(f"model.path={path}: cannot load the checkpoint: {first_line(exc)}") from exc
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


def _config(path: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, bad values: transformers raises many types
        raise ModelError(f"model.path={path}: config.json is not a usable model config: {first_line(exc)}") from exc


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
        raise ModelError(f"model.path={path}: model_type {kind!r} cannot be built as a causal LM: {first_line(exc)}") from exc


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
