"""Per-layer least-recently-used expert cache (the mixtral-offloading baseline)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specfit.interfaces import Admission, CacheConfig, ExpertCacheBase, MoESpec, resolve_capacity


@dataclass
class LRUCacheConfig(CacheConfig):
    name: str = "lru"


class LRUCache(ExpertCacheBase):
    """Keeps ``capacity`` experts per layer; a miss evicts the layer's least recently used expert.

    Default capacity (neither capacity nor capacity_bytes set): a quarter of the experts, at least top-k.
    """

    name = "lru"
    can_prefetch = True  # admit_prefetch admits experts to copy ahead
    Config = LRUCacheConfig

    def __init__(self, capacity: int | None = None, capacity_bytes: int | None = None) -> None:
        self.requested = (capacity, capacity_bytes)
        self.capacity = 0

    def bind(self, spec: MoESpec) -> int:
        self.spec = spec
        default = max(spec.top_k, spec.num_experts // 4)
        self.capacity = resolve_capacity(spec, *self.requested, default=default)
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(spec.num_layers)]  # oldest first
        self._free = [list(range(self.capacity - 1, -1, -1)) for _ in range(spec.num_layers)]
        return self.capacity

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        lru, free = self._lru[layer], self._free[layer]
        admitted: dict[int, int] = {}
        missing = []
        for e in wanted:  # one pass: hits move to the most recently used end
            slot = lru.get(e)
            if slot is None:
                missing.append(e)
            else:
                lru.move_to_end(e)
                admitted[e] = slot
        loads = []
        for e in missing[: self.capacity - len(admitted)]:
            if free:
                slot = free.pop()
            else:
                victim = next(v for v in lru if v not in admitted)
                slot = lru.pop(victim)
            lru[e] = slot
            admitted[e] = slot
            loads.append((e, slot))
        return Admission(admitted, loads)

    def admit_prefetch(self, layer: int, candidates: list[int], protected: frozenset[int]) -> Admission:
        """Prefetched experts go in at the most-recently-used end (they are expected soon), into a free
        slot or over the least recently used unprotected expert; a candidate with no such slot is
        dropped, as are all after it (they are ranked lower)."""
        lru, free = self._lru[layer], self._free[layer]
        loads: list[tuple[int, int]] = []
        admitted: set[int] = set()
        for e in candidates:
            if e in lru:
                continue
            if free:
                slot = free.pop()
            else:
                victim = next((v for v in lru if v not in protected and v not in admitted), None)
                if victim is None:
                    break
                slot = lru.pop(victim)
            lru[e] = slot
            admitted.add(e)
            loads.append((e, slot))
        return Admission(dict(loads), loads)

    def resident(self) -> np.ndarray:
        mask = np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=bool)
        for layer, lru in enumerate(self._lru):
            mask[layer, list(lru)] = True
        return mask

    def lru_order(self, layer: int) -> list[int]:
        """Resident experts of ``layer``, least recently used first (for tests and inspection)."""
        return list(self._lru[layer])
