"""specfit: cost-aware speculative decoding for MoE models with offloaded experts.

Programmatic use::

    import specfit
    cfg = specfit.compose(["model.path=/models/m", "drafter=none", "cache=lru", "cache.capacity=16"])
    engine = specfit.build(cfg)
    out = engine.generate([1, 2, 3], max_new_tokens=32)
    for event in engine.stream("Once upon a time", sampling=specfit.SamplingParams(temperature=0.7, seed=1)):
        print(event.text, end="", flush=True)

A plug-in package imports from :mod:`specfit.interfaces`; its tests may use this root as well:
:func:`register_plugin` loads it uninstalled, :func:`build_builtin` gives a built-in tiny model to
compare with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specfit.version import __version__  # noqa: E402

from specfit.interfaces.hookspecs import hookimpl  # noqa: E402  (light: pluggy only)

if TYPE_CHECKING:
    from specfit.api import Engine, build
    from specfit.config import compose
    from specfit.decode.output import GenerationOutput, StreamEvent
    from specfit.decode.sampling import SamplingParams
    from specfit.model.builtin import build_builtin

__all__ = ["Engine", "GenerationOutput", "SamplingParams", "StreamEvent", "build", "build_builtin", "compose",
           "hookimpl", "register_plugin", "__version__"]

_LAZY = {
    "build": ("specfit.api", "build"),
    "compose": ("specfit.config", "compose"),
    "Engine": ("specfit.api", "Engine"),
    "GenerationOutput": ("specfit.decode.output", "GenerationOutput"),
    "StreamEvent": ("specfit.decode.output", "StreamEvent"),
    "SamplingParams": ("specfit.decode.sampling", "SamplingParams"),  # greedy, or temperature / top-k / top-p
    "build_builtin": ("specfit.model.builtin", "build_builtin"),  # a tiny model with seeded weights (tests)
}


def register_plugin(module: object, name: str | None = None) -> None:
    """Load a plug-in module as its entry point would, without installing its package (its tests, a
    notebook); ``name`` is the plug-in's name in errors (default: the module's). Does nothing more
    once the entry point has loaded it. The next :func:`compose` or :func:`build` sees it."""
    from specfit.registry import register_plugin as register

    register(module, name)


def __getattr__(name: str) -> Any:
    """Import torch-heavy parts on first use, so `specfit plugins` and config tools start fast."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'specfit' has no attribute {name!r}")
