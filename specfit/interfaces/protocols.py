"""The contracts of specfit's pluggable parts, one Protocol per kind.

A plugin class provides ``name`` (its registry and config-group name) and ``Config`` (a dataclass
that subclasses the kind's base config in :mod:`specfit.config`); the registry builds it from the
config fields that its constructor accepts. Objects built in code are used as they are.

Lifecycle: the engine calls ``bind`` once with the target's shape before the first generation,
then the per-cycle methods. All of this runs on the host; tensors stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

    from specfit.core.moe import MoESpec
    from specfit.core.tree import DraftTree


# --------------------------------------------------------------------------- expert caches


@dataclass(frozen=True)
class Admission:
    """One round of a layer's pass: the experts that may compute now and the copies they need.

    ``slots`` maps every admitted expert to its device slot; ``loads`` lists the (expert, slot)
    pairs that must be copied in first (the misses). Experts already resident are hits.
    """

    slots: dict[int, int]
    loads: list[tuple[int, int]]


@runtime_checkable
class ExpertCache(Protocol):
    """Residency policy: which experts of each MoE layer stay in device slots between passes.

    The offload runtime owns the slots and the copies; the policy only decides. Within one pass
    a layer asks ``admit`` repeatedly with the experts it still has to compute until all are done,
    so a policy may admit fewer experts than asked (when the union exceeds its slots) but at
    least one, and must never evict an expert it admitted in the same round.
    """

    name: ClassVar[str]

    def bind(self, spec: MoESpec) -> int:
        """Prepare for a model; return the number of device slots per layer to allocate."""

    def preload(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) copies to make once before the first pass (not counted as misses)."""

    def begin_pass(self) -> None:
        """A new forward pass of the target starts."""

    def admit(self, layer: int, wanted: Sequence[int]) -> Admission:
        """Admit some of ``wanted`` (distinct expert ids, ascending) for computation now."""

    def resident(self) -> np.ndarray:
        """bool [layers, experts]: experts resident now (the R_l of the cost model)."""


# --------------------------------------------------------------------------- drafting


@runtime_checkable
class Drafter(Protocol):
    """Proposes a draft tree after the last committed token, one level per step.

    ``depth`` bounds the tree's levels; ``total_tokens`` bounds the nodes a cycle may verify (EAGLE's
    reranking keeps the ``total_tokens`` nodes of highest path probability).
    """

    name: ClassVar[str]
    depth: int
    total_tokens: int

    def bind(self, target: Any) -> None:
        """Attach to the target (:class:`specfit.core.target.Target`): shapes, embeddings."""

    def feature_layers(self) -> Sequence[int]:
        """Hidden-state indices (HF ``hidden_states`` numbering) the drafter needs from the target."""

    def start(self, prompt_ids: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        """A new sequence: the prompt, the target's features at its positions, and the first
        generated token (the root of the first draft tree)."""

    def draft(self, tree: DraftTree) -> Iterator[range]:
        """Grow ``tree`` one level per iteration, yielding each new level's node range."""

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        """The target verified and kept ``tokens`` (the root, then the accepted path; ``features``
        are the target's at their positions) and produced ``next_token``, the next root."""


@dataclass
class SelectionContext:
    """What a selector may look at besides the tree."""

    resident: np.ndarray  # bool [layers, experts], cache residency when verification starts
    draft_seconds: float  # time this cycle has already spent (drafting and selecting)
    max_depth: int  # the drafter's depth limit
    max_nodes: int  # the drafter's limit on verified nodes (EAGLE's total_tokens)
    cost_model: CostModel | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Selection:
    """The nodes to verify (ancestor-closed) and whether drafting should stop."""

    nodes: list[int]
    stop: bool = False
    predicted: dict[str, float] = field(default_factory=dict)  # e.g. rho, expected tokens, seconds


@runtime_checkable
class Selector(Protocol):
    """Chooses the subtree to verify; called after every draft level.

    Optional: ``should_draft() -> bool``, asked before each cycle drafts; False skips drafting and
    verifies the root alone (a plain autoregressive step), e.g. while speculation does not pay.
    Optional: ``observe_time(drafted, committed, seconds)`` after each cycle, with its wall time
    (in a trace replay, the seconds the cost model charged).
    """

    name: ClassVar[str]

    def bind(self, spec: MoESpec) -> None: ...

    def select(self, tree: DraftTree, ctx: SelectionContext) -> Selection: ...

    def observe(self, tree: DraftTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """After verification: the nodes verified and those accepted (for learned acceptance)."""


@runtime_checkable
class CostModel(Protocol):
    """Predicts the seconds of a cycle that verifies a given subtree."""

    name: ClassVar[str]

    def bind(self, spec: MoESpec) -> None: ...

    def predict(self, tree: DraftTree, nodes: Sequence[int], resident: np.ndarray, draft_seconds: float) -> float: ...

    def observe(self, record: Any) -> None:
        """A measured cycle (:class:`specfit.core.stats.CycleRecord`), for online calibration."""


@runtime_checkable
class ExpertPredictor(Protocol):
    """Predicts, before verification, the experts each draft node will activate in each layer."""

    name: ClassVar[str]

    def bind(self, target: Any) -> None: ...

    def predict(self, tree: DraftTree, nodes: range) -> None:
        """Fill ``tree.experts`` for ``nodes`` (resizing it as needed)."""

    def observe(self, tokens: Sequence[int], routing: np.ndarray) -> None:
        """Actual routing of verified tokens: int [tokens, layers, top_k]."""


KINDS: dict[str, type] = {
    "drafter": Drafter,
    "selector": Selector,
    "cost_model": CostModel,
    "cache": ExpertCache,
    "predictor": ExpertPredictor,
}
