"""Build-time checks of what an offload runtime is given: a copy engine it can order its copies
with, a host store the engine can read, a loader's store that fits the model. Each names the
problem before the model's experts modules are swapped, not at the first copy mid-decode.
"""

from __future__ import annotations

import dataclasses

import torch

from specfit.errors import ConfigError, ModelError
from specfit.offload.copy.base import CopyEngine, engines_within
from specfit.offload.store import HostExpertStore
from specfit.types.moe import MoESpec


def check_copy_order(copy_engine: CopyEngine) -> None:
    """The runtime keeps no per-slot event of a slot's last use: a copy engine (or the engine an
    emulated link wraps) must order its copies after the compute queued before them, or a copy
    could overwrite a slot that queued compute still reads."""
    for engine in engines_within(copy_engine):
        if getattr(engine, "order_after_compute", True) is False:
            raise ConfigError(f"copy engine {type(engine).__name__} has order_after_compute=False: the offload "
                              "runtime tracks no per-slot last use, so its copies must wait for queued compute")


def check_store_readable(copy_engine: CopyEngine, store: HostExpertStore, device: torch.device,
                         after: str = "") -> None:
    """The Triton engine's kernel reads the host store directly on CUDA, which needs pinned memory:
    a store that could not be pinned throughout (pinned memory ran out part-way) is named now, not
    at the first copy from one of its pageable layers, mid-decode."""
    if device.type != "cuda" or not any(e.name == "triton" for e in engines_within(copy_engine)):
        return
    pageable = [i for i, t in enumerate(store.layers) if t is not None and t.device.type == "cpu" and not t.is_pinned()]
    if pageable:
        raise ConfigError(f"cache.copy=triton reads the host expert store from the GPU, which needs pinned memory, "
                          f"but {len(pageable)} of its {len(store.layers)} layers are not pinned (pinning failed, or "
                          f"the loader did not ask for it): use cache.copy=torch, or free pinned memory{after}")


def store_spec(model_spec: MoESpec, store: HostExpertStore) -> MoESpec:
    """The runtime's spec with a loader's store: the model's shapes, the store's dtype (the experts may
    stay bf16 under fp32 activations); a store of other shapes is a ModelError."""
    given = store.spec
    for field_name in ("num_layers", "num_experts", "hidden_size", "intermediate_size", "layout"):
        if getattr(given, field_name) != getattr(model_spec, field_name):
            raise ModelError(f"expert store: {field_name} {getattr(given, field_name)} does not match the model's "
                             f"{getattr(model_spec, field_name)}")
    return dataclasses.replace(model_spec, dtype=given.dtype)
