"""Exact maximum of predicted throughput rho(S) = N(S) / T(S) over ancestor-closed subtrees.

Method (docs/method.md section 3); the item bitsets and set evaluation are
:mod:`specfit.search.bitsets`, the pruning, folding and minimum cut at a fixed lambda
:mod:`specfit.search.closure`, and this module is Dinkelbach's loop, the surplus and the public API:

* Dinkelbach on the ratio. lambda starts at rho of the best known set (the empty set, a
  marginal-ratio greedy's set, the caller's `initial`); for fixed lambda, S' = argmax
  g(S) = N(S) - lambda * T(S); if rho(S') beats lambda, lambda <- rho(S') and repeat; otherwise
  max_S g(S) <= 0, so no S has rho(S) > lambda and the current set is optimal. The greedy start
  is usually optimal already, and then one cut certifies it.
* For fixed lambda, g is a maximum-weight closure problem: node v has profit a_v - lambda*c_tok and
  requires its parent; it requires each expert item (l, e) it activates; an item costs
  lambda*c_miss (lambda*(c_hit + wait) if resident, wait > 0 for an expert still in flight).
  One minimum s-t cut solves it (Picard 1976).
* Reductions, all exact (expert sets are bitsets, one uint64 per 64 experts of a layer):
  - items the root activates are always paid: they go into T(empty) and leave the graph; so do
    items that cost nothing (c_hit = 0 and resident, or c_miss = 0 and not);
  - an item need only be required by its topmost users (a node whose ancestor activates the same
    item gets it through the parent arcs): new[v] = own[v] minus the root's and ancestors' items;
  - an item with a single (surviving) topmost user is folded into that node's profit;
  - items required by the same set of nodes are merged into one vertex (weights add up);
  - bound pruning: if the best any closed part of v's subtree can add, counting node profits and
    folded items only, is <= 0 at lambda, v and its subtree are dropped: removing them from any S
    does not lower g at any lambda' >= lambda (profits only fall as lambda rises), and
    Dinkelbach's lambda only rises towards rho*. Pruning frees items (fewer users -> more
    folding -> more pruning); it is iterated to a fixpoint before each cut. At paper scale it
    usually leaves a handful of nodes, often none (then no cut is needed).
* Exact integer cuts. Capacities are the float profits/costs scaled so that the total positive
  profit maps to 2**61 units and rounded to int64; "infinite" arcs get (sum of source
  capacities + 1), which no minimum cut can contain, so nothing overflows. Each capacity is off
  by <= 1/2 unit, a cut by <= m/2 units (m finite arcs): ~m * 2**-62 of the total profit, far
  below the float round-off of the inputs. Tie-break: every node's profit is lowered by
  k = m + 1 units plus TIE_RTOL / (4 n) of the expected tokens N(all); k beats the rounding, so
  among sets with equal g the one with fewer nodes wins the cut, and the cut's source side is
  the inclusion-minimal maximiser. Since the optimal subtrees form a lattice (g is
  supermodular), this yields their intersection: the smallest optimal subtree.
* Acceptance in floats: a new set replaces the current one only if its ratio, recomputed in
  floats, rises by more than TIE_RTOL (relative); within TIE_RTOL it is a tie and the set with
  fewer nodes is kept. So rounding can never make the search accept a worse set, it terminates,
  and the returned rho is the maximum up to TIE_RTOL-sized float noise (the property tests
  compare with brute-force enumeration at 1e-9 and also check the tie-break).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from specfit.search.bitsets import _evaluate, _expert_bitsets, _greedy, _wait_bits
from specfit.search.closure import _maximise_at, _topmost
from specfit.search.problem import SearchProblem

__all__ = ["SearchResult", "TIE_RTOL", "greedy", "solve", "solve_surplus"]

TIE_RTOL = 1e-12
"""Ratios this close (relative) are treated as equal; the subtree with fewer nodes is kept."""

_MAX_ITER = 100  # Dinkelbach converges in a handful of rounds; this only guards against bugs.


@dataclass
class SearchResult:
    """The chosen subtree and how it was found.

    mask: bool[n] chosen nodes (ancestor-closed); rho = n_expected / time_cost, the predicted
    throughput in tokens/s; iterations: Dinkelbach rounds; maxflow_calls: min cuts actually run
    (a round whose pruning leaves no node needs none); max_depth: deepest chosen node (0 if none);
    depth_counts[d]: chosen nodes at depth d (index 0 is the root, always 0); graph_vertices /
    graph_arcs: the largest flow network built; surviving_nodes: nodes left by the last pruning.
    """

    mask: np.ndarray
    rho: float
    n_expected: float
    time_cost: float
    iterations: int
    maxflow_calls: int
    max_depth: int
    depth_counts: np.ndarray
    graph_vertices: int = 0
    graph_arcs: int = 0
    surviving_nodes: int = 0

    @property
    def size(self) -> int:
        return int(np.count_nonzero(self.mask))


# ----------------------------------------------------------------------------------------------
# the search kernels: Dinkelbach on the ratio, the surplus at a fixed rate, the greedy baseline


@njit(cache=True)
def _copy_into(dst, src):
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@njit(cache=True)
def _solve_kernel(parents, accept, node_experts, root_experts, resident, wait, c0, c_tok, c_miss,
                  c_hit, draft, allowed, initial, use_initial, merge, warm, tie_rtol, max_iter):
    n_layers = resident.shape[0]
    n_words = (resident.shape[1] + 63) >> 6
    own, root, res, arr, extra, alive, depth, new = _prepare(parents, node_experts, root_experts,
                                                             resident, wait, allowed, c_miss, c_hit)
    best, best_n, best_t, best_size = _start(alive, parents, accept, own, root, res, arr, extra, c0,
                                             c_tok, c_miss, c_hit, draft, initial, use_initial, warm,
                                             tie_rtol)
    (best_n, best_t, iterations, maxflow_calls, max_vertices, max_arcs,
     n_ok) = _dinkelbach(best, best_n, best_t, best_size, alive, parents, accept, own, root, res,
                         arr, extra, new, n_layers, n_words, c0, c_tok, c_miss, c_hit, draft, merge,
                         tie_rtol, max_iter)
    max_depth, depth_counts = _depth_counts(best, depth)
    return (best, best_n, best_t, iterations, maxflow_calls, max_depth, depth_counts,
            max_vertices, max_arcs, n_ok)


@njit(cache=True)
def _start(alive, parents, accept, own, root, res, arr, extra, c0, c_tok, c_miss, c_hit, draft,
           initial, use_initial, warm, tie_rtol):
    """Dinkelbach's first set: the empty set, replaced by the greedy set (``warm``) and then by
    ``initial`` (``use_initial``) where either's ratio beats it by more than tie_rtol. Returns
    (mask, N, T, |S|)."""
    n = parents.shape[0]
    best = np.zeros(n, dtype=np.bool_)
    best_n, best_t, best_size = _evaluate(best, accept, own, root, res, arr, extra, c0, c_tok,
                                          c_miss, c_hit, draft)
    if warm:
        g_mask, _gn, _gt = _greedy(alive, parents, accept, own, root, res, arr, extra, c_tok,
                                   c_miss, c_hit, best_n, best_t)
        i_n, i_t, i_size = _evaluate(g_mask, accept, own, root, res, arr, extra, c0, c_tok,
                                     c_miss, c_hit, draft)
        if i_n / i_t > (best_n / best_t) * (1.0 + tie_rtol):
            _copy_into(best, g_mask)
            best_n, best_t, best_size = i_n, i_t, i_size
    if use_initial:
        i_n, i_t, i_size = _evaluate(initial, accept, own, root, res, arr, extra, c0, c_tok,
                                     c_miss, c_hit, draft)
        if i_n / i_t > (best_n / best_t) * (1.0 + tie_rtol):
            _copy_into(best, initial)
            best_n, best_t, best_size = i_n, i_t, i_size
    return best, best_n, best_t, best_size


@njit(cache=True)
def _dinkelbach(best, best_n, best_t, best_size, alive, parents, accept, own, root, res, arr, extra,
                new, n_layers, n_words, c0, c_tok, c_miss, c_hit, draft, merge, tie_rtol, max_iter):
    """Dinkelbach from the set ``best`` (updated in place): maximise g at lambda = its ratio, keep
    the cut's set while its ratio rises by more than tie_rtol, a tie with fewer nodes, then stop.
    Pruning is cumulative: lambda never decreases. Returns (N, T, iterations, cuts run, the
    largest network's vertices and arcs, nodes left by the last pruning)."""
    n = parents.shape[0]
    node_ok = alive.copy()
    profit = np.zeros(n, dtype=np.float64)
    twice = np.zeros((n_layers, n_words), dtype=np.uint64)
    slot = np.full(n_layers * n_words * 64, -1, dtype=np.int64)
    iterations = 0
    maxflow_calls = 0
    max_vertices = 0
    max_arcs = 0
    n_ok = 0
    for _ in range(max_iter):
        iterations += 1
        lam = best_n / best_t
        cand, n_ok, cut, n_vert, n_arcs = _maximise_at(lam, node_ok, parents, accept, new, res, arr,
                                                       extra, c_tok, c_miss, c_hit, profit, twice,
                                                       slot, merge, tie_rtol)
        if cut:
            maxflow_calls += 1
            max_vertices = max(max_vertices, n_vert)
            max_arcs = max(max_arcs, n_arcs)

        c_n, c_t, c_size = _evaluate(cand, accept, own, root, res, arr, extra, c0, c_tok, c_miss,
                                     c_hit, draft)
        rho_best = best_n / best_t
        rho_cand = c_n / c_t
        if rho_cand > rho_best * (1.0 + tie_rtol):
            _copy_into(best, cand)
            best_n, best_t, best_size = c_n, c_t, c_size
            continue
        if rho_cand >= rho_best * (1.0 - tie_rtol) and c_size < best_size:
            _copy_into(best, cand)
            best_n, best_t, best_size = c_n, c_t, c_size
        break
    return best_n, best_t, iterations, maxflow_calls, max_vertices, max_arcs, n_ok


@njit(cache=True)
def _surplus_kernel(parents, accept, node_experts, root_experts, resident, wait, c0, c_tok,
                    c_miss, c_hit, draft, allowed, lam, merge, tie_rtol):
    """argmax g(S) = N(S) - lam * T(S) at a fixed lam: one pruning and one cut, no Dinkelbach.
    The cut's set is kept only if its surplus, recomputed in floats, beats the empty set's by
    more than tie_rtol (relative), so rounding can never return a worse set than verifying the
    root alone."""
    n = parents.shape[0]
    n_layers = resident.shape[0]
    n_words = (resident.shape[1] + 63) >> 6
    own, root, res, arr, extra, alive, depth, new = _prepare(parents, node_experts, root_experts,
                                                             resident, wait, allowed, c_miss, c_hit)
    node_ok = alive.copy()
    profit = np.zeros(n, dtype=np.float64)
    twice = np.zeros((n_layers, n_words), dtype=np.uint64)
    slot = np.full(n_layers * n_words * 64, -1, dtype=np.int64)
    cand, n_ok, cut, n_vert, n_arcs = _maximise_at(lam, node_ok, parents, accept, new, res, arr,
                                                   extra, c_tok, c_miss, c_hit, profit, twice,
                                                   slot, merge, tie_rtol)
    best = np.zeros(n, dtype=np.bool_)
    best_n, best_t, _size = _evaluate(best, accept, own, root, res, arr, extra, c0, c_tok, c_miss,
                                      c_hit, draft)
    c_n, c_t, _c_size = _evaluate(cand, accept, own, root, res, arr, extra, c0, c_tok, c_miss,
                                  c_hit, draft)
    if c_n - lam * c_t > best_n - lam * best_t + tie_rtol * c_n:
        _copy_into(best, cand)
        best_n, best_t = c_n, c_t
    max_depth, depth_counts = _depth_counts(best, depth)
    return (best, best_n, best_t, 1, 1 if cut else 0, max_depth, depth_counts, n_vert, n_arcs,
            n_ok)


@njit(cache=True)
def _prepare(parents, node_experts, root_experts, resident, wait, allowed, c_miss, c_hit):
    """What every search starts from: the expert bitsets, the in-flight waits, the nodes that may
    be chosen, their depths and each node's topmost items."""
    n_words = (resident.shape[1] + 63) >> 6
    own, root, res = _expert_bitsets(node_experts, root_experts, resident, n_words)
    arr, extra = _wait_bits(wait, n_words)
    alive = _alive(parents, allowed)
    new = _topmost(own, root, res, arr, parents, alive, c_miss, c_hit)
    return own, root, res, arr, extra, alive, _node_depths(parents), new


@njit(cache=True)
def _node_depths(parents):
    depth = np.zeros(parents.shape[0], dtype=np.int64)
    for v in range(parents.shape[0]):
        depth[v] = 1 if parents[v] < 0 else depth[parents[v]] + 1
    return depth


@njit(cache=True)
def _depth_counts(mask, depth):
    """(deepest chosen depth, chosen nodes per depth)."""
    max_depth = 0
    for v in range(mask.shape[0]):
        if mask[v] and depth[v] > max_depth:
            max_depth = depth[v]
    counts = np.zeros(max_depth + 1, dtype=np.int64)
    for v in range(mask.shape[0]):
        if mask[v]:
            counts[depth[v]] += 1
    return max_depth, counts


@njit(cache=True)
def _greedy_kernel(parents, accept, node_experts, root_experts, resident, wait, c0, c_tok, c_miss,
                   c_hit, draft, allowed):
    n = parents.shape[0]
    n_words = (resident.shape[1] + 63) >> 6
    own, root, res = _expert_bitsets(node_experts, root_experts, resident, n_words)
    arr, extra = _wait_bits(wait, n_words)
    alive = _alive(parents, allowed)
    n0, t0, _s = _evaluate(np.zeros(n, dtype=np.bool_), accept, own, root, res, arr, extra, c0,
                           c_tok, c_miss, c_hit, draft)
    mask, _n, _t = _greedy(alive, parents, accept, own, root, res, arr, extra, c_tok, c_miss,
                           c_hit, n0, t0)
    return mask


@njit(cache=True)
def _alive(parents, allowed):
    """Nodes that may be chosen: allowed, and so is every ancestor."""
    n = parents.shape[0]
    alive = np.zeros(n, dtype=np.bool_)
    for v in range(n):
        p = parents[v]
        alive[v] = allowed[v] and (p < 0 or alive[p])
    return alive


# ----------------------------------------------------------------------------------------------
# public API


def _allowed_mask(problem: SearchProblem, allowed: np.ndarray | None) -> np.ndarray:
    n = problem.n_nodes
    if allowed is None:
        return np.ones(n, dtype=np.bool_)
    arr = np.ascontiguousarray(allowed, dtype=np.bool_)
    if arr.shape != (n,):
        raise ValueError(f"allowed has shape {arr.shape}, expected ({n},)")
    return arr


def _result(kernel_output: tuple) -> SearchResult:
    """A search kernel's output tuple as a SearchResult."""
    (mask, n_exp, t_cost, iterations, calls, max_depth, depth_counts, n_vert, n_arcs,
     n_ok) = kernel_output
    return SearchResult(mask=mask, rho=n_exp / t_cost, n_expected=n_exp, time_cost=t_cost,
                        iterations=int(iterations), maxflow_calls=int(calls),
                        max_depth=int(max_depth), depth_counts=depth_counts,
                        graph_vertices=int(n_vert), graph_arcs=int(n_arcs),
                        surviving_nodes=int(n_ok))


def solve(problem: SearchProblem, allowed: np.ndarray | None = None,
          initial: np.ndarray | None = None, merge: bool = True,
          warm: bool = True) -> SearchResult:
    """The ancestor-closed subtree with the highest predicted throughput rho = N / T.

    allowed: optional bool[n]; only these nodes may be chosen (a node whose parent is not allowed
        cannot be chosen either), e.g. the nodes drafted so far.
    initial: optional ancestor-closed bool[n] within `allowed` (e.g. the previous draft level's
        answer); it only seeds Dinkelbach's lambda, the answer does not depend on it.
    merge, warm: merge items with identical user sets / start from the greedy set. Both are exact
        and on by default; switching them off is for tests and benchmarks.
    Ties (ratios within TIE_RTOL) resolve to the smallest optimal subtree.
    """
    n = problem.n_nodes
    allowed_arr = _allowed_mask(problem, allowed)
    if initial is None:
        init_arr = np.zeros(n, dtype=np.bool_)
        use_init = False
    else:
        init_arr = np.ascontiguousarray(initial, dtype=np.bool_)
        if init_arr.shape != (n,):
            raise ValueError(f"initial has shape {init_arr.shape}, expected ({n},)")
        sel = np.flatnonzero(init_arr)
        par = problem.parents[sel]
        if np.any(~allowed_arr[sel]) or np.any((par >= 0) & ~init_arr[np.maximum(par, 0)]):
            raise ValueError("initial must be ancestor-closed and within allowed")
        use_init = True
    return _result(_solve_kernel(problem.parents, problem.accept, problem.node_experts,
                                 problem.root_experts, problem.resident, problem.wait, problem.c0,
                                 problem.c_tok, problem.c_miss, problem.c_hit, problem.draft_time,
                                 allowed_arr, init_arr, use_init, merge, warm, TIE_RTOL, _MAX_ITER))


def solve_surplus(problem: SearchProblem, rate: float, allowed: np.ndarray | None = None,
                  merge: bool = True) -> SearchResult:
    """The ancestor-closed subtree maximising the surplus g(S) = N(S) - rate * T(S), exactly.

    This is the choice that maximises long-run throughput (tokens per second over many cycles)
    when ``rate`` is that long-run throughput: by the renewal-reward theorem a decode's rate is
    E[N] / E[T] over its cycles, and a cycle that maximises its own ratio N / T gives up tokens
    worth more than their time whenever its best ratio lies above the decode's rate (or takes a
    long cycle when it lies below). One pruning and one minimum cut at ``rate`` (Dinkelbach's
    inner problem); ties resolve to the smallest maximiser, and the set is kept only if its
    surplus, recomputed in floats, beats verifying the root alone.
    """
    if not (np.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive finite number of tokens per second, got {rate}")
    allowed_arr = _allowed_mask(problem, allowed)
    return _result(_surplus_kernel(problem.parents, problem.accept, problem.node_experts,
                                   problem.root_experts, problem.resident, problem.wait, problem.c0,
                                   problem.c_tok, problem.c_miss, problem.c_hit, problem.draft_time,
                                   allowed_arr, float(rate), merge, TIE_RTOL))


def greedy(problem: SearchProblem, allowed: np.ndarray | None = None) -> np.ndarray:
    """The marginal-ratio greedy subtree (EcoSpec-style baseline; also the exact search's start):
    from the empty set, add the frontier node with the best a_v / (marginal time) while that
    beats the current rho. Not optimal in general; returns the bool[n] mask."""
    allowed_arr = _allowed_mask(problem, allowed)
    return _greedy_kernel(problem.parents, problem.accept, problem.node_experts,
                          problem.root_experts, problem.resident, problem.wait, problem.c0,
                          problem.c_tok, problem.c_miss, problem.c_hit, problem.draft_time,
                          allowed_arr)
