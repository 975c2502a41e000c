"""The one-program-per-row top-k selection (``_topk_rowsel_kernel``): lb from the
group maxima, then only the groups that can hold a kept page, through a
candidate buffer in L2; optionally polling the keys pass it overlaps."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import pdl_start, poll_start, publish
from .search import INT32_MIN, _gmax_block, _group_lb, _keep_mask, cut_from_below, kth_largest_nt, row_budget


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
    """_topk_rowsel_kernel's selection of one row: keys at p_row (loaded with
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
def _topk_rowsel_kernel(
    ids_ptr, lens_ptr, key_ptr, gmax_ptr, glist_ptr, ck_ptr, cp_ptr, pages_ptr, counts_ptr, cnt_ptr, ready_ptr,
    MK, NKP, W, sinks, window, k_pages, NCHK,
    S: tl.constexpr, P: tl.constexpr, GS: tl.constexpr, NKP_P2: tl.constexpr,
    GB: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, ONE_G: tl.constexpr, NT: tl.constexpr,
    FEW: tl.constexpr, E: tl.constexpr, POLL: tl.constexpr, GT: tl.constexpr, POLLS: tl.constexpr,
    READY: tl.constexpr, PDL: tl.constexpr,
):
    """A whole row's selection in one program, from its key table and group
    maxima (_topk_gmax_kernel): lb as _topk_lb_kernel finds it (E = 0: the same groups
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
    Replaces _topk_lb_kernel + _topk_chunk_kernel + _topk_merge_kernel (three dependent
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
