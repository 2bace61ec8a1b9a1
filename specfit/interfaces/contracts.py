"""Contract checks: a plug-in object fulfils its kind's Protocol, and a selector gets the parts it requires.

The registry checks classes when they register; these check the objects a run is built from
(whether made by the registry or in code), before anything is bound.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from specfit.errors import ConfigError, PluginError
from specfit.interfaces.protocols import KINDS
from specfit.validation import is_collection


def check_plugin_instance(kind: str, obj: Any) -> None:
    """A plug-in object, before it is bound: every member of its kind's Protocol, attributes included."""
    if isinstance(obj, type):
        raise PluginError(f"{kind}={obj.__qualname__} is a class: pass an instance, {obj.__qualname__}(...)")
    name = getattr(obj, "name", None)
    missing = [m for m in contract(kind).members if not has_member(obj, m)]
    if not isinstance(name, str):
        missing.insert(0, "name")
    abstract = sorted(getattr(type(obj), "__abstractmethods__", ()))
    if missing or abstract:
        label = f"'{name}' ({type(obj).__qualname__})" if isinstance(name, str) else type(obj).__qualname__
        raise PluginError(f"{kind} {label} lacks {', '.join(missing + abstract)} "
                          f"({remedy(kind)})")


# kind -> the base class whose defaults supply every optional hook
_BASE_NAMES = {"drafter": "DrafterBase", "selector": "SelectorBase", "cost_model": "CostModelBase",
               "cache": "ExpertCacheBase", "predictor": "ExpertPredictorBase",
               "acceptance": "AcceptanceEstimatorBase", "prefetch": "PrefetcherBase"}


def remedy(kind: str) -> str:
    return (f"subclass specfit.interfaces.{_BASE_NAMES[kind]} for the optional hooks' defaults; "
            f"the contract: specfit.interfaces.{KINDS[kind].__name__}")


def has_member(obj: Any, member: str) -> bool:
    """``hasattr`` without running a property (an uncalibrated cost model's ``constants`` raises)."""
    return isinstance(inspect.getattr_static(obj, member, None), property) or hasattr(obj, member)


def check_parts(parts: dict[str, Any], context: str = "") -> None:
    """The plug-in instances a cycle runs with: each fulfils its kind's contract, and the selector's
    ``requires`` (e.g. a cost model and a predictor for cost-aware selectors) are all given."""
    for kind, part in parts.items():
        if part is not None:
            check_plugin_instance(kind, part)
    selector = parts.get("selector")
    requires = selector.requires if selector is not None else ()
    if not is_collection(requires):
        raise PluginError(f"selector '{getattr(selector, 'name', selector)}': requires={requires!r:.40} must be a "
                          "tuple of part kinds, e.g. ('cost_model', 'predictor')")
    for needed in requires:
        if parts.get(needed) is None:
            raise ConfigError(f"selector={selector.name} needs a {needed}: set {needed}=..."
                              f" (e.g. {'cost_model=union' if needed == 'cost_model' else 'predictor=history'}){context}")


@dataclass(frozen=True)
class Contract:
    """The members of a kind's Protocol, split by when they can be checked.

    ``on_class``: methods and class attributes, checked when a class registers; ``on_instance``:
    attributes and properties, which a plug-in may as well set in ``__init__`` (a drafter's
    ``depth``), checked on the built object before it is bound.
    """

    on_class: tuple[str, ...]
    on_instance: tuple[str, ...]

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(sorted(self.on_class + self.on_instance))


def contract(kind: str) -> Contract:
    """What the core uses of a ``kind`` plug-in, read from its Protocol (``name`` excluded)."""
    protocol = KINDS[kind]
    on_class = {n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v)}
    on_instance = {n for n, v in vars(protocol).items() if not n.startswith("_") and isinstance(v, property)}
    annotations = vars(protocol).get("__annotations__", {})
    for member, annotation in annotations.items():
        if member.startswith("_") or member == "name":
            continue
        (on_class if str(annotation).startswith("ClassVar") else on_instance).add(member)
    return Contract(tuple(sorted(on_class)), tuple(sorted(on_instance)))
