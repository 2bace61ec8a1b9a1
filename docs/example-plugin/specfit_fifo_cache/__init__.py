"""A complete specfit plugin: an expert cache that evicts the expert loaded longest ago (FIFO).

Installed with ``pip install -e docs/example-plugin``, it is selected like a built-in:
``specfit generate ... cache=fifo cache.capacity=8``. Everything it needs comes from
``specfit.interfaces``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specfit.interfaces import Admission, CacheConfig, ExpertCacheBase, MoESpec, hookimpl, resolve_capacity


@dataclass
class FIFOCacheConfig(CacheConfig):
    """Its fields become Hydra keys under `cache.` (typos are errors, types are checked). Each field
    reaches the constructor below: CacheConfig's capacity and capacity_bytes (copy and link configure
    the copy engine, which specfit builds)."""

    name: str = "fifo"


class FIFOCache(ExpertCacheBase):
    """Required: bind, admit, resident. preload and begin_pass keep ExpertCacheBase's defaults
    (nothing preloaded, nothing to do when a pass starts)."""

    name = "fifo"
    Config = FIFOCacheConfig

    def __init__(self, capacity: int | None = None, capacity_bytes: int | None = None) -> None:
        self.requested = (capacity, capacity_bytes)

    def bind(self, spec: MoESpec) -> int:
        self.spec = spec
        self.capacity = resolve_capacity(spec, *self.requested, default=spec.top_k)
        self.queue = [deque() for _ in range(spec.num_layers)]  # (expert, slot), oldest first
        self.slot_of = [{} for _ in range(spec.num_layers)]
        return self.capacity

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        slot_of, queue = self.slot_of[layer], self.queue[layer]
        admitted = {e: slot_of[e] for e in wanted if e in slot_of}
        loads = []
        for e in [e for e in wanted if e not in slot_of][: self.capacity - len(admitted)]:
            if len(slot_of) < self.capacity:
                slot = len(slot_of)
            else:  # evict the oldest expert not needed in this round
                victim = next(v for v, _ in queue if v not in admitted)
                queue.remove((victim, slot_of[victim]))
                slot = slot_of.pop(victim)
            slot_of[e] = slot
            queue.append((e, slot))
            admitted[e] = slot
            loads.append((e, slot))
        return Admission(admitted, loads)

    def resident(self) -> np.ndarray:
        mask = np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=bool)
        for layer, slot_of in enumerate(self.slot_of):
            mask[layer, list(slot_of)] = True
        return mask


@hookimpl
def register_expert_caches(register):
    register(FIFOCache)
