"""specfit: cost-aware speculative decoding for MoE models with offloaded experts.

Programmatic use::

    import specfit
    cfg = specfit.compose(["model.path=/models/m", "drafter=none", "cache=lru", "cache.capacity=16"])
    engine = specfit.build(cfg)
    out = engine.generate([1, 2, 3], max_new_tokens=32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specfit.version import __version__  # noqa: E402

from specfit.interfaces.hookspecs import hookimpl  # noqa: E402  (light: pluggy only)

if TYPE_CHECKING:
    from specfit.api import build
    from specfit.config import compose
    from specfit.api import Engine
    from specfit.decode.engine import GenerationOutput

__all__ = ["Engine", "GenerationOutput", "build", "compose", "hookimpl", "__version__"]

_LAZY = {
    "build": ("specfit.api", "build"),
    "compose": ("specfit.config", "compose"),
    "Engine": ("specfit.api", "Engine"),
    "GenerationOutput": ("specfit.decode.engine", "GenerationOutput"),
}


def __getattr__(name: str) -> Any:
    """Import torch-heavy parts on first use, so `specfit plugins` and config tools start fast."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'specfit' has no attribute {name!r}")
