"""No prefetching: every copy is on demand, as before prefetchers existed (the default)."""

from __future__ import annotations

from dataclasses import dataclass

from specfit.interfaces import PrefetcherBase, PrefetcherConfig


@dataclass
class NoPrefetcherConfig(PrefetcherConfig):
    name: str = "none"


class NoPrefetcher(PrefetcherBase):
    """Binds and does nothing: runs stay what they were without a prefetcher."""

    name = "none"
    Config = NoPrefetcherConfig
