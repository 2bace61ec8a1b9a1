"""Everything a plug-in package needs, in one place (as an ``llm`` plug-in imports from ``llm``).

- the contracts, one Protocol per kind: :class:`Drafter`, :class:`Selector`, :class:`CostModel`,
  :class:`ExpertCache`, :class:`ExpertPredictor`, :class:`AcceptanceEstimator`, :class:`Prefetcher`;
- their base classes, with the optional hooks as documented no-ops: :class:`DrafterBase`, ...;
- the base config of each kind (:class:`DrafterConfig`, :class:`SelectorConfig`,
  :class:`CostModelConfig`, :class:`CacheConfig`, :class:`PredictorConfig`, :class:`AcceptanceConfig`,
  :class:`PrefetcherConfig`);
- what the hooks exchange: :class:`DraftTree`, :class:`Selection`, :class:`SelectionContext`
  (and :data:`ACCEPTED_KEY`, a key of its ``extra``), :class:`Admission`;
- the ``hookimpl`` marker;
- imported on first use (they pull in torch or the search's compiled code): ``CostConstants``,
  ``SearchProblem``, ``MoESpec`` and ``resolve_capacity``;
- :class:`PrefetchSink`, what a prefetcher's ``bind`` receives.
"""

from typing import TYPE_CHECKING, Any

from specfit.types.tree import ROOT, DraftTree
from specfit.interfaces.bases import (
    AcceptanceEstimatorBase,
    CostModelBase,
    DrafterBase,
    ExpertCacheBase,
    ExpertPredictorBase,
    PrefetcherBase,
    SelectorBase,
)
from specfit.interfaces.configs import (
    CONSUMED_ELSEWHERE,
    PLUGIN_BASES,
    AcceptanceConfig,
    CacheConfig,
    CostModelConfig,
    DrafterConfig,
    LinkConfig,
    PluginConfig,
    PredictorConfig,
    PrefetcherConfig,
    SelectorConfig,
)
from specfit.interfaces.hookspecs import hookimpl, hookspec
from specfit.interfaces.protocols import (
    ACCEPTED_KEY,
    KINDS,
    AcceptanceEstimator,
    Admission,
    Contract,
    CostModel,
    Drafter,
    ExpertCache,
    ExpertPredictor,
    PrefetchSink,
    Prefetcher,
    Selection,
    SelectionContext,
    Selector,
    contract,
)

if TYPE_CHECKING:
    from specfit.types.costs import CostConstants
    from specfit.types.moe import MoESpec
    from specfit.types.moe import resolve_capacity
    from specfit.search import SearchProblem

__all__ = [
    "ACCEPTED_KEY",
    "CONSUMED_ELSEWHERE",
    "KINDS",
    "PLUGIN_BASES",
    "ROOT",
    "AcceptanceConfig",
    "AcceptanceEstimator",
    "AcceptanceEstimatorBase",
    "Admission",
    "CacheConfig",
    "Contract",
    "CostConstants",
    "CostModel",
    "CostModelBase",
    "CostModelConfig",
    "DraftTree",
    "Drafter",
    "DrafterBase",
    "DrafterConfig",
    "ExpertCache",
    "ExpertCacheBase",
    "ExpertPredictor",
    "ExpertPredictorBase",
    "LinkConfig",
    "MoESpec",
    "PluginConfig",
    "PrefetchSink",
    "PredictorConfig",
    "Prefetcher",
    "PrefetcherBase",
    "PrefetcherConfig",
    "SearchProblem",
    "Selection",
    "SelectionContext",
    "Selector",
    "SelectorBase",
    "SelectorConfig",
    "contract",
    "hookimpl",
    "hookspec",
    "resolve_capacity",
]

_LAZY = {
    "CostConstants": "specfit.calibrate.run",
    "MoESpec": "specfit.types.moe",
    "resolve_capacity": "specfit.types.moe",
    "SearchProblem": "specfit.search",
}


def __getattr__(name: str) -> Any:
    """The torch- or numba-heavy names, imported when a plug-in first asks for them."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specfit.interfaces' has no attribute {name!r}")
