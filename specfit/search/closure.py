"""The exact search's inner problem: the inclusion-minimal maximiser of g(S) = N(S) - lambda * T(S)
at a fixed lambda (:func:`_maximise_at`), as a maximum-weight closure.

Bound pruning and folding to a fixpoint (:func:`_prune`), the shared items as a CSR list
(:func:`_shared_items`), items with the same users merged (:func:`_merge_items`), then one exact
integer minimum cut (:func:`_closure_cut`); see the method in :mod:`specfit.search.exact`. Split
from Dinkelbach's loop so each part stays small; the numba code is the same, bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from specfit.search.bitsets import _ONE, _items_seconds, _lowest_bit, _popcount
from specfit.search.maxflow import build_residual, dinic, residual_reachable



@njit(cache=True)
def _topmost(own, root, res, arr, parents, alive, c_miss, c_hit):
    """new[v] = the items v activates that neither the root nor any ancestor activates: v is a
    topmost user of exactly these, and only topmost users need an arc to an item. Items that
    cost nothing (c_miss or c_hit is 0) constrain nothing and are left out."""
    n, n_layers, n_words = own.shape
    cover = np.empty_like(own)  # root's and v's ancestors' and v's own items
    zero = np.uint64(0)
    new = np.zeros_like(own)
    for v in range(n):
        if not alive[v]:
            continue
        p = parents[v]
        for ly in range(n_layers):
            for w in range(n_words):
                above = root[ly, w] if p < 0 else cover[p, ly, w]
                costly = (~res[ly, w] if c_miss > 0.0 else zero) | (res[ly, w] if c_hit > 0.0
                                                                     else zero) | arr[ly, w]
                new[v, ly, w] = own[v, ly, w] & ~above & costly
                cover[v, ly, w] = above | own[v, ly, w]
    return new


@njit(cache=True)
def _prune(lam, node_ok, parents, accept, new, res, arr, extra, c_tok, c_miss, c_hit, profit,
           twice):
    """Bound pruning and folding at lambda, to a fixpoint (see the module docstring).

    On return node_ok holds the surviving nodes, twice[ly, w] the items with >= 2 surviving
    topmost users (the shared ones) and profit[v] = a_v - lam * (c_tok + cost of v's private
    items) for the survivors.
    """
    n, n_layers, n_words = new.shape
    once = np.empty((n_layers, n_words), dtype=np.uint64)
    bound = np.empty(n, dtype=np.float64)
    while True:
        for ly in range(n_layers):
            for w in range(n_words):
                once[ly, w] = 0
                twice[ly, w] = 0
        for v in range(n):
            if node_ok[v]:
                for ly in range(n_layers):
                    for w in range(n_words):
                        x = new[v, ly, w]
                        twice[ly, w] |= once[ly, w] & x
                        once[ly, w] |= x
        for v in range(n):
            if not node_ok[v]:
                continue
            private = _items_seconds(new[v], twice, res, arr, extra, c_miss, c_hit)  # not shared with another node
            profit[v] = accept[v] - lam * (c_tok + private)
            bound[v] = profit[v]
        for v in range(n - 1, -1, -1):  # bound[v]: best closed part of v's subtree, v included
            p = parents[v]
            if node_ok[v] and p >= 0 and bound[v] > 0.0:
                bound[p] += bound[v]
        changed = False
        for v in range(n):
            p = parents[v]
            if node_ok[v] and (bound[v] <= 0.0 or (p >= 0 and not node_ok[p])):
                node_ok[v] = False
                changed = True
        if not changed:
            return


@njit(cache=True)
def _shared_items(node_ok, new, twice, res, extra, c_miss, c_hit, slot):
    """The shared items as a CSR list: (item weights, first, users); users of an item are sorted
    by node. `slot` (size L * W * 64, all -1) is scratch and is left all -1 again."""
    n, n_layers, n_words = new.shape
    n_pairs = 0
    for v in range(n):
        if node_ok[v]:
            for ly in range(n_layers):
                for w in range(n_words):
                    n_pairs += _popcount(new[v, ly, w] & twice[ly, w])
    pair_item = np.empty(n_pairs, dtype=np.int64)
    pair_node = np.empty(n_pairs, dtype=np.int64)
    item_bit = np.empty(n_pairs, dtype=np.int64)
    weight = np.empty(n_pairs, dtype=np.float64)
    n_items = 0
    j = 0
    for v in range(n):  # v-major, so each item's users come out sorted
        if not node_ok[v]:
            continue
        for ly in range(n_layers):
            for w in range(n_words):
                x = new[v, ly, w] & twice[ly, w]
                while x:
                    b = _lowest_bit(x)
                    x &= x - _ONE
                    bit = (ly * n_words + w) * 64 + b
                    if slot[bit] < 0:
                        slot[bit] = n_items
                        item_bit[n_items] = bit
                        resident = (res[ly, w] >> np.uint64(b)) & _ONE
                        weight[n_items] = c_hit + extra[ly, w * 64 + b] if resident else c_miss
                        n_items += 1
                    pair_item[j] = slot[bit]
                    pair_node[j] = v
                    j += 1
    first = np.zeros(n_items + 1, dtype=np.int64)
    for j in range(n_pairs):
        first[pair_item[j] + 1] += 1
    for i in range(n_items):
        first[i + 1] += first[i]
    users = np.empty(n_pairs, dtype=np.int64)
    pos = first[:n_items].copy()  # next free slot per item
    for j in range(n_pairs):
        i = pair_item[j]
        users[pos[i]] = pair_node[j]
        pos[i] += 1
    for i in range(n_items):
        slot[item_bit[i]] = -1
    return weight[:n_items], first, users


@njit(cache=True)
def _same_users(a, b, first, users) -> bool:
    if first[a + 1] - first[a] != first[b + 1] - first[b]:
        return False
    for t in range(first[a + 1] - first[a]):
        if users[first[a] + t] != users[first[b] + t]:
            return False
    return True


@njit(cache=True)
def _merge_items(weight, first, users):
    """Merge items with identical user lists: returns (group weights, representative item of each
    group), groups in order of first appearance. An open-addressing hash table keyed by an FNV-1a
    hash of the user list; equal hashes are confirmed by comparing the lists."""
    n_items = weight.shape[0]
    size = 4
    while size < 2 * n_items:
        size *= 2
    table = np.full(size, -1, dtype=np.int64)  # group id per slot
    hashes = np.empty(n_items, dtype=np.uint64)
    gweight = np.zeros(n_items, dtype=np.float64)
    grep = np.empty(n_items, dtype=np.int64)
    n_groups = 0
    mask = np.uint64(size - 1)
    for i in range(n_items):
        h = np.uint64(14695981039346656037)
        for j in range(first[i], first[i + 1]):
            h = (h ^ np.uint64(users[j] + 1)) * np.uint64(1099511628211)
        hashes[i] = h
        pos = np.int64(h & mask)
        while True:
            g = table[pos]
            if g < 0:
                table[pos] = n_groups
                grep[n_groups] = i
                gweight[n_groups] = weight[i]
                n_groups += 1
                break
            if hashes[grep[g]] == h and _same_users(grep[g], i, first, users):
                gweight[g] += weight[i]
                break
            pos = (pos + 1) & (size - 1)
    return gweight[:n_groups], grep[:n_groups]


@njit(cache=True)
def _closure_cut(lam, node_ok, parents, accept, profit, gweight, grep, first, users, tie_rtol):
    """Maximum-weight closure at lambda by one exact integer min cut.

    Vertices: 0 source, 1 sink, then the surviving nodes, then the item groups. Returns the
    source side's nodes (the inclusion-minimal maximiser of the rounded, tie-perturbed g),
    and the network's vertex and arc counts.
    """
    n = parents.shape[0]
    n_groups = gweight.shape[0]
    gid, n_ok, p_plus, n_all = _vertex_ids(node_ok, profit, accept)
    cand = np.zeros(n, dtype=np.bool_)
    pert = tie_rtol / (4.0 * n_ok) * n_all  # tie-break perturbation per node, in tokens
    if p_plus <= pert:
        return cand, 0, 0  # every perturbed profit is negative: the empty closure
    n_vert = 2 + n_ok + n_groups
    tails, heads, caps, m = _closure_network(lam, node_ok, parents, profit, gweight, grep, first, users, gid,
                                             n_ok, p_plus, pert)
    res_first, head, cap, rev, _fwd = build_residual(n_vert, tails[:m], heads[:m], caps[:m])
    dinic(res_first, head, cap, rev, 0, 1)
    side = residual_reachable(res_first, head, cap, 0)
    for v in range(n):
        if node_ok[v] and side[gid[v]]:
            cand[v] = True
    return cand, n_vert, m


@njit(cache=True)
def _vertex_ids(node_ok, profit, accept):
    """(vertex of each surviving node (2, 3, ...; -1 elsewhere), survivors, their total positive
    profit, 1 + their expected tokens)."""
    n = node_ok.shape[0]
    gid = np.full(n, -1, dtype=np.int64)
    n_ok = 0
    p_plus = 0.0
    n_all = 1.0
    for v in range(n):
        if node_ok[v]:
            gid[v] = 2 + n_ok
            n_ok += 1
            if profit[v] > 0.0:
                p_plus += profit[v]
            if accept[v] > 0.0:
                n_all += accept[v]
    return gid, n_ok, p_plus, n_all


@njit(cache=True)
def _closure_network(lam, node_ok, parents, profit, gweight, grep, first, users, gid, n_ok, p_plus, pert):
    """The flow network's arcs as (tails, heads, int64 capacities, arc count): the finite arcs first
    (one per node, to the source or the sink side, then one per item group to the sink), then the
    infinite ones (node -> parent, user -> item group)."""
    n_groups = gweight.shape[0]
    m_max = 2 * n_ok + n_groups
    for g in range(n_groups):
        m_max += first[grep[g] + 1] - first[grep[g]]
    tails = np.empty(m_max, dtype=np.int64)
    heads = np.empty(m_max, dtype=np.int64)
    caps = np.empty(m_max, dtype=np.int64)
    # finite arcs first: one per node (source or sink side), one per item group
    n_finite = n_ok + n_groups
    scale = 2.0 ** 61 / p_plus  # total positive profit -> 2**61 units: no int64 overflow
    k_tie = n_finite + 1 + np.int64(pert * scale)
    inf = _node_arcs(node_ok, profit, gid, n_ok, scale, k_tie, tails, heads, caps)
    for g in range(n_groups):
        x = lam * gweight[g] * scale
        tails[n_ok + g] = 2 + n_ok + g
        heads[n_ok + g] = 1
        caps[n_ok + g] = inf if x >= inf else min(np.int64(np.round(x)), inf)
    m = _requirement_arcs(node_ok, parents, grep, first, users, gid, n_ok, inf, n_finite, tails, heads, caps)
    return tails, heads, caps, m


@njit(cache=True)
def _node_arcs(node_ok, profit, gid, n_ok, scale, k_tie, tails, heads, caps):
    """Arcs 0..n_ok-1: each surviving node's scaled, tie-lowered profit, from the source when
    positive, else to the sink. Returns the "infinite" capacity, one more than the source's arcs
    together (no minimum cut contains it), to which those arcs are clipped."""
    src_total = 0
    a = 0
    for v in range(node_ok.shape[0]):
        if node_ok[v]:
            x = min(max(profit[v] * scale, -4.0e18), 4.0e18)
            c = np.int64(np.round(x)) - k_tie
            if c > 0:
                tails[a] = 0
                heads[a] = gid[v]
                caps[a] = c
                src_total += c
            else:
                tails[a] = gid[v]
                heads[a] = 1
                caps[a] = -c
            a += 1
    inf = src_total + 1  # exceeds the cut around the source, so no minimum cut contains it
    for a in range(n_ok):
        if caps[a] > inf:
            caps[a] = inf
    return inf


@njit(cache=True)
def _requirement_arcs(node_ok, parents, grep, first, users, gid, n_ok, inf, m, tails, heads, caps):
    """The infinite arcs from arc ``m`` on: a node requires its parent, a user its item group.
    Returns the arc count."""
    for v in range(node_ok.shape[0]):
        p = parents[v]
        if node_ok[v] and p >= 0:
            tails[m] = gid[v]
            heads[m] = gid[p]
            caps[m] = inf
            m += 1
    for g in range(grep.shape[0]):
        item = grep[g]
        for j in range(first[item], first[item + 1]):
            tails[m] = gid[users[j]]
            heads[m] = 2 + n_ok + g
            caps[m] = inf
            m += 1
    return m


@njit(cache=True)
def _maximise_at(lam, node_ok, parents, accept, new, res, arr, extra, c_tok, c_miss, c_hit,
                 profit, twice, slot, merge, tie_rtol):
    """The inclusion-minimal maximiser of g at lam over the nodes left in node_ok, which is pruned
    in place (bound pruning and folding, then one cut on what survives). Returns (mask,
    surviving nodes, whether a cut ran, its vertex and arc counts)."""
    n = parents.shape[0]
    _prune(lam, node_ok, parents, accept, new, res, arr, extra, c_tok, c_miss, c_hit, profit, twice)
    n_ok = 0
    for v in range(n):
        if node_ok[v]:
            n_ok += 1
    if n_ok == 0:
        return np.zeros(n, dtype=np.bool_), 0, False, 0, 0  # nothing can pay at lambda
    weight, first, users = _shared_items(node_ok, new, twice, res, extra, c_miss, c_hit, slot)
    if merge:
        gweight, grep = _merge_items(weight, first, users)
    else:
        gweight, grep = weight.copy(), np.arange(weight.shape[0])
    cand, n_vert, n_arcs = _closure_cut(lam, node_ok, parents, accept, profit, gweight, grep,
                                        first, users, tie_rtol)
    return cand, n_ok, True, n_vert, n_arcs
