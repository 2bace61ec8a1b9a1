"""Expert sets as bitsets (one uint64 word per 64 experts of a layer) and what a node set costs.

The numba kernels the exact search (:mod:`specfit.search.exact`) and its closure problem
(:mod:`specfit.search.closure`) share: the bitsets of each node's, the root's, the resident and the
arriving experts, the seconds of a set of items, the (N, T) of a node set in problem.evaluate's
summation order, and the marginal-ratio greedy. Split from the search so each part stays small;
the code is the same, so the search is bit-for-bit the same.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic



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
