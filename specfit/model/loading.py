"""Loading the target: a local Hugging Face checkpoint (:mod:`specfit.model.checkpoint`), or a small
model built in code (:mod:`specfit.model.builtin`); and one load shared by several engines
(:func:`share_experts`, :func:`engine_copy`), which hold the experts once.

A checkpoint directory of safetensors files is streamed: the model is built on the meta device,
dense weights go straight to the device, the experts into a
:class:`~specfit.offload.store.HostExpertStore`, their only host copy, which the engine's runtime
takes over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specfit.errors import ModelError
from specfit.model.checkpoint import resolve_dtype, stream_checkpoint
from specfit.model.config import ModelConfig
from specfit.model.numerics import check_numerics, map_dense_tensors
from specfit.model.sources import TOKENIZER_HUB_FILES, check_source, hub_snapshot, load_tokenizer
from specfit.validation import device_arg

if TYPE_CHECKING:
    from specfit.offload.store import HostExpertStore


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any | None
    source: str
    # a streamed checkpoint's experts (the model's experts modules then hold meta tensors); None: in the model
    expert_store: HostExpertStore | None = None
    # the `model` settings it was loaded with, where engines of several configs share it (share_experts)
    settings: dict[str, Any] | None = None


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


