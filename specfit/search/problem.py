"""The subtree-selection problem of docs/method.md section 2, and its reference evaluation.

A `SearchProblem` is plain data: a draft tree (parents, acceptance estimates), the experts each
node is predicted to activate, the cache state and the cost constants. `evaluate` is the slow,
obviously-correct definition of N(S), T(S) and rho(S) that the fast search and the tests are
checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SearchProblem", "evaluate", "is_ancestor_closed", "node_depths"]


@dataclass(frozen=True, eq=False)
class SearchProblem:
    """One selection instance.

    Arrays are converted to the listed dtypes (C-contiguous) but not copied when they already
    match, so the caller must not mutate them while the problem is in use.

    parents:      int32[n]        parent of each node, -1 for a child of the root; parent < child.
    accept:       float64[n]      a_v, probability that the target accepts the path to v.
    node_experts: int32[n, L, K]  experts node v activates in layer l; -1 pads "none".
    root_experts: int32[L, Kr]    experts the root (always verified) activates; -1 pads.
    resident:     bool[L, E]      experts resident in the device cache when verification starts.
    c0, c_tok, c_miss, c_hit:     cost constants in seconds (all >= 0).
    draft_time:   D, drafting time already spent in this cycle (seconds, >= 0).
    wait:         float64[L, E]   seconds a resident expert still makes its layer wait (an expert
                                  in flight when its layer runs: docs/method.md section 2); such an
                                  item costs c_hit + wait. None (the default) is all zeros; entries
                                  of experts that are not resident are ignored.
    """

    parents: np.ndarray
    accept: np.ndarray
    node_experts: np.ndarray
    root_experts: np.ndarray
    resident: np.ndarray
    c0: float
    c_tok: float
    c_miss: float
    c_hit: float
    draft_time: float = 0.0
    wait: np.ndarray | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("parents", np.ascontiguousarray(self.parents, dtype=np.int32).reshape(-1))
        put("accept", np.ascontiguousarray(self.accept, dtype=np.float64).reshape(-1))
        put("root_experts", np.ascontiguousarray(self.root_experts, dtype=np.int32))
        put("resident", np.ascontiguousarray(self.resident, dtype=np.bool_))
        n = self.parents.shape[0]
        if self.resident.ndim != 2:
            raise ValueError("resident must be bool[L, E]")
        n_layers = self.resident.shape[0]
        if self.root_experts.ndim != 2 or self.root_experts.shape[0] != n_layers:
            raise ValueError("root_experts must be int32[L, K] with L = resident.shape[0]")
        ne = np.asarray(self.node_experts)
        if ne.size == 0 and n == 0:
            ne = np.zeros((0, n_layers, self.root_experts.shape[1]), dtype=np.int32)
        put("node_experts", np.ascontiguousarray(ne, dtype=np.int32))
        if self.wait is None:
            put("wait", np.zeros(self.resident.shape, dtype=np.float64))
        else:
            wait = np.asarray(self.wait, dtype=np.float64)
            if wait.shape != self.resident.shape:
                raise ValueError(f"wait has shape {wait.shape}, expected {self.resident.shape}")
            put("wait", np.ascontiguousarray(np.where(self.resident, wait, 0.0)))
        for name in ("c0", "c_tok", "c_miss", "c_hit", "draft_time"):
            put(name, float(getattr(self, name)))
        self.validate()

    @property
    def n_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.resident.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.resident.shape[1])

    def validate(self) -> None:
        """Raise ValueError on inconsistent shapes, ids out of range or unusable constants."""
        n, n_layers, n_experts = self.n_nodes, self.n_layers, self.n_experts
        if self.accept.shape != (n,):
            raise ValueError(f"accept has shape {self.accept.shape}, expected ({n},)")
        if self.node_experts.ndim != 3 or self.node_experts.shape[:2] != (n, n_layers):
            raise ValueError(f"node_experts has shape {self.node_experts.shape}, "
                             f"expected ({n}, {n_layers}, K)")
        if n and (np.any(self.parents < -1) or np.any(self.parents >= np.arange(n))):
            raise ValueError("parents must satisfy -1 <= parents[v] < v (topological order)")
        for name, ids in (("node_experts", self.node_experts), ("root_experts", self.root_experts)):
            if ids.size and (ids.min() < -1 or ids.max() >= n_experts):
                raise ValueError(f"{name} ids must lie in [-1, {n_experts})")
        if not np.all(np.isfinite(self.accept)):
            raise ValueError("accept must be finite")
        consts = (self.c0, self.c_tok, self.c_miss, self.c_hit, self.draft_time)
        if not all(np.isfinite(c) and c >= 0.0 for c in consts):
            raise ValueError("cost constants and draft_time must be finite and >= 0")
        if not (np.all(np.isfinite(self.wait)) and np.all(self.wait >= 0.0)):
            raise ValueError("wait must be finite and >= 0")
        if _expected_and_time(self, np.zeros(n, dtype=bool))[1] <= 0.0:
            raise ValueError("T(empty set) must be positive: the objective is a ratio")


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node (1 for a child of the root), from a topologically ordered parent array."""
    depth = np.zeros(len(parents), dtype=np.int32)
    for v, p in enumerate(parents):
        depth[v] = 1 if p < 0 else depth[p] + 1
    return depth


def is_ancestor_closed(parents: np.ndarray, mask: np.ndarray) -> bool:
    """True if every selected node's parent is selected or is the root."""
    parents = np.asarray(parents)
    mask = np.asarray(mask, dtype=bool)
    sel = np.flatnonzero(mask)
    p = parents[sel]
    return bool(np.all((p < 0) | mask[np.maximum(p, 0)]))


def evaluate(problem: SearchProblem, mask: np.ndarray) -> tuple[float, float, float]:
    """(N(S), T(S), rho(S)) for the node set `mask`, straight from the definitions.

    Does not require `mask` to be ancestor-closed (the cost is defined for any set).
    """
    n_expected, time_cost = _expected_and_time(problem, mask)
    return n_expected, time_cost, n_expected / time_cost


def _expected_and_time(problem: SearchProblem, mask: np.ndarray) -> tuple[float, float]:
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (problem.n_nodes,):
        raise ValueError(f"mask has shape {mask.shape}, expected ({problem.n_nodes},)")
    n_layers, n_experts = problem.n_layers, problem.n_experts
    # U_l(S): root's and chosen nodes' experts per layer; the -1 padding lands in an extra
    # last column that is cut off
    chosen = problem.node_experts[mask].transpose(1, 0, 2).reshape(n_layers, -1)
    ids = np.concatenate([problem.root_experts, chosen], axis=1)
    covered = np.zeros((n_layers, n_experts + 1), dtype=bool)
    covered[np.arange(n_layers)[:, None], ids] = True
    covered = covered[:, :n_experts]
    n_hit = int(np.count_nonzero(covered & problem.resident))
    n_miss = int(np.count_nonzero(covered)) - n_hit
    waited = 0.0
    for x in problem.wait[covered & (problem.wait > 0.0)]:  # in order, as the fast search sums
        waited += float(x)
    size = int(np.count_nonzero(mask))
    n_expected = 1.0 + float(problem.accept[mask].sum())
    time_cost = (problem.c0 + problem.c_tok * (size + 1) + problem.c_miss * n_miss
                 + problem.c_hit * n_hit + waited + problem.draft_time)
    return n_expected, time_cost
