"""Every expert resident: the no-offloading reference (it needs device memory for all experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specfit.interfaces import Admission, CacheConfig, ExpertCacheBase, MoESpec


@dataclass
class FullCacheConfig(CacheConfig):
    name: str = "full"


class FullCache(ExpertCacheBase):
    """Loads all experts once before decoding (not counted as misses); every request is a hit."""

    name = "full"
    can_prefetch = True  # admit_prefetch admits experts to copy ahead
    Config = FullCacheConfig

    def __init__(self, capacity: int | None = None, capacity_bytes: int | None = None) -> None:
        """``cache.capacity`` / ``capacity_bytes`` do not apply (every expert gets a slot); they are
        accepted so that one setting can be swept over caches, as a capacity above the expert count
        makes the other caches full too."""

    def bind(self, spec: MoESpec) -> int:
        self.spec = spec
        return spec.num_experts

    def preload(self) -> list[tuple[int, int, int]]:
        return [(layer, e, e) for layer in range(self.spec.num_layers) for e in range(self.spec.num_experts)]

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        return Admission({e: e for e in wanted}, [])

    def admit_prefetch(self, layer: int, candidates: list[int], protected: frozenset[int]) -> Admission:
        """Every expert is resident: there is never a candidate, nothing to copy."""
        return Admission({}, [])

    def resident(self) -> np.ndarray:
        return np.ones((self.spec.num_layers, self.spec.num_experts), dtype=bool)
