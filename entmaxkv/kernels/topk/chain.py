"""The chunked top-k chain (passes 1-2): ``_topk_lb_kernel`` (the pre-filter's
lower bound per row), ``_topk_chunk_kernel`` (each chunk's best pages) and
``_topk_merge_kernel`` (the row's best of its chunks' candidates)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import pdl_start
from ..scoring import load_queries, page_bounds, page_rows
from .search import INT32_MIN, _group_lb, _keep_mask, kth_largest, page_rank, row_budget, sortable_key


@triton.jit
def _topk_lb_kernel(gmax_ptr, lb_ptr, ids_ptr, lens_ptr, NKP, sinks, window, k_pages,
               S: tl.constexpr, P: tl.constexpr, NKP_P2: tl.constexpr, NT: tl.constexpr, E: tl.constexpr,
               PDL: tl.constexpr):
    """lb of one row from its NKP group maxima: at most their k_row-th largest,
    with at least k_row (and, stopped early, at most k_row + E) maxima at or
    above it (_group_lb). They are keys of distinct pages, so >= k_row pages
    have key >= lb, the row's k_row-th key is >= lb, and no page below lb is
    ever kept (with fewer than k_row groups at or above it: INT32_MIN, no
    filter). Found once per row
    here instead of in each of the row's chunk programs, where the bisection
    over the maxima was most of _topk_chunk_kernel's work (22.2 -> 11.0 us at
    1 x 2M)."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    seq = tl.load(ids_ptr + i_r // S).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    _o_p, _b_gm, lb = _group_lb(gmax_ptr, i_r, NKP, k_row, NKP_P2, NT, E)
    tl.store(lb_ptr + i_r, lb)


@triton.jit
def _topk_chunk_kernel(
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
    #       with KEYS_READY _topk_keys_kernel has written them already
    if not KEYS_READY:
        o_m = i_c * CH + tl.arange(0, BLOCK_M)
        phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
        for j in range(NSUB):
            # the next block's physical pages are loaded before this block's
            # metadata is used, so the two dependent loads overlap
            o_m_nx = o_m + BLOCK_M
            phys_nx, m_v_nx, n_tok_nx = page_rows(bt_ptr, seq, n, o_m_nx, M, P)
            b_u, b_slack = page_bounds(b_q, b_sl, kmin_ptr, kmax_ptr, phys, m_v, n_tok, o_m * P - (n - 1), n - 1, kvh,
                                       scale, stride_mp, stride_mh, P, D, BLOCK_D, HAS_ALIBI,
                                       USE_DOT, DOT_F32, PREC, WRITE_UB)
            if WRITE_UB:  # the certified policy's safe bound: u + rounding slack
                o_u = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
                tl.store(ub_ptr + o_u, b_u + b_slack, mask=m_g[:, None] & (o_m < M)[None, :])
            b_rank = tl.max(tl.where(m_g[:, None], page_rank(b_u), float("-inf")), axis=0)
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
    if PREFILTER:  # no page below lb (_topk_lb_kernel) is kept
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
def _topk_merge_kernel(
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
