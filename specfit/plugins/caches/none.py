"""Vanilla offloading: nothing stays resident between passes; every needed expert is copied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specfit.interfaces import Admission, CacheConfig, ExpertCacheBase, MoESpec, resolve_capacity


@dataclass
class NoCacheConfig(CacheConfig):
    name: str = "none"


class NoCache(ExpertCacheBase):
    """Scratch slots only (default: top-k per layer); a layer's union is streamed through them.

    It cannot prefetch (nothing outlives a pass): it keeps ``ExpertCacheBase``'s ``admit_prefetch``,
    so the runtime says so once when a prefetcher asks, and never pipelines its rounds."""

    name = "none"
    Config = NoCacheConfig

    def __init__(self, capacity: int | None = None, capacity_bytes: int | None = None) -> None:
        self.requested = (capacity, capacity_bytes)

    def bind(self, spec: MoESpec) -> int:
        self.spec = spec
        self.capacity = resolve_capacity(spec, *self.requested, default=spec.top_k)
        return self.capacity

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        # Within a pass each expert is admitted once, so scratch slots can be reused freely.
        chunk = list(wanted)[: self.capacity]
        return Admission({e: slot for slot, e in enumerate(chunk)}, [(e, slot) for slot, e in enumerate(chunk)])

    def resident(self) -> np.ndarray:
        return np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=bool)
