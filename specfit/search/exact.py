"""Exact maximum of predicted throughput rho(S) = N(S) / T(S) over ancestor-closed subtrees.

Method (docs/method.md section 3):

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
from numba import njit, types
from numba.extending import intrinsic

from specfit.search.maxflow import build_residual, dinic, residual_reachable
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
# bit tricks: expert sets are bitsets, one uint64 word per 64 experts of a layer


@intrinsic
def _popcount(typingctx, x):
    """Number of set bits of a uint64 (LLVM ctpop: one instruction on x86-64)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _lowest_bit(typingctx, x):
    """Index of the lowest set bit of a non-zero uint64 (LLVM cttz)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], context.get_constant(types.boolean, True))

    return sig, codegen


_ONE = np.uint64(1)


@njit(cache=True)
def _expert_bitsets(node_experts, root_experts, resident, n_words):
    """own[v, ly, w], root[ly, w], res[ly, w]: expert sets as bitsets (-1 entries ignored)."""
    n, n_layers, top_k = node_experts.shape
    n_experts = resident.shape[1]
    own = np.zeros((n, n_layers, n_words), dtype=np.uint64)
    own_rows = own.reshape(n * n_layers, n_words)  # views: flat loops are faster
    ids = node_experts.reshape(n * n_layers, top_k)
    for r in range(n * n_layers):
        for k in range(top_k):
            e = ids[r, k]
            if e >= 0:
                own_rows[r, e >> 6] |= _ONE << np.uint64(e & 63)
    root = np.zeros((n_layers, n_words), dtype=np.uint64)
    res = np.zeros((n_layers, n_words), dtype=np.uint64)
    for ly in range(n_layers):
        for k in range(root_experts.shape[1]):
            e = root_experts[ly, k]
            if e >= 0:
                root[ly, e >> 6] |= _ONE << np.uint64(e & 63)
        for w in range(n_words):
            word = np.uint64(0)
            for b in range(min(64, n_experts - 64 * w)):
                if resident[ly, 64 * w + b]:
                    word |= _ONE << np.uint64(b)
            res[ly, w] = word
    return own, root, res


@njit(cache=True)
def _wait_bits(wait, n_words):
    """arr[ly, w]: the items that cost c_hit + wait (wait > 0, an expert still in flight), and
    their waits as extra[ly, 64 w + b]. Usually empty; then every sum below adds 0.0."""
    n_layers, n_experts = wait.shape
    arr = np.zeros((n_layers, n_words), dtype=np.uint64)
    extra = np.zeros((n_layers, n_words * 64), dtype=np.float64)
    for ly in range(n_layers):
        for e in range(n_experts):
            if wait[ly, e] > 0.0:
                arr[ly, e >> 6] |= _ONE << np.uint64(e & 63)
                extra[ly, e] = wait[ly, e]
    return arr, extra


@njit(cache=True)
def _waited(x, ly, w, extra, total):
    """total plus the waits of the items in bitset word x, added one by one in ascending order
    (the order problem.evaluate adds them in, so the two agree to the last bit)."""
    while x:
        b = _lowest_bit(x)
        x &= x - _ONE
        total += extra[ly, w * 64 + b]
    return total


@njit(cache=True)
def _charge(x, ly, w, res, arr, extra, n_hit, n_miss, waited):
    """(n_hit, n_miss, waited) with the items of bitset word x added: resident ones as hits, the
    rest as misses, and the waits of those still arriving (every caller counts items this way)."""
    return (n_hit + _popcount(x & res[ly, w]), n_miss + _popcount(x & ~res[ly, w]),
            _waited(x & arr[ly, w], ly, w, extra, waited))


@njit(cache=True)
def _items_seconds(items, covered, res, arr, extra, c_miss, c_hit):
    """Seconds of the items in ``items`` [layers, words] that ``covered`` does not hold: a node's
    private items (pruning) or those it would add to a subtree (greedy)."""
    n_layers, n_words = items.shape
    n_miss = 0
    n_hit = 0
    waited = 0.0
    for ly in range(n_layers):
        for w in range(n_words):
            x = items[ly, w] & ~covered[ly, w]
            if x:
                n_hit, n_miss, waited = _charge(x, ly, w, res, arr, extra, n_hit, n_miss, waited)
    return c_miss * n_miss + c_hit * n_hit + waited


@njit(cache=True)
def _evaluate(mask, accept, own, root, res, arr, extra, c0, c_tok, c_miss, c_hit, draft):
    """(N, T, |S|) of a node set: the same formula and summation order for T as
    problem.evaluate, so the two agree to the last bit on T."""
    n_layers, n_words = root.shape
    size = 0
    n_exp = 0.0
    n_miss = 0
    n_hit = 0
    waited = 0.0
    for v in range(mask.shape[0]):
        if mask[v]:
            size += 1
            n_exp += accept[v]
    for ly in range(n_layers):
        for w in range(n_words):
            u = root[ly, w]
            for v in range(mask.shape[0]):
                if mask[v]:
                    u |= own[v, ly, w]
            n_hit, n_miss, waited = _charge(u, ly, w, res, arr, extra, n_hit, n_miss, waited)
    t = c0 + c_tok * (size + 1) + c_miss * n_miss + c_hit * n_hit + waited + draft
    return 1.0 + n_exp, t, size


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
    cand = np.zeros(n, dtype=np.bool_)
    pert = tie_rtol / (4.0 * n_ok) * n_all  # tie-break perturbation per node, in tokens
    if p_plus <= pert:
        return cand, 0, 0  # every perturbed profit is negative: the empty closure
    n_vert = 2 + n_ok + n_groups
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
    src_total = 0
    a = 0
    for v in range(n):
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
    for g in range(n_groups):
        x = lam * gweight[g] * scale
        tails[n_ok + g] = 2 + n_ok + g
        heads[n_ok + g] = 1
        caps[n_ok + g] = inf if x >= inf else min(np.int64(np.round(x)), inf)
    m = n_finite
    for v in range(n):
        p = parents[v]
        if node_ok[v] and p >= 0:
            tails[m] = gid[v]
            heads[m] = gid[p]
            caps[m] = inf
            m += 1
    for g in range(n_groups):
        item = grep[g]
        for j in range(first[item], first[item + 1]):
            tails[m] = gid[users[j]]
            heads[m] = 2 + n_ok + g
            caps[m] = inf
            m += 1
    res_first, head, cap, rev, _fwd = build_residual(n_vert, tails[:m], heads[:m], caps[:m])
    dinic(res_first, head, cap, rev, 0, 1)
    side = residual_reachable(res_first, head, cap, 0)
    for v in range(n):
        if node_ok[v] and side[gid[v]]:
            cand[v] = True
    return cand, n_vert, m


@njit(cache=True)
def _greedy(alive, parents, accept, own, root, res, arr, extra, c_tok, c_miss, c_hit, n0, t0):
    """Marginal-ratio greedy: from the empty set, repeatedly add the frontier node with the best
    ratio a_v / (marginal time) while that exceeds the current rho. Returns (mask, N, T)."""
    n, n_layers, n_words = own.shape
    cov = root.copy()
    mask = np.zeros(n, dtype=np.bool_)
    n_cur = n0
    t_cur = t0
    while True:
        best_v = -1
        best_ratio = n_cur / t_cur
        best_dt = 0.0
        for v in range(n):
            p = parents[v]
            if mask[v] or not alive[v] or (p >= 0 and not mask[p]):
                continue
            dt = c_tok + _items_seconds(own[v], cov, res, arr, extra, c_miss, c_hit)
            if accept[v] > best_ratio * dt:  # improves rho, and beats the best so far
                best_ratio = accept[v] / dt if dt > 0.0 else np.inf
                best_v = v
                best_dt = dt
        if best_v < 0 or (n_cur + accept[best_v]) / (t_cur + best_dt) <= n_cur / t_cur:
            return mask, n_cur, t_cur  # nothing raises rho (in floats, too)
        mask[best_v] = True
        n_cur += accept[best_v]
        t_cur += best_dt
        for ly in range(n_layers):
            for w in range(n_words):
                cov[ly, w] |= own[best_v, ly, w]


@njit(cache=True)
def _copy_into(dst, src):
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@njit(cache=True)
def _solve_kernel(parents, accept, node_experts, root_experts, resident, wait, c0, c_tok, c_miss,
                  c_hit, draft, allowed, initial, use_initial, merge, warm, tie_rtol, max_iter):
    n = parents.shape[0]
    n_layers = resident.shape[0]
    n_words = (resident.shape[1] + 63) >> 6
    own, root, res, arr, extra, alive, depth, new = _prepare(parents, node_experts, root_experts,
                                                             resident, wait, allowed, c_miss, c_hit)

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

    # Dinkelbach. Pruning is cumulative: lambda never decreases.
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

    max_depth, depth_counts = _depth_counts(best, depth)
    return (best, best_n, best_t, iterations, maxflow_calls, max_depth, depth_counts,
            max_vertices, max_arcs, n_ok)


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
