"""Quest top-k page selection fused with the bound computation.

Reference: ``entmaxkv.policies.select`` with ``TopK``. Shapes: B batch,
S selection heads (H, or HQ per query head), NG = HQ // S query heads per
selection row, M logical pages, K = pages kept per row, W = selection width.

A page's rank is its largest Quest bound over the NG heads of its selection
row; forced pages (the last page, ``sinks`` first and ``window`` last pages)
rank +inf, pages past the end are never kept. Each row keeps its
max(budget // P, forced) best pages. No sort and no torch.topk:

0. ``_keys_kernel`` (grid B x page blocks; one query head per KV head only):
   the rank keys of a block of pages for a group of heads per step, from
   contiguous reads of their k_min/k_max (packed cache layout), written to a
   [B*S, NCH*CH] key table; then ``_gmax_kernel`` (grid B*S x group blocks):
   the largest key of each of about gmax_groups (TopKConfig) page groups per row. The K-th
   largest group maximum lb is a lower bound on the row's K-th key (the
   pre-filter); ``_lb_kernel`` (grid B*S) finds it once per row.
1. ``_chunk_kernel`` (grid B*S x NCH): otherwise scores CH pages
   (CH = NSUB * BLOCK_M) of one row from k_min/k_max and maps each rank to an
   int32 key with the same order. With the pre-filter, a chunk with at most
   K keys >= lb keeps them all; otherwise it finds its K-th largest key by
   bisection on the key bits between max(lb, smallest key) and its largest
   key (about 24 counting passes over registers). It writes at most K
   candidates (key, page); with a single chunk, the Selection directly.
2. ``_merge_kernel`` (grid B*S): the same bisection (from lb) over the
   NCH * K candidate slots of a row (held in registers when they fit), then
   the kept pages in any order (the Selection contract allows unsorted pages).

For widths up to rowsel_max_w (except short rows with small budgets when
there are at least as many rows as SMs: ``use_rowsel``)
one ``_rowsel_kernel`` program per row (grid B*S) replaces steps 0's
_lb_kernel, 1 and 2: it finds lb from the group maxima, reads only the keys
of the groups whose maximum reaches lb and selects among those >= lb
(``launch_rowsel``).

The overlapped selection (``use_overlap``: batch >= 2, rows of at most
overlap_max_keys key slots, PDL): _keys_kernel runs in batch order and
raises a counter per batch row as its chunks are stored, and
_rowsel_kernel, launched without waiting for it, polls its batch row's
counter and takes the row's group maxima itself (no _gmax_kernel), so the
first batch rows are selected while the last are still being read.

Every stage writes fixed-shape buffers; nothing synchronises with the host
(the counters are zeroed by a memset and polled on the device).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...types import Pending, Selection
from ..config import TopKConfig, resolve
from .._common import (as_slopes, cdiv, grid_ids, interpreting, launch_count, launch_opts, next_pow2, num_sms,
                      pdl_start, poll_start, publish, store_b32)
from ..scoring import load_queries, meta_strides, page_bounds, page_rows, prep_query, score_plan

INT32_MIN = tl.constexpr(-2147483648)
INF_KEY = tl.constexpr(0x7F800000)  # sortable_key(+inf): forced pages
# (INT32_MIN, INF_KEY: read inside jit functions, so fixed at compile time)
# Every launch choice is a field of TopKConfig (kernels/config.py); the plan
# functions and launchers below take it from the caller's KernelConfig.

# ---------------------------------------------------------------------------
# heuristics
# ---------------------------------------------------------------------------


def topk_plan(c: TopKConfig, M: int, K: int, NG: int, D: int, q_dtype, cache_dtype, rows: int, sms: int,
              cap: int = 4096) -> dict:
    """Chunk size: as large as possible (up to 4096 pages), so that the
    bisection of a chunk is short next to its metadata read and the merge has
    few candidates, but small enough for two programs per multiprocessor."""
    cfg = score_plan(NG, D, q_dtype, cache_dtype)
    if cfg["USE_DOT"]:
        # half the scoring kernels' page block (32 pages at d 128): the chunk
        # kernel holds its keys too (experiments/logs/tune_select.log, GQA 4 x 128k /
        # 512k selection 71.5 -> 59.1 / 187.8 -> 161.8 us)
        cfg["BLOCK_M"] = max(16, min(cfg["BLOCK_M"], 4096 // cfg["BLOCK_D"]))
    if c.chunk_block_m:
        cfg["BLOCK_M"] = c.chunk_block_m
    block_m = cfg["BLOCK_M"]
    cap = 256 if interpreting() else cap
    ch = max(block_m, min(cap, next_pow2(M)))
    floor = max(block_m, min(ch, 1024, next_pow2(4 * K)))
    while ch > floor and rows * cdiv(M, ch) < c.chunk_progs * sms:
        ch //= 2
    # 4 warps on the tl.dot path at any chunk size (8 warps with 32-page
    # blocks: 242 vs 162 us at GQA 4 x 512k, experiments/logs/tune_select.log)
    warps = 4 if cfg["USE_DOT"] or ch < 2048 else 8
    cfg.update(CH=ch, NSUB=ch // block_m, NCH=cdiv(M, ch), WARPS=c.chunk_warps or warps,
               STAGES=c.chunk_stages)
    return cfg


def keys_plan(c: TopKConfig, B: int, MK: int, H: int, D: int, sms: int) -> dict:
    """_keys_kernel blocks: BLOCK_M pages x HG heads per step (about 16K
    values in registers), c.keys_ch pages per program (many short programs:
    a small last wave; experiments/logs/tune_keys.log). ``c.keys_tune``
    (benchmarks/tune_keys.py) overrides any entry."""
    hp = next_pow2(H)
    hg = H & -H  # the largest power of two dividing H: unmasked contiguous runs
    if hg * 4 < hp:
        hg = hp  # few heads per run: one masked step over all heads instead
    per_page = hg * 2 * next_pow2(D)
    block_m = max(1, min(32, 16384 // per_page))
    if interpreting():
        block_m = min(block_m, 16)
    plan = dict(BLOCK_M=block_m, KCH=max(block_m, c.keys_ch), HG=hg,
                WARPS=8 if block_m * per_page >= 8192 else 4)
    plan.update(dict(c.keys_tune))
    return plan


def merge_warps(n: int) -> int:
    """Warps of a merge holding n candidate slots in registers: 1 per 256 (at
    least 1, at most 8): its bisection is latency-bound, and fewer warps
    reduce with fewer cross-warp steps."""
    return max(1, min(8, n // 256))


def half_offset(first: torch.Tensor, second: torch.Tensor) -> int:
    """Element offset of a cache statistic from its partner (D for the packed layout)."""
    return (second.data_ptr() - first.data_ptr()) // first.element_size()


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _keys_chunk(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr, i_b, i_c,
    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off,
    M, MK, sinks, window, k_pages,
    H: tl.constexpr, HG: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, NSUB: tl.constexpr, HAS_ALIBI: tl.constexpr, WRITE_UB: tl.constexpr,
    AS_IS: tl.constexpr,
):
    """_keys_kernel's work for batch row i_b and page chunk i_c (a helper, so
    that a persistent grid could loop over chunks)."""
    KCH: tl.constexpr = NSUB * BLOCK_M
    NHG: tl.constexpr = (H + HG - 1) // HG
    NSTEP: tl.constexpr = NSUB * NHG
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    o_g = tl.arange(0, HG)
    o_2 = tl.arange(0, 2)
    o_d = tl.arange(0, BLOCK_D)
    o_in = ((o_g.to(tl.int64) * stride_mh)[:, None, None] + (o_2.to(tl.int64) * half_off)[None, :, None]
            + o_d[None, None, :])
    m_d = o_d < D
    for s in range(NSTEP):
        # step s: pages i_c * KCH + (s // NHG) * BLOCK_M + [0, BLOCK_M), heads o_h
        h0 = (s % NHG) * HG
        o_h = h0 + o_g
        m_h = o_h < H
        o_m = i_c * KCH + (s // NHG) * BLOCK_M + tl.arange(0, BLOCK_M)
        phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
        p_k = kmin_ptr + (phys * stride_mp + h0 * stride_mh)[:, None, None, None] + o_in[None, :, :, :]
        m_in = m_h[:, None, None] & (o_2 < 2)[None, :, None] & m_d[None, None, :]
        b_raw = tl.load(p_k, mask=m_v[:, None, None, None] & m_in[None, :, :, :], other=0.0)
        # the step's queries (and slopes) are reloaded per step: L1 hits
        b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qb + o_h[:, None] * stride_qh + o_d[None, :],
                      mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        # half 0 multiplies k_min (the negative part of q), half 1 k_max (the positive part)
        b_qq = tl.where((o_2 == 0)[None, :, None], tl.minimum(b_q, 0.0)[:, None, :],
                        tl.maximum(b_q, 0.0)[:, None, :])
        b_k = b_raw.to(tl.float32)
        b_u = tl.sum(tl.sum(b_k * b_qq[None, :, :, :], axis=3), axis=2) * scale  # [BLOCK_M, HG]
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + o_h, mask=m_h, other=0.0)
            pos_q = n - 1
            rel_first = (o_m * P - pos_q).to(tl.float32)
            rel_last = (o_m * P + n_tok - 1 - pos_q).to(tl.float32)
            b_u += tl.maximum(rel_first[:, None] * b_sl[None, :], rel_last[:, None] * b_sl[None, :])
        b_u = tl.where(m_v[:, None], b_u, float("-inf"))
        o_row = (i_b * H + o_h).to(tl.int64)
        if WRITE_UB:  # the certified policy's safe bound: u + rounding slack (scoring.bound_slack)
            b_kabs = tl.max(tl.abs(b_k), axis=2)  # [BLOCK_M, HG, BLOCK_D]
            b_mag = tl.sum(b_kabs * tl.abs(b_q)[None, :, :], axis=2) * scale
            if HAS_ALIBI:
                b_mag += tl.abs(b_sl)[None, :] * (n + 1).to(tl.float32)
            b_slack = (4.0 * (D + 4) * 1.1920928955078125e-07) * b_mag
            tl.store(ub_ptr + o_row[None, :] * M + o_m[:, None], b_u + b_slack,
                     mask=(o_m < M)[:, None] & m_h[None, :])
        forced = (o_m < sinks) | (o_m >= npages - wnd)
        b_rank = tl.where(forced[:, None], float("inf"), b_u)
        b_key = tl.where(m_v[:, None], sortable_key(b_rank), INT32_MIN)
        store_b32(key_ptr + o_row[None, :] * MK + o_m[:, None], b_key, (o_m < MK)[:, None] & m_h[None, :], AS_IS)


@triton.jit
def _keys_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off,
    M, MK, sinks, window, k_pages,
    H: tl.constexpr, HG: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, NSUB: tl.constexpr, HAS_ALIBI: tl.constexpr, WRITE_UB: tl.constexpr,
    AS_IS: tl.constexpr, cnt_ptr, PUBLISH: tl.constexpr, PDL: tl.constexpr,
):
    """Rank keys of KCH = NSUB * BLOCK_M pages for *all* heads of a batch row
    (one query head per KV head): each page's metadata of HG heads is read as
    one contiguous run (HG a power of two dividing H, or next_pow2(H) masked),
    one (page block, head group) per step. (Loading the next step's metadata
    before computing this step's keys measured no faster:
    experiments/logs/tune_keys.log.) Keys go to
    key_ptr[(b * H + h) * MK + page] (INT32_MIN past the end, up to
    MK = NCH * CH), in the layout _chunk_kernel reads with KEYS_READY.
    Grid (B, chunks); with PUBLISH (chunks, B), so that programs start in
    batch order, each raising int32 cnt[b] by one once its keys are stored
    (the overlapped selection, TopKConfig.overlap)."""
    pdl_start(PDL)
    i_b, i_c = grid_ids(PUBLISH)
    _keys_chunk(q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr, i_b, i_c,
                scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off, M, MK, sinks, window, k_pages,
                H, HG, P, D, BLOCK_D, BLOCK_M, NSUB, HAS_ALIBI, WRITE_UB, AS_IS)
    if PUBLISH:  # every thread's keys stored before the release that publishes them
        publish(cnt_ptr + i_b)


@triton.jit
def _gmax_kernel(key_ptr, gmax_ptr, ready_ptr, MK, NKP, NR, GS: tl.constexpr, GB: tl.constexpr,
                 ZERO: tl.constexpr, PDL: tl.constexpr):
    """The largest key of each group of GS pages of a key-table row
    (gmax[row * NKP + group], NKP = MK // GS groups): the pre-filter's group
    maxima. A pass of its own: carrying the maxima through _keys_kernel's
    loop measured 1.25x slower on that pass (146.6 vs 117.2 us at 1 x 2M),
    and holding a whole row per program (to find lb there too) 12.9 us where
    this pass and _lb_kernel take 3.4 + 4.8 us (8 x 128k). ZERO: the first
    program of row r also zeroes ready[r] and ready[NR + r] (the row's
    Pending.counters, which _rowsel_kernel raises after this launch)."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    _gmax_block(key_ptr + i_r * MK, gmax_ptr + i_r * NKP, tl.program_id(1) * GB + tl.arange(0, GB), NKP, GS, "")
    if ZERO:
        if tl.program_id(1) == 0:
            tl.store(ready_ptr + i_r, 0)
            tl.store(ready_ptr + NR + i_r, 0)


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


@triton.jit
def _lb_kernel(gmax_ptr, lb_ptr, ids_ptr, lens_ptr, NKP, sinks, window, k_pages,
               S: tl.constexpr, P: tl.constexpr, NKP_P2: tl.constexpr, NT: tl.constexpr, E: tl.constexpr,
               PDL: tl.constexpr):
    """lb of one row from its NKP group maxima: at most their k_row-th largest,
    with at least k_row (and, stopped early, at most k_row + E) maxima at or
    above it (_group_lb). They are keys of distinct pages, so >= k_row pages
    have key >= lb, the row's k_row-th key is >= lb, and no page below lb is
    ever kept (with fewer than k_row groups at or above it: INT32_MIN, no
    filter). Found once per row
    here instead of in each of the row's chunk programs, where the bisection
    over the maxima was most of _chunk_kernel's work (22.2 -> 11.0 us at
    1 x 2M)."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    seq = tl.load(ids_ptr + i_r // S).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    _o_p, _b_gm, lb = _group_lb(gmax_ptr, i_r, NKP, k_row, NKP_P2, NT, E)
    tl.store(lb_ptr + i_r, lb)


@triton.jit
def _chunk_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, kmax_ptr,
    key_ptr, ck_ptr, cp_ptr, cn_ptr, ub_ptr, pages_ptr, counts_ptr, lb_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh,
    HQ, G, M, W, sinks, window, k_pages,
    S: tl.constexpr, NG: tl.constexpr, NCH: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    PREFILTER: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, WRITE_UB: tl.constexpr, KEYS_READY: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = i_r // S
    h0 = (i_r % S) * NG
    kvh = h0 // G
    CH: tl.constexpr = BLOCK_M * NSUB
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    b_q, b_sl = load_queries(q_ptr, slopes_ptr, i_b, h0, stride_qb, stride_qh,
                             NG, D, BLOCK_G, BLOCK_D, HAS_ALIBI)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    p_key = key_ptr + (i_r.to(tl.int64) * NCH + i_c) * CH

    # -- 1. bounds -> rank keys of the chunk's pages (staged through L2);
    #       with KEYS_READY _keys_kernel has written them already
    if not KEYS_READY:
        o_m = i_c * CH + tl.arange(0, BLOCK_M)
        phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
        for j in range(NSUB):
            # the next block's physical pages are loaded before this block's
            # metadata is used, so the two dependent loads overlap
            o_m_nx = o_m + BLOCK_M
            phys_nx, m_v_nx, n_tok_nx = page_rows(bt_ptr, seq, n, o_m_nx, M, P)
            b_u, b_slack = page_bounds(b_q, b_sl, kmin_ptr, kmax_ptr, phys, m_v, n_tok, o_m, n - 1, kvh,
                                       scale, stride_mp, stride_mh, P, D, BLOCK_D, HAS_ALIBI,
                                       USE_DOT, DOT_F32, PREC, WRITE_UB)
            if WRITE_UB:  # the certified policy's safe bound: u + rounding slack
                o_u = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
                tl.store(ub_ptr + o_u, b_u + b_slack, mask=m_g[:, None] & (o_m < M)[None, :])
            b_rank = tl.max(tl.where(m_g[:, None], b_u, float("-inf")), axis=0)
            forced = (o_m < sinks) | (o_m >= npages - wnd)
            b_rank = tl.where(forced, float("inf"), b_rank)
            b_key = tl.where(m_v, sortable_key(b_rank), INT32_MIN)
            tl.store(p_key + j * BLOCK_M + tl.arange(0, BLOCK_M), b_key)
            o_m, phys, m_v, n_tok = o_m_nx, phys_nx, m_v_nx, n_tok_nx
    tl.debug_barrier()

    # -- 2. the chunk's k_row best pages
    o_k = tl.arange(0, CH)
    b_key = tl.load(p_key + o_k, cache_modifier=".cg")
    m_ok = b_key > INT32_MIN
    if PREFILTER:  # no page below lb (_lb_kernel) is kept
        lb = tl.load(lb_ptr + i_r)
    else:
        lb = tl.full([], INT32_MIN, tl.int32)
    m_in = m_ok & (b_key >= lb)
    if tl.sum(m_in.to(tl.int32)) > k_row:
        # more than k_row survivors: the chunk's k_row-th key (>= lb) by
        # bisection on the key bits between lb and the largest key, then every
        # key above it and ties at it up to k_row pages
        T = kth_largest(tl.maximum(b_key, lb), k_row)
        m_sel = _keep_mask(b_key, m_ok, T, k_row)
    else:  # every survivor is among the chunk's k_row best (the usual case past 64k tokens)
        m_sel = m_in
    n_sel = tl.sum(m_sel.to(tl.int32))
    o_page = i_c * CH + o_k
    if NCH == 1:
        i_out = tl.cumsum(m_sel.to(tl.int32), axis=0) - 1
        i_b64 = i_b.to(tl.int64)
        tl.store(pages_ptr + (i_b64 * S + i_r % S) * W + i_out, o_page, mask=m_sel)
        tl.store(counts_ptr + i_r, n_sel)
    else:
        if n_sel > 0:  # (past 1M tokens most chunks keep nothing: no prefix sum)
            i_out = tl.cumsum(m_sel.to(tl.int32), axis=0) - 1
            o_c = (i_r.to(tl.int64) * NCH + i_c) * W
            tl.store(ck_ptr + o_c + i_out, b_key, mask=m_sel)
            tl.store(cp_ptr + o_c + i_out, o_page, mask=m_sel)
        tl.store(cn_ptr + i_r * NCH + i_c, n_sel)


@triton.jit
def _emit(b_key, b_page, m_w, T, k_row, n_gt, n_eq, n_out, p_out, R: tl.constexpr, C: tl.constexpr):
    """Store the pages of a [R, C] tile with key > T, then ties at T while
    fewer than k_row pages are kept; returns the updated (n_eq, n_out)."""
    m_gt = m_w & (b_key > T)
    m_eq = m_w & (b_key == T) & (b_key > INT32_MIN)
    N: tl.constexpr = R * C
    shape: tl.constexpr = [R, C]
    f_eq = tl.reshape(m_eq.to(tl.int32), [N])
    r_eq = tl.reshape(tl.cumsum(f_eq, axis=0), shape) - 1 + n_eq
    m_sel = m_gt | (m_eq & (r_eq < k_row - n_gt))
    f_sel = tl.reshape(m_sel.to(tl.int32), [N])
    i_out = tl.reshape(tl.cumsum(f_sel, axis=0), shape) - 1 + n_out
    tl.store(p_out + i_out, b_page, mask=m_sel)
    return n_eq + tl.sum(f_eq, axis=0), n_out + tl.sum(f_sel, axis=0)


@triton.jit
def _merge_kernel(
    ids_ptr, lens_ptr, ck_ptr, cp_ptr, cn_ptr, pages_ptr, counts_ptr, lb_ptr,
    W, sinks, window, k_pages,
    NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK_W: tl.constexpr, S: tl.constexpr,
    P: tl.constexpr, ONE_TILE: tl.constexpr, PREFILTER: tl.constexpr, PDL: tl.constexpr,
):
    """Keep the row's k_row best of its chunks' candidates by bisection on the
    key bits, in registers (ONE_TILE) or in blocks from memory."""
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_b = i_r // S
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    o_c = tl.arange(0, NCH_P2)
    n_c = tl.load(cn_ptr + i_r * NCH + o_c, mask=o_c < NCH, other=0)
    p_row = (i_r.to(tl.int64) * NCH + o_c) * W  # [NCH_P2]
    p_out = pages_ptr + i_r.to(tl.int64) * W
    N: tl.constexpr = NCH_P2 * BLOCK_W
    zero = tl.zeros([], tl.int32)

    if ONE_TILE:
        # every candidate of the row fits in registers: load once, bisect there
        o_w = tl.arange(0, BLOCK_W)
        m_w = o_w[None, :] < n_c[:, None]
        b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
        b_page = tl.load(cp_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=0)
        # every candidate is >= the chunks' lower bound lb on the row's k_row-th
        # key: bisect between lb and the largest key (empty slots read as lb)
        if PREFILTER:
            lb = tl.load(lb_ptr + i_r)
        else:
            lb = tl.full([], INT32_MIN, tl.int32)
        T = kth_largest(tl.reshape(tl.where(m_w, b_key, lb), [N]), k_row)
        n_gt = tl.sum(tl.sum((m_w & (b_key > T)).to(tl.int32), axis=1), axis=0)
        _n_eq, n_out = _emit(b_key, b_page, m_w, T, k_row, n_gt, zero, zero, p_out, NCH_P2, BLOCK_W)
    else:
        max_n = tl.max(n_c, axis=0)
        # -- bisection on the key bits over every candidate of the row
        lo = tl.full([], INT32_MIN, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            c = tl.zeros([], tl.int32)
            for off in range(0, max_n, BLOCK_W):
                o_w = off + tl.arange(0, BLOCK_W)
                m_w = o_w[None, :] < n_c[:, None]
                b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
                c += tl.sum(tl.sum((m_w & (b_key >= mid.to(tl.int32))).to(tl.int32), axis=1), axis=0)
            ge = c >= k_row
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid - 1)
        T = lo.to(tl.int32)

        # -- emit: every key > T, then ties at T until k_row pages are kept
        n_gt = tl.zeros([], tl.int32)
        for off in range(0, max_n, BLOCK_W):
            o_w = off + tl.arange(0, BLOCK_W)
            m_w = o_w[None, :] < n_c[:, None]
            b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
            n_gt += tl.sum(tl.sum((m_w & (b_key > T)).to(tl.int32), axis=1), axis=0)
        n_out = zero
        n_eq = zero
        for off in range(0, max_n, BLOCK_W):
            o_w = off + tl.arange(0, BLOCK_W)
            m_w = o_w[None, :] < n_c[:, None]
            b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
            b_page = tl.load(cp_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=0)
            n_eq, n_out = _emit(b_key, b_page, m_w, T, k_row, n_gt, n_eq, n_out, p_out, NCH_P2, BLOCK_W)
    tl.store(counts_ptr + i_r, n_out)


@triton.jit
def _keep_top(b_key, m_w, T, k_row):
    """_keep_mask, with each kept key's output index and the count kept."""
    m_sel = _keep_mask(b_key, m_w, T, k_row)
    f_sel = m_sel.to(tl.int32)
    return m_sel, tl.cumsum(f_sel, axis=0) - 1, tl.sum(f_sel, axis=0)


@triton.jit
def _buffer_best(p_ck, p_cp, n_c, lb, k_row, N: tl.constexpr, NT: tl.constexpr):
    """The k_row best of the n_c <= N candidates (keys >= lb) at p_ck / p_cp:
    (keys, pages, kept mask, output index, count kept) and their k_row-th
    key T, searched with NT thresholds per round."""
    o_n = tl.arange(0, N)
    m_w = o_n < n_c
    f_key = tl.load(p_ck + o_n, mask=m_w, other=INT32_MIN)
    f_page = tl.load(p_cp + o_n, mask=m_w, other=0)
    T = kth_largest_nt(tl.where(m_w, f_key, lb), k_row, NT, -1)
    m_sel, i_out, n_sel = _keep_top(f_key, m_w, T, k_row)
    return f_key, f_page, m_sel, i_out, n_sel, T


@triton.jit
def _emit_best(p_ck, p_cp, n_c, lb, k_row, p_out, N: tl.constexpr, NT: tl.constexpr):
    """Store the pages of the k_row best of the n_c <= N candidates (keys
    >= lb) at p_ck / p_cp to p_out; returns how many were stored."""
    _f_key, f_page, m_sel, i_out, n_out, _T = _buffer_best(p_ck, p_cp, n_c, lb, k_row, N, NT)
    tl.store(p_out + i_out, f_page, mask=m_sel)
    return n_out


@triton.jit
def _append(p_ck, p_cp, n_c, b_key, b_page, m_in):
    """Store the keys and pages where m_in (1-D) to the candidate slots
    n_c, n_c + 1, ... in order."""
    i_out = n_c + tl.cumsum(m_in.to(tl.int32), axis=0) - 1
    tl.store(p_ck + i_out, b_key, mask=m_in)
    tl.store(p_cp + i_out, b_page, mask=m_in)


@triton.jit
def _select_row(
    p_row, gmax_ptr, g_row, p_gl, p_ck, p_cp, p_out, NKP, k_row,
    GS: tl.constexpr, NKP_P2: tl.constexpr, GB: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr,
    ONE_G: tl.constexpr, NT: tl.constexpr, FEW: tl.constexpr, E: tl.constexpr, CACHE: tl.constexpr,
):
    """_rowsel_kernel's selection of one row: keys at p_row (loaded with
    cache modifier CACHE), group maxima row g_row of gmax_ptr, scratch p_gl
    (NKP_P2 slots) and p_ck / p_cp (CAP slots); stores the kept pages at
    p_out[0:n] and returns n (a helper, so that another kernel can select
    a row too)."""
    # -- lb and the list of groups that can hold a kept page
    o_p, b_gm, lb = _group_lb(gmax_ptr, g_row, NKP, k_row, NKP_P2, NT, E)
    m_g = (b_gm >= lb) & (b_gm > INT32_MIN)
    i_g = tl.cumsum(m_g.to(tl.int32), axis=0) - 1
    tl.store(p_gl + i_g, o_p, mask=m_g)
    n_grp = tl.sum(m_g.to(tl.int32), axis=0)
    tl.debug_barrier()  # the group list is read back by other threads
    # -- candidates: keys >= lo of the listed groups
    BLK: tl.constexpr = GB * GS
    o_j = tl.arange(0, GB)
    o_s = tl.arange(0, GS)
    lo = lb
    n_c = tl.zeros([], tl.int32)
    n_end = n_grp
    done = tl.zeros([], tl.int32)
    n_out = tl.zeros([], tl.int32)
    if n_grp <= ONE_G:
        # the usual case: every listed group in one tile and at most SMALL
        # keys >= lb in them (one round trip for the ids and keys, no loop)
        o_q = tl.arange(0, ONE_G)
        m_q = o_q < n_grp
        g_q = tl.load(p_gl + o_q, mask=m_q, other=0)
        b_q = tl.load(p_row + g_q[:, None] * GS + o_s[None, :], mask=m_q[:, None], other=INT32_MIN,
                      cache_modifier=CACHE)
        m_qi = tl.reshape((b_q >= lb) & (b_q > INT32_MIN), [ONE_G * GS])
        c_q = tl.sum(m_qi.to(tl.int32), axis=0)
        f_q = tl.reshape(b_q, [ONE_G * GS])
        f_pg = tl.reshape(g_q[:, None] * GS + o_s[None, :], [ONE_G * GS])
        if (FEW >= 0) & (c_q - k_row <= FEW):
            # few keys past the budget: the cut from below, over the tile as loaded
            T = cut_from_below(f_q, m_qi, lb, k_row)
            m_sel, i_out, n_out = _keep_top(f_q, m_qi, T, k_row)
            tl.store(p_out + i_out, f_pg, mask=m_sel)
            done = tl.full([], 1, tl.int32)
            n_end = 0
        elif c_q <= SMALL:
            _append(p_ck, p_cp, n_c, f_q, f_pg, m_qi)
            n_c = c_q
            n_end = 0
    m_j = o_j < n_end
    g_id = tl.load(p_gl + o_j, mask=m_j, other=0)
    b_nx = tl.load(p_row + g_id[:, None] * GS + o_s[None, :], mask=m_j[:, None], other=INT32_MIN,
                   cache_modifier=CACHE)
    for j in range(0, n_end, GB):
        b_key = b_nx
        b_page = tl.reshape(g_id[:, None] * GS + o_s[None, :], [BLK])
        # the next step's group ids and keys, in flight while this step runs
        m_j = (j + GB + o_j) < n_end
        g_id = tl.load(p_gl + j + GB + o_j, mask=m_j, other=0)
        b_nx = tl.load(p_row + g_id[:, None] * GS + o_s[None, :], mask=m_j[:, None], other=INT32_MIN,
                       cache_modifier=CACHE)
        b_key = tl.reshape(b_key, [BLK])
        m_in = (b_key >= lo) & (b_key > INT32_MIN)
        c = tl.sum(m_in.to(tl.int32), axis=0)
        if n_c + c > CAP:
            # cut the buffer (n_c > CAP - BLK >= k_row keys) to its k_row best
            tl.debug_barrier()
            f_key, f_page, m_sel, i_out, n_c, T = _buffer_best(p_ck, p_cp, n_c, lb, k_row, CAP, 1)
            tl.debug_barrier()  # every slot is read before any is rewritten
            tl.store(p_ck + i_out, f_key, mask=m_sel)
            tl.store(p_cp + i_out, f_page, mask=m_sel)
            lo = tl.where(T < 2147483647, T + 1, T)
            m_in = (b_key >= lo) & (b_key > INT32_MIN)
            c = tl.sum(m_in.to(tl.int32), axis=0)
        if c > 0:
            _append(p_ck, p_cp, n_c, b_key, b_page, m_in)
            n_c += c
    # -- the row's k_row best candidates (at least k_row are held)
    if done == 0:
        tl.debug_barrier()
        if n_c <= SMALL:  # a short tile, NT thresholds per round
            n_out = _emit_best(p_ck, p_cp, n_c, lb, k_row, p_out, SMALL, NT)
        else:
            n_out = _emit_best(p_ck, p_cp, n_c, lb, k_row, p_out, CAP, 1)
    return n_out


@triton.jit
def _row_gmax(p_row, p_gmax, NKP, GS: tl.constexpr, GT: tl.constexpr):
    """The largest key of each of the NKP groups of GS keys at p_row (keys
    other programs stored: read past L1), into p_gmax[0:NKP]; GT groups per
    step."""
    for g0 in range(0, NKP, GT):
        _gmax_block(p_row, p_gmax, g0 + tl.arange(0, GT), NKP, GS, ".cg")
    tl.debug_barrier()  # the maxima are read back by other threads


@triton.jit
def _rowsel_kernel(
    ids_ptr, lens_ptr, key_ptr, gmax_ptr, glist_ptr, ck_ptr, cp_ptr, pages_ptr, counts_ptr, cnt_ptr, ready_ptr,
    MK, NKP, W, sinks, window, k_pages, NCHK,
    S: tl.constexpr, P: tl.constexpr, GS: tl.constexpr, NKP_P2: tl.constexpr,
    GB: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, ONE_G: tl.constexpr, NT: tl.constexpr,
    FEW: tl.constexpr, E: tl.constexpr, POLL: tl.constexpr, GT: tl.constexpr, POLLS: tl.constexpr,
    READY: tl.constexpr, PDL: tl.constexpr,
):
    """A whole row's selection in one program, from its key table and group
    maxima (_gmax_kernel): lb as _lb_kernel finds it (E = 0: the same groups
    reach it as reach the k_row-th largest maximum); then only the groups
    whose maximum reaches lb are read, GB groups of GS keys per step (the
    next step's keys loaded before this step's are used), and their keys
    >= lb are appended to a CAP-slot candidate buffer (ck/cp, scratch in
    L2). When a step would overflow it,
    the buffer is cut to its k_row best (its k_row-th key T, searched) and
    from then on only keys > T are taken: k_row keys >= T are already held,
    so a later key equal to T is only a tie, and ties may be kept in any
    order. Last, the same cut over the buffer emits the row's pages. The
    usual row (every listed group in one tile, at most FEW keys >= lb past
    its budget: lb is the k_row-th largest group maximum, so only groups
    holding two of the best keys add any) is cut in registers from below
    (cut_from_below) and emitted with no buffer at all.
    Replaces _lb_kernel + _chunk_kernel + _merge_kernel (three dependent
    launches) when CAP >= GB * GS + next_pow2(W).
    POLL (the overlapped selection): a PDL launch that does not wait for the
    keys pass: it waits for cnt[b] to reach NCHK (every chunk of batch row
    b published), then takes the row's group maxima (GT groups per step)
    itself and reads the keys past L1.
    READY: then raise ready[row] (int32, zeroed by the caller) to 1 once the
    row's pages and count are stored, for an attention launch that polls
    it (AttentionConfig.poll_ready) instead of waiting for this whole grid."""
    i_r = tl.program_id(0).to(tl.int64)
    if POLL:
        # not pdl_start: this launch may begin before the keys pass ends (it is
        # scheduled only once every keys program has passed its own pdl_start, so
        # every launch before that pass has ended); it waits for its batch row
        poll_start(cnt_ptr + i_r // S, NCHK, POLLS, PDL)
        _row_gmax(key_ptr + i_r * MK, gmax_ptr + i_r * NKP, NKP, GS, GT)
    else:
        pdl_start(PDL)
    seq = tl.load(ids_ptr + i_r // S).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    n_out = _select_row(key_ptr + i_r * MK, gmax_ptr, i_r, glist_ptr + i_r * NKP_P2, ck_ptr + i_r * CAP,
                        cp_ptr + i_r * CAP, pages_ptr + i_r * W, NKP, k_row,
                        GS, NKP_P2, GB, CAP, SMALL, ONE_G, NT, FEW, E, ".cg" if POLL else "")
    tl.store(counts_ptr + i_r, n_out)
    if READY:  # the row's pages and count, for an attention launch that polls it
        publish(ready_ptr + i_r)


# ---------------------------------------------------------------------------
# launcher / public function
# ---------------------------------------------------------------------------


def launch_keys(q, sl, ids, cache, keys, ub, MK: int, scale: float, sinks: int, window: int,
                k_pages: int, *, has_alibi: bool, c: TopKConfig, cnt: Optional[torch.Tensor] = None,
                pdl: bool = True) -> dict:
    """Launch _keys_kernel (one query head per KV head): rank keys of every
    page and head into ``keys`` [B * H * MK] int32 and, when ``ub`` is given,
    the certified bounds into it. ``sl``: as_slopes output; ``ids``: int32
    cache slots; ``cnt``: int32 [B] zeros, or None: raised by one per chunk
    of keys stored, in batch order (the overlapped selection; a batch row
    is complete at cdiv(MK, plan["KCH"])). Returns the keys_plan used
    (benchmarks/tune_keys.py times this launch alone)."""
    B, _, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    M = cache.block_table.shape[1]
    smp, smh = meta_strides(cache)
    kp = keys_plan(c, B, MK, H, D, num_sms(q.device))
    opts = launch_opts(q.device, pdl)
    nchk = cdiv(MK, kp["KCH"])
    _keys_kernel[(nchk, B) if cnt is not None else (B, nchk)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_min, keys, ub if ub is not None else keys,
        float(scale), q.stride(0), q.stride(1), smp, smh, half_offset(cache.k_min, cache.k_max),
        M, MK, int(sinks), int(window), k_pages,
        H=H, HG=kp["HG"], P=P, D=D, BLOCK_D=next_pow2(D),
        BLOCK_M=kp["BLOCK_M"], NSUB=kp["KCH"] // kp["BLOCK_M"],
        HAS_ALIBI=has_alibi, WRITE_UB=ub is not None, AS_IS=c.keys_as_is,
        cnt_ptr=cnt if cnt is not None else keys, PUBLISH=cnt is not None, num_warps=kp["WARPS"], **opts,
    )
    return kp


def gmax_groups(MK: int, CH: int, groups: int) -> Tuple[int, int]:
    """(NKP, group size) of about ``groups`` groups per row of MK key slots
    (the size a power of two dividing CH pages)."""
    gs = min(CH, next_pow2(cdiv(MK, groups)))
    return MK // gs, gs


def launch_gmax(keys: torch.Tensor, rows: int, MK: int, CH: int, groups: int, opts: dict, c: TopKConfig,
                ready: Optional[torch.Tensor] = None):
    """_gmax_kernel over a [rows, MK] key table: the largest key of each of
    about ``groups`` groups per row (gmax_groups); ``ready``: int32 [2, rows]
    counters to zero on the way, or None.
    Returns (gmax int32 [rows * NKP], NKP, group size)."""
    NKP, gs = gmax_groups(MK, CH, groups)
    gb = max(1, c.gmax_keys // gs)
    gmax = torch.empty(rows * NKP, dtype=torch.int32, device=keys.device)
    _gmax_kernel[(rows, cdiv(NKP, gb))](keys, gmax, ready if ready is not None else gmax, MK, NKP, rows,
                                        GS=gs, GB=gb, ZERO=ready is not None, num_warps=c.gmax_warps, **opts)
    return gmax, NKP, gs


def use_rowsel(c: TopKConfig, W: int, MK: int, rows: int, sms: int) -> bool:
    """Whether a pre-filtered selection of W pages from rows of MK key slots
    (B*S = rows of them) takes _rowsel_kernel rather than the chunked chain
    (shapes only, so the choice is the same at every replay)."""
    if not c.rowsel or next_pow2(W) > c.rowsel_max_w:
        return False
    return MK >= c.rowsel_min_pages or rows < sms or W > c.rowsel_chain_w


def use_overlap(c: TopKConfig, B: int, W: int, MK: int, pdl: bool) -> bool:
    """Whether a pre-filtered selection of W pages from B batch rows of MK
    key slots is overlapped with the keys pass (c.overlap; ``pdl``: the
    launches are PDL launches, without which there is nothing to overlap,
    unless c.overlap_needs_pdl is off). Shapes and ``c`` only, so the choice
    is the same at every replay."""
    return (c.overlap and c.rowsel and (pdl or not c.overlap_needs_pdl) and next_pow2(W) <= c.rowsel_max_w
            and B >= c.overlap_min_batch and MK <= c.overlap_max_keys)


def rowsel_plan(c: TopKConfig, MK: int, CH: int, W: int) -> Tuple[int, int, dict]:
    """_rowsel_kernel's shapes for rows of MK key slots (CH pages per key
    chunk) and a selection W pages wide: (the group count asked of
    gmax_groups, NKP groups, constexprs: GS keys per group, NKP_P2 group
    list slots, GB groups per step of the general loop, a CAP-slot candidate
    buffer and SMALL-slot short tile, the one tile's ONE_G groups and FEW
    rule, GT groups per step of a program's own group maxima)."""
    groups = min(max(c.gmax_groups, c.rowsel_groups_per_page * next_pow2(W), MK // c.rowsel_gs),
                 max(c.gmax_groups, MK // c.rowsel_min_gs))
    NKP, gs = gmax_groups(MK, CH, groups)
    blk = max(c.rowsel_blk, gs)
    cap = next_pow2(blk + next_pow2(W))
    one_g = max(1, min(next_pow2(W), c.rowsel_one // gs))
    return groups, NKP, dict(GS=gs, NKP_P2=next_pow2(NKP), GB=blk // gs, CAP=cap, SMALL=min(cap, c.rowsel_small),
                             ONE_G=one_g, FEW=c.rowsel_few if one_g * gs <= c.rowsel_few_tile else -1,
                             GT=max(1, c.gmax_keys // gs))


def launch_rowsel(keys: torch.Tensor, MK: int, CH: int, ids: torch.Tensor, seq_lens: torch.Tensor,
                  pages: torch.Tensor, counts: torch.Tensor, sinks: int, window: int, k_pages: int,
                  P: int, *, c: TopKConfig, cnt: Optional[torch.Tensor] = None, nchk: int = 0,
                  ready: Optional[torch.Tensor] = None, pdl: bool = True) -> tuple:
    """A whole selection from a key table: _gmax_kernel, then one
    _rowsel_kernel program per row. keys: int32 [B * S * MK] (row b * S + s,
    INT32_MIN past the row's pages); ids: int32 [B] cache slots; pages /
    counts: the Selection's int32 [B, S, W] / [B, S], written here.
    ``cnt``: the keys pass's int32 [B] counters (launch_keys) when it is
    still running: each program waits for its batch row's to reach ``nchk``
    and takes the row's group maxima itself (no _gmax_kernel). ``ready``:
    types.Pending.counters, int32 [2, B, S] (zeros already with ``cnt``;
    else _gmax_kernel zeroes them), or None: each row's counters[0] entry
    is raised to 1 once its pages and count are stored. Returns the
    launch's scratch tensors (Pending.hold)."""
    B, S, W = pages.shape
    opts = launch_opts(keys.device, pdl)
    groups, NKP, rp = rowsel_plan(c, MK, CH, W)
    if cnt is None:
        gmax = launch_gmax(keys, B * S, MK, CH, groups, opts, c, ready=ready)[0]
    else:
        gmax = torch.empty(B * S * NKP, dtype=torch.int32, device=keys.device)
    glist = torch.empty(B * S * rp["NKP_P2"], dtype=torch.int32, device=keys.device)
    ck = torch.empty(B * S * rp["CAP"], dtype=torch.int32, device=keys.device)
    cp = torch.empty_like(ck)
    _rowsel_kernel[(B * S,)](
        ids, seq_lens, keys, gmax, glist, ck, cp, pages, counts, cnt if cnt is not None else counts,
        ready if ready is not None else counts, MK, NKP, W, sinks, window, k_pages, nchk,
        S=S, P=P, NT=c.rowsel_nt, E=c.rowsel_e, POLL=cnt is not None, POLLS=c.overlap_polls, READY=ready is not None,
        **rp,
        num_warps=c.rowsel_warps or (8 if B * S <= num_sms(keys.device) else 4), **opts,
    )
    return gmax, glist, ck, cp


def topk_width(M: int, page_size: int, budget: int, sinks: int, window: int) -> Tuple[int, int]:
    """(k_pages, width) exactly as the reference sizes them."""
    k_pages = max(budget // page_size, 1)
    return k_pages, min(M, max(k_pages, 1 + sinks + window))


def select_topk(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    budget: int,
    sinks: int = 0,
    window: int = 0,
    per_query_head: bool = False,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    ub: Optional[torch.Tensor] = None,
    config=None,
) -> Selection:
    """Quest top-k selection (Triton), fused with the bound computation.

    Args:
        q: [batch, q_heads, head_dim]; cache: PagedKVCache; seq_ids: int [batch].
        budget: token budget; pages kept per row = max(budget // P, forced),
            forced = last page + ``sinks`` first + ``window`` last pages.
        per_query_head: one selection per query head instead of per KV head.
        scale, slopes: as in scoring.
        ub: optional float32 [batch, q_heads, M] output buffer; when given, the
            Quest bounds plus the reference's rounding slack (``bound_slack``)
            are written there too (the certified policy's safe bound).
    Returns:
        Selection(pages int32 [batch, S, W], counts int32 [batch, S]) with
        W = min(M, max(budget // P, 1 + sinks + window)); pages unsorted;
        through _rowsel_kernel also ``pending`` (types.Pending).
    """
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    S = HQ if per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    k_pages, W = topk_width(M, P, budget, sinks, window)
    dev = q.device
    config = resolve(config)
    c = config.topk
    all_heads = c.all_heads and G == 1
    cfg = topk_plan(c, M, W, NG, D, q.dtype, cache.dtype, B * S, num_sms(dev),
                    cap=c.select_ch if all_heads else 4096)
    NCH, CH = cfg["NCH"], cfg["CH"]
    smp, smh = meta_strides(cache)
    sl = as_slopes(slopes, HQ, dev)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    pages = torch.empty(B, S, W, dtype=torch.int32, device=dev)  # padding past counts is never read
    counts = torch.empty(B, S, dtype=torch.int32, device=dev)
    MK = NCH * CH
    keys = torch.empty(B * S * MK, dtype=torch.int32, device=dev)
    write_ub = ub is not None
    opts = launch_opts(dev, config.pdl)
    prefilter = all_heads and c.prefilter
    # the overlapped selection (use_overlap) publishes the keys per batch row; not with the
    # certified bounds, which later launches read (they wait for the selection, not the keys pass)
    overlap = prefilter and not write_ub and use_overlap(c, B, W, MK, bool(opts["PDL"]))
    rowsel = overlap or (prefilter and use_rowsel(c, W, MK, B * S, num_sms(dev)))
    # _rowsel_kernel publishes each row (Pending.counters [2, B, S]: rows
    # selected, the attention's own). Overlapped, the counters share one zero
    # fill with the keys pass's per batch row; else _gmax_kernel zeroes them.
    cnt = ready = None
    if overlap:
        zeros = torch.zeros(B + 2 * B * S, dtype=torch.int32, device=dev)
        cnt, ready = zeros[:B], zeros[B:].view(2, B, S)
    elif rowsel:
        ready = torch.empty(2, B, S, dtype=torch.int32, device=dev)
    if all_heads:
        kp = launch_keys(q, sl, ids, cache, keys, ub, MK, scale, sinks, window, k_pages,
                         has_alibi=slopes is not None, c=c, cnt=cnt, pdl=opts["PDL"])
    if rowsel:
        scratch = launch_rowsel(keys, MK, CH, ids, cache.seq_lens, pages, counts, int(sinks), int(window),
                                k_pages, P, c=c, cnt=cnt, nchk=cdiv(MK, kp["KCH"]) if overlap else 0,
                                ready=ready, pdl=opts["PDL"])
        # (the attention may start while this selection, and overlapped the
        # keys pass, still read q, the slopes, ids and the key table)
        return Selection(pages, counts, pending=Pending(ready, launch_count(), (q, sl, ids, keys) + scratch))
    if NCH > 1:
        ck = torch.empty(B * S * NCH * W, dtype=torch.int32, device=dev)
        cp = torch.empty_like(ck)
        cn = torch.empty(B * S * NCH, dtype=torch.int32, device=dev)
    else:
        ck = cp = cn = keys
    lbs = torch.empty(B * S, dtype=torch.int32, device=dev)
    if prefilter:
        gmax, NKP, _ = launch_gmax(keys, B * S, MK, CH, c.gmax_groups, opts, c)
        _lb_kernel[(B * S,)](gmax, lbs, ids, cache.seq_lens, NKP, int(sinks), int(window), k_pages,
                             S=S, P=P, NKP_P2=next_pow2(NKP), NT=c.lb_nt, E=c.lb_e, num_warps=c.lb_warps, **opts)
    _chunk_kernel[(B * S, NCH)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_min, cache.k_max,
        keys, ck, cp, cn, ub if write_ub else keys, pages, counts, lbs,
        float(scale), q.stride(0), q.stride(1), smp, smh,
        HQ, G, M, W, int(sinks), int(window), k_pages,
        S=S, NG=NG, NCH=NCH, P=P, D=D, PREFILTER=prefilter,
        BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], NSUB=cfg["NSUB"],
        HAS_ALIBI=slopes is not None, WRITE_UB=write_ub and not all_heads, KEYS_READY=all_heads,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"],
        num_warps=c.select_warps if all_heads else cfg["WARPS"], num_stages=cfg["STAGES"], **opts,
    )
    if NCH > 1:
        nch_p2 = next_pow2(NCH)
        one_tile = nch_p2 * next_pow2(W) <= c.merge_regs
        block_w = next_pow2(W) if one_tile else max(1, min(next_pow2(W), 8192 // nch_p2))
        _merge_kernel[(B * S,)](
            ids, cache.seq_lens, ck, cp, cn, pages, counts, lbs,
            W, int(sinks), int(window), k_pages,
            NCH=NCH, NCH_P2=nch_p2, BLOCK_W=block_w, S=S, P=P, ONE_TILE=one_tile,
            PREFILTER=prefilter, num_warps=merge_warps(nch_p2 * block_w) if one_tile else 8, **opts,
        )
    return Selection(pages, counts)
