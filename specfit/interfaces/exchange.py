"""What the hooks exchange: a cache's admission of a round, a selector's context and its answer.

Plain dataclasses, kept apart from the Protocols that use them (:mod:`specfit.interfaces.protocols`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


# SelectionContext.extra key under which a trace replay hands selectors the nodes the target will
# accept (tree node indices, root excluded): only the oracle selector reads it.
ACCEPTED_KEY = "trace_accepted"


@dataclass(frozen=True)
class Admission:
    """One round of a layer's pass: the experts that may compute now and the copies they need.

    ``slots`` maps every admitted expert to its device slot; ``loads`` lists the (expert, slot)
    pairs that must be copied in first (the misses). Experts already resident are hits.
    """

    slots: dict[int, int]
    loads: list[tuple[int, int]]


@dataclass
class SelectionContext:
    """What a selector may look at besides the tree."""

    resident: np.ndarray  # bool [layers, experts], cache residency when verification starts
    draft_seconds: float  # time this cycle has already spent (drafting and selecting)
    max_depth: int  # the drafter's depth limit (lower near the context limit)
    max_nodes: int  # the drafter's limit on verified nodes (EAGLE's total_tokens)
    cost_model: Any = None  # the run's CostModel (specfit.interfaces.CostModel), if one is configured
    # float [layers, experts]: seconds until each expert is usable (0.0 resident, > 0 in flight, inf
    # absent), from the offload runtime (or a replay's modelled link); None where nothing is known
    arriving: np.ndarray | None = None
    # what a particular run adds: a trace replay puts the path the target will accept under
    # ACCEPTED_KEY; a live run leaves it empty
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Selection:
    """The nodes to verify (ancestor-closed) and whether drafting should stop."""

    nodes: list[int]
    stop: bool = False
    predicted: dict[str, float] = field(default_factory=dict)  # e.g. rho, expected tokens, seconds
