"""Exact integer maximum flow / minimum cut (Dinic's algorithm), compiled with numba.

Capacities are int64 so the cut is exact: no round-off can leave a "nearly saturated" arc that
a float code would misjudge. scipy's `maximum_flow` narrows capacities to int32 and networkx works
in floats, so neither is used. The graphs built by the subtree search have a few hundred vertices
and arcs; Dinic with current-arc pointers and an iterative DFS is simple and fast at that size.

Residual graph layout (CSR): arcs leaving vertex u are `first[u] .. first[u+1]-1`; each input arc
i becomes a forward arc `fwd[i]` with the capacity and a reverse arc `rev[fwd[i]]` with capacity 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["MaxFlowResult", "max_flow"]


@dataclass
class MaxFlowResult:
    """value: the maximum flow (= minimum cut capacity); flow: int64[m] flow on each input arc;
    source_side: bool[n], the vertices reachable from the source in the final residual graph,
    i.e. the source side of the minimum cut with the fewest vertices."""

    value: int
    flow: np.ndarray
    source_side: np.ndarray


@njit(cache=True)
def build_residual(n: int, tails: np.ndarray, heads: np.ndarray, caps: np.ndarray):
    """CSR residual graph from an arc list: (first, head, cap, rev, fwd)."""
    m = tails.shape[0]
    first = np.zeros(n + 1, dtype=np.int64)
    for i in range(m):
        first[tails[i] + 1] += 1
        first[heads[i] + 1] += 1
    for u in range(n):
        first[u + 1] += first[u]
    pos = first[:n].copy()
    head = np.empty(2 * m, dtype=np.int64)
    cap = np.empty(2 * m, dtype=np.int64)
    rev = np.empty(2 * m, dtype=np.int64)
    fwd = np.empty(m, dtype=np.int64)
    for i in range(m):
        u = tails[i]
        v = heads[i]
        a = pos[u]
        pos[u] += 1
        b = pos[v]
        pos[v] += 1
        head[a] = v
        cap[a] = caps[i]
        rev[a] = b
        head[b] = u
        cap[b] = 0
        rev[b] = a
        fwd[i] = a
    return first, head, cap, rev, fwd


@njit(cache=True)
def _bfs_levels(first, head, cap, s, t, level, queue) -> bool:
    """Distance labels from s over arcs with residual capacity; True if t is reachable."""
    for u in range(level.shape[0]):
        level[u] = -1
    level[s] = 0
    queue[0] = s
    qh = 0
    qt = 1
    while qh < qt:
        u = queue[qh]
        qh += 1
        lu = level[u] + 1
        for a in range(first[u], first[u + 1]):
            v = head[a]
            if cap[a] > 0 and level[v] < 0:
                level[v] = lu
                if v == t:
                    return True
                queue[qt] = v
                qt += 1
    return False


@njit(cache=True)
def _blocking_flow(first, head, cap, rev, s, t, level, cur, path) -> int:
    """Saturate the level graph: iterative DFS with current-arc pointers (each arc is skipped at
    most once per phase); after an augmentation retreat only to the first saturated arc."""
    total = 0
    depth = 0
    u = s
    while True:
        if u == t:
            f = cap[path[0]]
            for i in range(1, depth):
                if cap[path[i]] < f:
                    f = cap[path[i]]
            for i in range(depth):
                a = path[i]
                cap[a] -= f
                cap[rev[a]] += f
            total += f
            for i in range(depth):
                if cap[path[i]] == 0:
                    depth = i
                    break
            u = s if depth == 0 else head[path[depth - 1]]
            continue
        advanced = False
        while cur[u] < first[u + 1]:
            a = cur[u]
            v = head[a]
            if cap[a] > 0 and level[v] == level[u] + 1 and (level[v] < level[t] or v == t):
                path[depth] = a
                depth += 1
                u = v
                advanced = True
                break
            cur[u] += 1
        if not advanced:
            if u == s:
                return total
            level[u] = -1  # dead end for the rest of this phase
            depth -= 1
            u = head[rev[path[depth]]]
            cur[u] += 1


@njit(cache=True)
def dinic(first, head, cap, rev, s: int, t: int) -> int:
    """Maximum s-t flow value; `cap` is turned into the final residual capacities in place."""
    n = first.shape[0] - 1
    level = np.empty(n, dtype=np.int64)
    queue = np.empty(n, dtype=np.int64)
    cur = np.empty(n, dtype=np.int64)
    path = np.empty(n, dtype=np.int64)
    total = 0
    if s == t:
        return 0
    while _bfs_levels(first, head, cap, s, t, level, queue):
        for u in range(n):
            cur[u] = first[u]
        total += _blocking_flow(first, head, cap, rev, s, t, level, cur, path)
    return total


@njit(cache=True)
def residual_reachable(first, head, cap, s: int) -> np.ndarray:
    """Vertices reachable from s through arcs with positive residual capacity."""
    n = first.shape[0] - 1
    seen = np.zeros(n, dtype=np.bool_)
    stack = np.empty(n, dtype=np.int64)
    seen[s] = True
    stack[0] = s
    top = 1
    while top > 0:
        top -= 1
        u = stack[top]
        for a in range(first[u], first[u + 1]):
            v = head[a]
            if cap[a] > 0 and not seen[v]:
                seen[v] = True
                stack[top] = v
                top += 1
    return seen


def max_flow(n_vertices: int, tails: np.ndarray, heads: np.ndarray, capacities: np.ndarray,
             source: int, sink: int) -> MaxFlowResult:
    """Maximum flow from `source` to `sink` on a directed graph given as an arc list.

    Capacities must be non-negative int64 whose sum fits in int64. Parallel arcs and
    antiparallel pairs are allowed.
    """
    tails = np.ascontiguousarray(tails, dtype=np.int64)
    heads = np.ascontiguousarray(heads, dtype=np.int64)
    caps = np.ascontiguousarray(capacities, dtype=np.int64)
    if not (tails.shape == heads.shape == caps.shape) or tails.ndim != 1:
        raise ValueError("tails, heads and capacities must be 1-d arrays of equal length")
    if caps.size and caps.min() < 0:
        raise ValueError("capacities must be non-negative")
    for arr in (tails, heads):
        if arr.size and (arr.min() < 0 or arr.max() >= n_vertices):
            raise ValueError("arc endpoints must lie in [0, n_vertices)")
    if not (0 <= source < n_vertices and 0 <= sink < n_vertices):
        raise ValueError("source and sink must be vertices")
    first, head, cap, rev, fwd = build_residual(n_vertices, tails, heads, caps)
    value = dinic(first, head, cap, rev, source, sink)
    flow = caps - cap[fwd]
    side = residual_reachable(first, head, cap, source)
    return MaxFlowResult(value=int(value), flow=flow, source_side=side)
