"""The numba Dinic max-flow: a known graph, scipy on random graphs, int64 capacities."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from specfit.search.maxflow import max_flow


def check_flow(n, tails, heads, caps, s, t, res) -> None:
    """Feasible flow of the stated value, and the returned side is a cut of that capacity."""
    tails, heads, caps = map(np.asarray, (tails, heads, caps))
    assert np.all(res.flow >= 0) and np.all(res.flow <= caps)
    net = np.zeros(n, dtype=object)
    for u, v, f in zip(tails, heads, res.flow, strict=True):
        net[u] -= int(f)
        net[v] += int(f)
    for u in range(n):
        if u not in (s, t):
            assert net[u] == 0
    assert net[t] == res.value == -net[s]
    side = res.source_side
    assert side[s] and not side[t]
    cut = sum(int(c) for u, v, c in zip(tails, heads, caps, strict=True) if side[u] and not side[v])
    assert cut == res.value


def edmonds_karp(n, tails, heads, caps, s, t) -> int:
    """Plain-Python reference with unbounded ints."""
    cap: dict[tuple[int, int], int] = {}
    adj: list[set[int]] = [set() for _ in range(n)]
    for u, v, c in zip(tails, heads, caps, strict=True):
        cap[(u, v)] = cap.get((u, v), 0) + int(c)
        cap.setdefault((v, u), 0)
        adj[u].add(v)
        adj[v].add(u)
    total = 0
    while True:
        prev = {s: s}
        queue = deque([s])
        while queue and t not in prev:
            u = queue.popleft()
            for v in adj[u]:
                if v not in prev and cap[(u, v)] > 0:
                    prev[v] = u
                    queue.append(v)
        if t not in prev:
            return total
        path = []
        v = t
        while v != s:
            path.append((prev[v], v))
            v = prev[v]
        f = min(cap[e] for e in path)
        for u, v in path:
            cap[(u, v)] -= f
            cap[(v, u)] += f
        total += f


def test_known_graph() -> None:
    # CLRS figure 26.1: maximum flow 23
    arcs = [(0, 1, 16), (0, 2, 13), (2, 1, 4), (1, 3, 12), (3, 2, 9), (2, 4, 14), (4, 3, 7),
            (3, 5, 20), (4, 5, 4)]
    tails, heads, caps = map(np.array, zip(*arcs, strict=True))
    res = max_flow(6, tails, heads, caps, 0, 5)
    assert res.value == 23
    check_flow(6, tails, heads, caps, 0, 5, res)
    # the minimum cut with the fewest source-side vertices: {s, v1, v2, v4}
    assert np.flatnonzero(res.source_side).tolist() == [0, 1, 2, 4]


def test_degenerate_graphs() -> None:
    res = max_flow(2, np.array([]), np.array([]), np.array([]), 0, 1)
    assert res.value == 0 and res.source_side.tolist() == [True, False]
    res = max_flow(3, np.array([0, 1]), np.array([1, 0]), np.array([5, 7]), 0, 2)  # t unreachable
    assert res.value == 0 and res.source_side.tolist() == [True, True, False]
    with pytest.raises(ValueError):
        max_flow(2, np.array([0]), np.array([1]), np.array([-1]), 0, 1)
    with pytest.raises(ValueError):
        max_flow(2, np.array([0]), np.array([2]), np.array([1]), 0, 1)


@pytest.mark.parametrize("seed", range(60))
def test_random_graphs_against_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 40))
    m = int(rng.integers(0, 6 * n))
    tails = rng.integers(0, n, size=m)
    heads = rng.integers(0, n, size=m)
    keep = tails != heads  # scipy rejects self-loops on the diagonal
    tails, heads = tails[keep], heads[keep]
    caps = rng.integers(0, 1000, size=len(tails))
    s, t = 0, n - 1
    res = max_flow(n, tails, heads, caps, s, t)
    graph = csr_matrix((caps.astype(np.int32), (tails, heads)), shape=(n, n))  # sums duplicates
    assert res.value == maximum_flow(graph, s, t).flow_value
    check_flow(n, tails, heads, caps, s, t, res)


@pytest.mark.parametrize("seed", range(20))
def test_large_capacities(seed: int) -> None:
    """Capacities near 2**61 (the exact search's scale), beyond scipy's int32."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(3, 25))
    m = int(rng.integers(n, 5 * n))
    tails = rng.integers(0, n, size=m)
    heads = rng.integers(0, n, size=m)
    caps = rng.integers(0, 2**61 // m, size=m)
    caps[rng.random(m) < 0.3] = 1  # mix tiny and huge capacities
    res = max_flow(n, tails, heads, caps, 0, n - 1)
    assert res.value == edmonds_karp(n, tails.tolist(), heads.tolist(), caps.tolist(), 0, n - 1)
    check_flow(n, tails, heads, caps, 0, n - 1, res)
