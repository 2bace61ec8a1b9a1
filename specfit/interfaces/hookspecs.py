"""pluggy hook specifications: how a plugin package adds parts to specfit.

Every hook follows the register pattern: specfit calls the hook with a ``register`` callable and the
plugin calls ``register(SomeClass)`` once per part it provides. The class carries its registry name
(``name``) and its structured config (``Config``, a dataclass); registering it also makes
``<group>=<name>`` a valid Hydra override.

A plugin package exposes a module with ``@specfit.hookimpl`` functions under the entry-point group
``specfit``::

    [project.entry-points.specfit]
    my_plugin = "my_plugin.plugin"
"""

from __future__ import annotations

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("specfit")
hookimpl = pluggy.HookimplMarker("specfit")

Register = Callable[[type], None]


@hookspec
def register_drafters(register: Register) -> None:
    """Register drafter classes (see :class:`specfit.interfaces.Drafter`)."""


@hookspec
def register_selectors(register: Register) -> None:
    """Register selector classes (see :class:`specfit.interfaces.Selector`)."""


@hookspec
def register_cost_models(register: Register) -> None:
    """Register cycle-time cost models (see :class:`specfit.interfaces.CostModel`)."""


@hookspec
def register_expert_caches(register: Register) -> None:
    """Register expert-cache policies (see :class:`specfit.interfaces.ExpertCache`)."""


@hookspec
def register_predictors(register: Register) -> None:
    """Register expert predictors (see :class:`specfit.interfaces.ExpertPredictor`)."""


@hookspec
def register_acceptance_estimators(register: Register) -> None:
    """Register acceptance estimators for the cost-aware selectors (see
    :class:`specfit.interfaces.AcceptanceEstimator`)."""


@hookspec
def register_prefetchers(register: Register) -> None:
    """Register expert prefetchers (see :class:`specfit.interfaces.Prefetcher`)."""


@hookspec
def register_configs(config_store) -> None:  # noqa: ANN001 - hydra's ConfigStore, imported lazily
    """Add extra Hydra config nodes (presets for the ``model`` or ``workload`` groups, say)."""
