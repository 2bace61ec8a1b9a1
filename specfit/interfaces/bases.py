"""Base classes of the plug-in kinds: the optional hooks as documented no-ops.

Subclass your kind's base, set ``name`` and ``Config``, and write the required methods (abstract
here: the registry names any you leave out); every optional hook you leave out does nothing (or
the stated default). The Protocols in
:mod:`specfit.interfaces.protocols` say what each hook receives and when it is called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Sequence

import numpy as np

from specfit.types.tree import DraftTree
from specfit.errors import ConfigError
from specfit.interfaces.exchange import Admission, Selection, SelectionContext

if TYPE_CHECKING:
    from specfit.types.costs import CostConstants
    from specfit.types.moe import MoESpec
    from specfit.search import SearchProblem


class DrafterBase(ABC):
    """Required: ``draft(tree)``, and ``depth`` / ``total_tokens`` (set them in ``__init__`` or on
    the class). Defaults: ``bind``, ``start`` and ``commit`` do nothing; ``feature_layers()`` is
    empty (the drafter needs no hidden states of the target); no weights' ``path``, no beam
    (``top_k = None``), no unused acceptance probe (``probe_left_unused = False``)."""

    name: ClassVar[str]
    depth: int
    total_tokens: int
    path: str | None = None
    top_k: int | None = None
    probe_left_unused: bool = False

    def bind(self, target: Any) -> None:
        pass

    def feature_layers(self) -> Sequence[int]:
        return ()

    def start(self, prompt_ids: Sequence[int], features: Any, next_token: int) -> None:
        pass

    @abstractmethod
    def draft(self, tree: DraftTree) -> Iterator[range]:
        ...

    def commit(self, tokens: Sequence[int], features: Any, next_token: int) -> None:
        pass


class SelectorBase(ABC):
    """Required: ``select(tree, ctx)``. Defaults: needs no other part (``requires = ()``), may
    choose any drafted node (``chooses_among_likeliest = False``), takes no acceptance estimator
    (``takes_estimator = False``, ``estimator = None``), reads no draft time (``draft_time = None``),
    has no draft gate (``gate = None``) and scores no estimates (``acceptance_score = None``),
    ``bind`` does nothing, ``should_draft()`` is always True, ``observe`` and ``observe_time``
    ignore what they are told."""

    name: ClassVar[str]
    requires: ClassVar[Sequence[str]] = ()
    chooses_among_likeliest: ClassVar[bool] = False
    takes_estimator: ClassVar[bool] = False
    estimator: Any = None
    draft_time: str | None = None
    gate: Any = None
    acceptance_score: Any = None

    def bind(self, spec: MoESpec) -> None:
        pass

    def should_draft(self) -> bool:
        return True

    @abstractmethod
    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection:
        ...

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        pass

    def observe_time(self, drafted: bool, committed: int, seconds: float) -> None:
        pass


class CostModelBase(ABC):
    """Constants measured by ``specfit calibrate``, held for a subclass's ``problem``.

    Defaults: ``calibration = "auto"`` (``specfit.build`` loads this setup's stored calibration, or
    measures it, and calls ``set_constants``); ``constants`` are those set, ``calibrated`` says
    whether any are; ``set_constants`` replaces them (the one change made to a part after it is
    built: by the calibration ``specfit.build`` attaches, or a replay's constants); ``bind`` keeps
    the spec as ``self.spec``; ``observe`` ignores cycles. ``problem`` refuses, naming the model: a cost model that does not state cycles as an
    expert-union :class:`~specfit.search.SearchProblem` can still serve selectors of your own,
    but not the cost-aware built-ins (``specfit``, ``greedy``, ``prefix``).
    """

    name: ClassVar[str]
    calibration: str | None = "auto"
    _constants: CostConstants | None = None

    def bind(self, spec: MoESpec) -> None:
        self.spec = spec

    @property
    def calibrated(self) -> bool:
        return self._constants is not None

    @property
    def constants(self) -> CostConstants:
        if self._constants is None:
            raise ConfigError(f"cost_model={self.name} is not calibrated: run `specfit calibrate` or set "
                              "cost_model.calibration=FILE")
        return self._constants

    def set_constants(self, constants: CostConstants) -> None:
        self._constants = constants

    def problem(self, tree: DraftTree, accept: np.ndarray, resident: np.ndarray,
                draft_seconds: float, arriving: np.ndarray | None = None) -> SearchProblem:
        raise ConfigError(f"cost_model={self.name} builds no selection problems, which the cost-aware selectors "
                          "(specfit, greedy, prefix) need: use cost_model=union with them")

    def observe(self, record: Any) -> None:
        pass


class ExpertCacheBase(ABC):
    """Required: ``bind(spec) -> slots per layer``, ``admit(layer, wanted)``, ``resident()``.
    Defaults: ``preload()`` copies nothing ahead, ``begin_pass()`` does nothing,
    ``admit_prefetch()`` admits nothing and ``can_prefetch`` is False (the cache cannot prefetch)."""

    name: ClassVar[str]
    can_prefetch: ClassVar[bool] = False

    @abstractmethod
    def bind(self, spec: MoESpec) -> int:
        ...

    def preload(self) -> list[tuple[int, int, int]]:
        return []

    def begin_pass(self) -> None:
        pass

    @abstractmethod
    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        ...

    @abstractmethod
    def resident(self) -> np.ndarray:
        ...

    def admit_prefetch(self, layer: int, candidates: list[int], protected: frozenset[int]) -> Admission:
        return Admission({}, [])


class ExpertPredictorBase(ABC):
    """Required: ``predict(tree, nodes)``. Defaults: ``bind`` and ``observe`` do nothing."""

    name: ClassVar[str]

    def bind(self, target: Any) -> None:
        pass

    @abstractmethod
    def predict(self, tree: DraftTree, nodes: Sequence[int]) -> None:
        ...

    def observe(self, tokens: Sequence[int], routing: np.ndarray) -> None:
        pass


class AcceptanceEstimatorBase(ABC):
    """Required: ``estimate(tree)``. Defaults: ``state_file = "auto"`` (its state is the setup's),
    ``bind`` and ``bind_target`` do nothing, ``observe`` ignores what it is told, ``state()`` keeps
    nothing (None) and ``load_state`` ignores what it is given."""

    name: ClassVar[str]
    state_file: str = "auto"

    def bind(self, spec: MoESpec) -> None:
        pass

    def bind_target(self, target: Any) -> None:
        pass

    @abstractmethod
    def estimate(self, tree: DraftTree) -> np.ndarray:
        ...

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        pass

    def state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: dict[str, Any]) -> None:
        pass


class PrefetcherBase(ABC):
    """Nothing required. Defaults: ``bind`` keeps the target and the sink (``self.target``,
    ``self.sink``), ``after_level`` prefetches nothing, ``needs_predictions`` is True,
    ``counters`` has none. A prefetcher of
    hidden states sets its hooks in ``bind``; one of draft predictions writes ``after_level``."""

    name: ClassVar[str]

    def bind(self, target: Any, sink: Any) -> None:
        self.target, self.sink = target, sink

    def after_level(self, tree: DraftTree, predicted: Sequence[int], resident: np.ndarray) -> None:
        pass

    def needs_predictions(self, tree: DraftTree) -> bool:
        """Whether the rest of this cycle's levels need expert predictions for this prefetcher."""
        return True

    def counters(self) -> dict[str, int]:
        """Counts kept since bind (e.g. passes a gate paused); each run reports what they grew by."""
        return {}
