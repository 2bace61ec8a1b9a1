"""Synthetic selection instances: paper-scale trees for the benchmark, small ones for tests.

Paper scale (docs/method.md sections 1 and 3): Qwen3-30B-A3B (48 layers, 128 experts, top-8, one
expert ~9.4 MB bf16) on PCIe 4.0 (~25 GB/s effective), so one expert miss costs ~0.38 ms; the
draft tree is EAGLE-2/3-shaped (root branches into `branching` children, a beam of `beam` nodes is
expanded per level for `depth` levels, the `n_nodes` best nodes by path probability are kept).
"""

from __future__ import annotations

import numpy as np

from specfit.search.problem import SearchProblem

__all__ = ["QWEN3_30B_PCIE4", "draft_tree", "child_experts", "paper_scale_problem",
           "random_small_problem"]

QWEN3_30B_PCIE4 = dict(
    c0=5.0e-3,                 # fixed cost of one target forward pass (s)
    c_tok=1.0e-4,              # per verified token (s)
    c_miss=9.4e6 / 25.0e9,     # one expert over the link: 9.4 MB at 25 GB/s = 0.376 ms
    c_hit=2.0e-5,              # a resident expert's compute share (s)
)


def draft_tree(rng: np.random.Generator, n_nodes: int = 64, branching: int = 10, beam: int = 10,
               depth: int = 7, draft_alpha: float = 0.02,
               vocab: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(parents int32[n], path_prob float64[n]) of an EAGLE-style draft tree.

    Each expanded node's children are the `branching` most likely tokens of a Dirichlet(alpha)
    distribution over `vocab` tokens. The default (alpha 0.02) gives a mean top-1 probability of
    ~0.72 and path probabilities summing to ~5.3 over a 64-node tree, an EAGLE-3-like acceptance
    length of ~6 if all were verified and accepted as predicted (alpha 0.05: ~0.52 and ~3.3).
    Nodes are returned in topological order (by depth, then by path probability).
    """
    par: list[int] = []
    prob: list[float] = []
    dep: list[int] = []

    def expand(parent: int, p_parent: float, d: int) -> list[int]:
        q = np.sort(rng.dirichlet(np.full(vocab, draft_alpha)))[::-1][:branching]
        out = []
        for qi in q:
            par.append(parent)
            prob.append(p_parent * float(qi))
            dep.append(d)
            out.append(len(par) - 1)
        return out

    frontier = expand(-1, 1.0, 1)
    for d in range(2, depth + 1):
        chosen = sorted(frontier, key=lambda i: -prob[i])[:beam]
        frontier = []
        for i in chosen:
            frontier += expand(i, prob[i], d)
    # keep the best n_nodes by path probability; shallower first on ties keeps it ancestor-closed
    order = sorted(range(len(par)), key=lambda i: (-prob[i], dep[i], i))[:n_nodes]
    keep = sorted(order, key=lambda i: (dep[i], -prob[i], i))
    new_id = {old: new for new, old in enumerate(keep)}
    parents = np.array([-1 if par[i] < 0 else new_id[par[i]] for i in keep], dtype=np.int32)
    path_prob = np.array([prob[i] for i in keep], dtype=np.float64)
    return parents, path_prob


def child_experts(rng: np.random.Generator, parent_experts: np.ndarray, n_experts: int,
                  overlap: float) -> np.ndarray:
    """A child's experts int32[L, K]: per layer it keeps round(overlap * K) of its parent's
    experts (chosen at random) and draws the rest uniformly from the experts it does not hold."""
    n_layers, top_k = parent_experts.shape
    n_keep = int(round(overlap * top_k))
    keys = rng.random((n_layers, top_k))
    kept = np.take_along_axis(parent_experts, np.argsort(keys, axis=1)[:, :n_keep], axis=1)
    scores = rng.random((n_layers, n_experts))
    np.put_along_axis(scores, kept, np.inf, axis=1)
    fresh = np.argpartition(scores, top_k - n_keep, axis=1)[:, : top_k - n_keep] if n_keep < top_k \
        else np.zeros((n_layers, 0), dtype=np.int64)
    return np.concatenate([kept, fresh], axis=1).astype(np.int32)


def paper_scale_problem(rng: np.random.Generator, n_nodes: int = 64, layers: int = 48,
                        experts: int = 128, top_k: int = 8, resident_frac: float = 0.3,
                        child_overlap: float = 0.5, draft_time: tuple[float, float] = (1e-3, 3e-3),
                        constants: dict | None = None, **tree_kw) -> SearchProblem:
    """A paper-scale instance: EAGLE-shaped tree, a_v = path probability, experts inherited from
    the parent with `child_overlap`, `resident_frac` of each layer's experts resident (uniformly
    at random), Qwen3-30B-A3B / PCIe 4.0 constants, D uniform in `draft_time` seconds."""
    parents, path_prob = draft_tree(rng, n_nodes=n_nodes, **tree_kw)
    n = len(parents)
    root = np.argsort(rng.random((layers, experts)), axis=1)[:, :top_k].astype(np.int32)
    node_experts = np.empty((n, layers, top_k), dtype=np.int32)
    for v in range(n):
        base = root if parents[v] < 0 else node_experts[parents[v]]
        node_experts[v] = child_experts(rng, base, experts, child_overlap)
    n_res = int(round(resident_frac * experts))
    resident = np.zeros((layers, experts), dtype=bool)
    np.put_along_axis(resident, np.argsort(rng.random((layers, experts)), axis=1)[:, :n_res],
                      True, axis=1)
    consts = dict(QWEN3_30B_PCIE4 if constants is None else constants)
    return SearchProblem(parents=parents, accept=path_prob, node_experts=node_experts,
                         root_experts=root, resident=resident,
                         draft_time=float(rng.uniform(*draft_time)), **consts)


def random_small_problem(rng: np.random.Generator, n_nodes: int | None = None, max_nodes: int = 10,
                         layers: int | None = None, experts: int | None = None,
                         top_k: int | None = None, accept_grid: bool = False) -> SearchProblem:
    """A small random instance for tests: random recursive tree, few layers/experts, -1 padding,
    random cache, constants over several orders of magnitude (misses sometimes free, sometimes
    ruinous). `accept_grid` draws a_v from a few values, which makes ties common."""
    n = int(rng.integers(0, max_nodes + 1)) if n_nodes is None else n_nodes
    n_layers = int(rng.integers(1, 4)) if layers is None else layers
    n_exp = int(rng.integers(1, 7)) if experts is None else experts
    k = int(rng.integers(1, 4)) if top_k is None else top_k
    parents = np.array([rng.integers(-1, v) if v else -1 for v in range(n)], dtype=np.int32)
    if accept_grid:
        accept = rng.choice([0.0, 0.25, 0.5, 1.0], size=n)
    else:
        accept = rng.random(n) ** 2
    node_experts = rng.integers(-1, n_exp, size=(n, n_layers, k)).astype(np.int32)
    root_experts = rng.integers(-1, n_exp, size=(n_layers, k)).astype(np.int32)
    resident = rng.random((n_layers, n_exp)) < rng.choice([0.0, 0.3, 1.0])
    scale = 10.0 ** rng.uniform(-5, -1, size=4)
    c_miss = float(scale[2])
    c_hit = c_miss if rng.random() < 0.25 else float(scale[3]) * rng.random()
    return SearchProblem(parents=parents, accept=accept, node_experts=node_experts,
                         root_experts=root_experts, resident=resident, c0=float(scale[0]),
                         c_tok=float(scale[1]) * rng.random(), c_miss=c_miss, c_hit=c_hit,
                         draft_time=float(rng.uniform(0, 1e-2)))
