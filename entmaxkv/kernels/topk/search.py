"""Jit searches over int32 rank keys, shared by the top-k kernels.

A float32 rank maps to an int32 key with the same order (``sortable_key``);
forced pages rank +inf (INF_KEY), pages past the end are INT32_MIN. A bound
becomes a rank through ``page_rank`` (NaN -> -inf, +inf -> the largest
finite float), so NaN never reaches a key (a positive NaN's bits would sort
above INF_KEY, a negative one's below -inf) and no bound ties with a forced
page: the forced pages are always kept and a row is never empty.
"""
from __future__ import annotations

import triton
import triton.language as tl


# Module constants because jit functions read them as globals (fixed at compile time).
INT32_MIN = tl.constexpr(-2147483648)  # the key of pages past the end
INF_KEY = tl.constexpr(0x7F800000)  # sortable_key(+inf): forced pages


FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite float32


@triton.jit
def page_rank(b_u):
    """A page bound as a rank (the reference's policies.topk_rank): NaN ranks
    -inf (after every finite bound), +inf ranks as the largest finite float
    (below the forced pages' +inf)."""
    return tl.where(b_u == b_u, tl.minimum(b_u, FLT_MAX), float("-inf"))


@triton.jit
def sortable_key(x):
    """float32 -> int32 whose signed order is the float order."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def kth_largest(keys, K):
    """Largest T with count(keys >= T) >= K (int32), by bisection on the key
    bits between the smallest and the largest key, or the largest key below
    +inf's when fewer than K keys are +inf (forced pages rank +inf: without
    the clamp the range would span up to +inf's bits, ~30 steps instead of
    ~24 for keys within a few binades); keys need not be valid for K <= 0.
    (Counting several thresholds per step measured slower: with several
    programs per multiprocessor the search is bound by ALU work, not by
    its latency.)"""
    lo = tl.min(keys, axis=0)
    n_inf = tl.sum((keys >= INF_KEY).to(tl.int32))
    hi_fin = tl.max(tl.where(keys < INF_KEY, keys, lo), axis=0)
    hi = tl.where(n_inf >= K, tl.max(keys, axis=0), hi_fin).to(tl.int64)
    lo = lo.to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        c = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32))
        ge = c >= K
        lo = tl.where(ge, mid, lo)
        hi = tl.where(ge, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def kth_largest_nt(keys, K, NT: tl.constexpr, E: tl.constexpr):
    """kth_largest counting NT thresholds per round, spread over the open
    range (about log_NT of the range's size in rounds: 7 for 16 thresholds
    and keys within a few binades, against ~24): for one program per row,
    where the search waits on its reductions rather than on ALU work.
    NT = 1 is kth_largest's bisection.
    E >= 0 (NT > 1 only) stops early, at a lower bound: the returned T has
    count(keys >= T) >= K and either is the K-th largest key or has at most
    K + E keys at or above it. A pre-filter's bound needs no more, and the
    last rounds of an exact search only close in on the K-th key across the
    gap below it (E = 0 stops as soon as a threshold lands in that gap: the
    same keys reach it as reach the K-th key, barring ties). E < 0: exact."""
    if NT == 1:
        T = kth_largest(keys, K)
    else:
        lo = tl.min(keys, axis=0)
        n_inf = tl.sum((keys >= INF_KEY).to(tl.int32))
        hi_fin = tl.max(tl.where(keys < INF_KEY, keys, lo), axis=0)
        hi = tl.where(n_inf >= K, tl.max(keys, axis=0), hi_fin).to(tl.int64)
        lo = lo.to(tl.int64)
        o_t = tl.arange(0, NT).to(tl.int64)
        c_lo = tl.full([], 2147483647, tl.int32)  # count(keys >= lo) once a round has moved lo
        # invariant: count(keys >= lo) >= K > count(keys > hi)
        while (lo < hi) & (c_lo > K + E):
            mid = lo + 1 + (o_t * (hi - lo)) // NT  # in (lo, hi], non-decreasing
            c = tl.sum((keys[None, :] >= mid.to(tl.int32)[:, None]).to(tl.int32), axis=1)
            ge = c >= K
            lo = tl.max(tl.where(ge, mid, lo), axis=0)
            hi = tl.min(tl.where(ge, hi, mid - 1), axis=0)
            if E >= 0:  # counts fall as thresholds rise: lo's is the least of those >= K
                c_lo = tl.min(tl.where(ge, c, c_lo), axis=0)
        T = lo.to(tl.int32)
    return T


@triton.jit
def cut_from_below(keys, m_w, lo, K):
    """A cut T for _keep_top over the valid keys (m_w; all >= lo, at least K
    of them): at most K keys > T and at least K keys >= T. Found from below:
    T starts at lo and steps to the next larger key while more than K keys
    are above it. One count and one min per distinct key passed, so for
    tiles that hold only a few keys more than K (the search from above
    takes ~11 rounds of three reductions whatever the excess)."""
    T = lo
    n_gt = tl.sum((m_w & (keys > T)).to(tl.int32), axis=0)
    while n_gt > K:
        T = tl.min(tl.where(m_w & (keys > T), keys, 2147483647), axis=0)
        n_gt = tl.sum((m_w & (keys > T)).to(tl.int32), axis=0)
    return T


@triton.jit
def row_budget(n, sinks, window, k_pages, P: tl.constexpr):
    """(pages in use, pages forced, pages to keep) for a row of length n."""
    npages = (n + P - 1) // P
    wnd = tl.minimum(tl.maximum(window, 1), npages)
    sa = tl.minimum(sinks, npages)
    n_forced = sa + wnd - tl.maximum(sa - (npages - wnd), 0)
    k_row = tl.minimum(tl.maximum(n_forced, k_pages), npages)
    return npages, wnd, k_row


@triton.jit
def _keep_mask(b_key, m_w, T, k_row):
    """Of the valid keys m_w of a 1-D block: those > T, then ties at T (in
    block order) while fewer than k_row are kept."""
    m_gt = m_w & (b_key > T)
    m_eq = m_w & (b_key == T)
    n_gt = tl.sum(m_gt.to(tl.int32), axis=0)
    r_eq = tl.cumsum(m_eq.to(tl.int32), axis=0) - 1
    return m_gt | (m_eq & (r_eq < k_row - n_gt))


@triton.jit
def _gmax_block(p_row, p_gmax, o_g, NKP, GS: tl.constexpr, CACHE: tl.constexpr):
    """The largest key of groups o_g (those < NKP) of GS keys at p_row, into
    p_gmax[o_g]; keys loaded with cache modifier CACHE."""
    m_g = o_g < NKP
    b_key = tl.load(p_row + o_g[:, None] * GS + tl.arange(0, GS)[None, :], mask=m_g[:, None], other=INT32_MIN,
                    cache_modifier=CACHE)
    tl.store(p_gmax + o_g, tl.max(b_key, axis=1), mask=m_g)


@triton.jit
def _group_lb(gmax_ptr, i_r, NKP, k_row, NKP_P2: tl.constexpr, NT: tl.constexpr, E: tl.constexpr):
    """(group index, group maximum) tiles of row i_r and its lb: the k_row-th
    largest maximum (searched with NT thresholds per round; E >= 0: or a
    smaller key with at most k_row + E maxima at or above it,
    kth_largest_nt), INT32_MIN when fewer than k_row groups reach it (no
    filter)."""
    o_p = tl.arange(0, NKP_P2)
    b_gm = tl.load(gmax_ptr + i_r * NKP + o_p, mask=o_p < NKP, other=INT32_MIN)
    lb = kth_largest_nt(b_gm, k_row, NT, E)
    lb = tl.where(tl.sum((b_gm >= lb).to(tl.int32), axis=0) >= k_row, lb, INT32_MIN)
    return o_p, b_gm, lb
