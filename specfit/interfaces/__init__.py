"""Everything a plug-in package needs, in one place (as an ``llm`` plug-in imports from ``llm``).

A plug-in imports from this module only (and from its own modules); ``tests/test_architecture.py``
checks that the built-ins and ``docs/example-plugin`` do. What it holds, by purpose:

- the contracts, one Protocol per kind: :class:`Drafter`, :class:`Selector`, :class:`CostModel`,
  :class:`ExpertCache`, :class:`ExpertPredictor`, :class:`AcceptanceEstimator`, :class:`Prefetcher`
  (and :data:`KINDS`, :class:`Contract`, :func:`contract`);
- their base classes, with the optional hooks as documented no-ops: :class:`DrafterBase`, ...;
- the base config of each kind (:class:`DrafterConfig`, :class:`SelectorConfig`,
  :class:`CostModelConfig`, :class:`CacheConfig`, :class:`PredictorConfig`, :class:`AcceptanceConfig`,
  :class:`PrefetcherConfig`; :class:`PluginConfig`, :class:`LinkConfig`, :data:`PLUGIN_BASES`,
  :data:`CONSUMED_ELSEWHERE`);
- the hooks: the ``hookimpl`` marker (and ``hookspec``);
- what the hooks exchange: :class:`DraftTree` (and :data:`ROOT`, the root's parent), :class:`Selection`,
  :class:`SelectionContext` (and :data:`ACCEPTED_KEY`, a key of its ``extra``), :class:`Admission`,
  :class:`PrefetchSink` (what a prefetcher's ``bind`` receives), :class:`MoESpec` (what ``bind``
  receives) and :func:`resolve_capacity`;
- the plain data the built-ins compute with: the prompt's n-gram index (:class:`TokenContext`,
  :class:`ContextView`, :data:`ORDERS`), acceptance outcomes (:func:`settled`, :func:`conditional`,
  :class:`AcceptanceScore`), the cost constants (:class:`CostConstants`, :func:`fit_constants`,
  :func:`load_constants`);
- the search over draft trees: :class:`SearchProblem`, :func:`evaluate`, :func:`solve`,
  :func:`solve_surplus`, :func:`greedy`, :func:`paper_scale_problem`;
- errors to raise: :class:`SpecfitError` and its :class:`ConfigError` (a mistake the user can fix),
  :class:`ModelError`, :class:`PluginError`;
- value checks for config fields, raising :class:`ConfigError` naming the key: :func:`integer`,
  :func:`optional_integer`, :func:`number`, :func:`is_int`, :func:`is_count`;
- files: :func:`read_json_object`, :func:`missing_directory`, :func:`check_safetensors`,
  :func:`head_weights_digest`;
- messages and checks: :func:`note_once` (a note printed once per process),
  :func:`check_plugin_instance` (an object's members against its kind's contract).

Imported on first use, as they pull in the search's compiled code (numba): the search's names;
``import specfit.interfaces`` imports neither torch nor numba.
"""

from typing import TYPE_CHECKING, Any

from specfit.errors import ConfigError, ModelError, PluginError, SpecfitError
from specfit.files import check_safetensors, head_weights_digest, missing_directory, read_json_object
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
from specfit.interfaces.contracts import check_plugin_instance
from specfit.interfaces.hookspecs import hookimpl, hookspec
from specfit.interfaces.exchange import ACCEPTED_KEY, Admission, Selection, SelectionContext
from specfit.interfaces.protocols import (
    KINDS,
    AcceptanceEstimator,
    CostModel,
    Drafter,
    ExpertCache,
    ExpertPredictor,
    PrefetchSink,
    Prefetcher,
    Selector,
)
from specfit.interfaces.contracts import Contract, contract
from specfit.messages import note_once
from specfit.types.acceptance import AcceptanceScore, conditional, settled
from specfit.types.context import ORDERS, ContextView, TokenContext
from specfit.types.costs import CostConstants, fit_constants, load_constants
from specfit.types.moe import MoESpec, resolve_capacity
from specfit.types.tree import ROOT, DraftTree
from specfit.validation import integer, is_count, is_int, number, optional_integer

if TYPE_CHECKING:
    from specfit.search import SearchProblem, evaluate, greedy, solve, solve_surplus
    from specfit.search.synthetic import paper_scale_problem

__all__ = [
    # the contracts
    "KINDS",
    "AcceptanceEstimator",
    "Contract",
    "CostModel",
    "Drafter",
    "ExpertCache",
    "ExpertPredictor",
    "Prefetcher",
    "Selector",
    "contract",
    # their base classes
    "AcceptanceEstimatorBase",
    "CostModelBase",
    "DrafterBase",
    "ExpertCacheBase",
    "ExpertPredictorBase",
    "PrefetcherBase",
    "SelectorBase",
    # the base configs
    "CONSUMED_ELSEWHERE",
    "PLUGIN_BASES",
    "AcceptanceConfig",
    "CacheConfig",
    "CostModelConfig",
    "DrafterConfig",
    "LinkConfig",
    "PluginConfig",
    "PredictorConfig",
    "PrefetcherConfig",
    "SelectorConfig",
    # the hooks
    "hookimpl",
    "hookspec",
    # what the hooks exchange
    "ACCEPTED_KEY",
    "ROOT",
    "Admission",
    "DraftTree",
    "MoESpec",
    "PrefetchSink",
    "Selection",
    "SelectionContext",
    "resolve_capacity",
    # plain data: the n-gram index, acceptance outcomes, cost constants
    "ORDERS",
    "AcceptanceScore",
    "ContextView",
    "CostConstants",
    "TokenContext",
    "conditional",
    "fit_constants",
    "load_constants",
    "settled",
    # the search
    "SearchProblem",
    "evaluate",
    "greedy",
    "paper_scale_problem",
    "solve",
    "solve_surplus",
    # errors
    "ConfigError",
    "ModelError",
    "PluginError",
    "SpecfitError",
    # value checks
    "integer",
    "is_count",
    "is_int",
    "number",
    "optional_integer",
    # files
    "check_safetensors",
    "head_weights_digest",
    "missing_directory",
    "read_json_object",
    # messages and checks
    "check_plugin_instance",
    "note_once",
]

_LAZY = {  # name: its module, imported when a plug-in first asks for the name
    "SearchProblem": "specfit.search",  # numba
    "evaluate": "specfit.search",
    "greedy": "specfit.search",
    "solve": "specfit.search",
    "solve_surplus": "specfit.search",
    "paper_scale_problem": "specfit.search.synthetic",
}


def __getattr__(name: str) -> Any:
    """The numba-heavy names (the search), imported when a plug-in first asks for them."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specfit.interfaces' has no attribute {name!r}")
