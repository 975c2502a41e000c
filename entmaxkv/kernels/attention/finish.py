"""Passes 3 (and 2-4 in one) of entmax attention: the V rows of the support.

``_attn_vacc_kernel`` (pass 3) gathers, per (query head, split), the V rows
of the candidates with p > 0 (shifted_prob, _common.py) into a partial sum, which
``_attn_combine_kernel`` (combine.py) adds up. ``_attn_finish_kernel`` does
passes 2-4 for one query head in one program: the solve (solve.py), the
support compacted into the head's own candidate lists, its V rows, the
output; with a tail, only the first V rows of a long support, and
``_attn_vtail_kernel`` gathers the rest over several programs per head and
writes the output.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import pdl_start, poll_start, shifted_prob
from .solve import _row_lists, _solve_tau


@triton.jit
def _pv_rows(v_ptr, b_tok, b_p, m_p, kvh, o_d, m_d, stride_vp, stride_vh, stride_vr, P: tl.constexpr):
    """p * V [BLOCK_C, BLOCK_D] for physical token ids b_tok of KV head kvh;
    rows outside m_p load nothing and give 0."""
    o_v = (b_tok // P).to(tl.int64) * stride_vp + kvh * stride_vh + (b_tok % P) * stride_vr
    b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_p[:, None] & m_d[None, :], other=0.0)
    return tl.where(m_p, b_p, 0.0)[:, None] * b_v.to(tl.float32)


@triton.jit
def _attn_vacc_kernel(
    v_ptr, cx_ptr, ci_ptr, cn_ptr, th_ptr, pacc_ptr,
    am1, beta, am1_lo, CAP,
    stride_vp, stride_vh, stride_vr,
    HQ, G,
    NSPLIT: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BETA_KIND: tl.constexpr, FORM: tl.constexpr, ACC_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """p (shifted_prob, from the row's (m, threshold) at th) over the
    candidate list of one (query head, split); V rows are gathered only
    where p > 0 (usually one short block per list).

    The kernel is latency-bound: token ids load with the scores (not after
    p > 0 is known: one dependent round trip less). ACC_ROWS: a [BLOCK_C, D]
    accumulator summed once at the end (small D, long lists); otherwise one
    [D] row, summed per block: few registers, so that many one-warp programs
    fit per SM (large D, where the grid B*HQ x NSPLIT is large and the lists
    short)."""
    pdl_start(PDL)
    i_h = tl.program_id(0)  # b * HQ + query head
    i_s = tl.program_id(1)
    kvh = (i_h % HQ) // G
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    r = i_h.to(tl.int64)
    m = tl.load(th_ptr + 2 * r).to(tl.float32)
    thr = tl.load(th_ptr + 2 * r + 1)
    n = tl.load(cn_ptr + r * NSPLIT + i_s)
    p_l = (r * NSPLIT + i_s) * CAP
    if ACC_ROWS:
        b_acc = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_D], tl.float32)
    for c0 in range(0, n, BLOCK_C):
        o_j = c0 + tl.arange(0, BLOCK_C)
        m_j = o_j < n
        b_x = tl.load(cx_ptr + p_l + o_j, mask=m_j, other=float("-inf"))
        b_tok = tl.load(ci_ptr + p_l + o_j, mask=m_j, other=0)
        b_p = shifted_prob(b_x, m, thr, am1, beta, am1_lo, BETA_KIND, FORM)
        m_p = m_j & (b_p > 0)
        b_pv = _pv_rows(v_ptr, b_tok, b_p, m_p, kvh, o_d, m_d, stride_vp, stride_vh, stride_vr, P)
        if ACC_ROWS:
            b_acc += b_pv
        else:
            b_acc += tl.sum(b_pv, axis=0)
    if ACC_ROWS:
        b_out = tl.sum(b_acc, axis=0)
    else:
        b_out = b_acc
    tl.store(pacc_ptr + (r * NSPLIT + i_s) * D + o_d, b_out, mask=m_d)


@triton.jit
def _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, c0, CAP, NS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Columns c0 .. c0 + BLOCK of every candidate list of a row (lengths
    n_s, CAP slots each from base), flattened split by split: scores (-inf
    past a list's end) and token ids."""
    o_c = c0 + tl.arange(0, BLOCK)
    o_x = base + (o_s.to(tl.int64) * CAP)[:, None] + o_c[None, :]
    m_x = o_c[None, :] < n_s[:, None]
    b_x = tl.load(cx_ptr + o_x, mask=m_x, other=float("-inf"))
    b_tok = tl.load(ci_ptr + o_x, mask=m_x, other=0)
    return tl.reshape(b_x, [NS_P2 * BLOCK]), tl.reshape(b_tok, [NS_P2 * BLOCK])


@triton.jit
def _support_slot(base, w, CAP, cw, NSPLIT: tl.constexpr):
    """Slot of the w-th support token: the w-th slot of the row's lists
    [NSPLIT, CAP] in chunk order (chunks of cw columns, each split's columns
    in turn). cw = CAP gives the flat order."""
    chunk = w // (NSPLIT * cw)
    r = w % (NSPLIT * cw)
    return base + chunk * cw + (r // cw) * CAP + r % cw


@triton.jit
def _store_kept(cx_ptr, ci_ptr, base, w0, vals, b_tok, keep, CAP, NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Stores (vals, token id) of the entries with keep as entries w0, w0 + 1,
    ... of the row (_support_slot with chunks of BLOCK_M columns; 0: the
    flat order) and returns how many. All of this program's threads must
    have read those slots already."""
    o_w = w0 + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    if BLOCK_M == 0:
        o_c = base + o_w
    else:
        o_c = _support_slot(base, o_w, CAP, BLOCK_M, NSPLIT)
    tl.debug_barrier()  # every thread's entries are read before any slot is overwritten
    tl.store(cx_ptr + o_c, vals, mask=keep)
    tl.store(ci_ptr + o_c, b_tok, mask=keep)
    return tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _compact_support(cx_ptr, ci_ptr, base, w0, b_x, b_tok, m, thr, am1, beta, am1_lo, CAP,
                     NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """Stores (p, token id) (p: shifted_prob) of the candidates b_x with p > 0 as support
    tokens w0, w0 + 1, ... (_store_kept) and returns how many."""
    b_p = shifted_prob(b_x, m, thr, am1, beta, am1_lo, BETA_KIND, FORM)
    return _store_kept(cx_ptr, ci_ptr, base, w0, b_p, b_tok, b_p > 0, CAP, NSPLIT, BLOCK_M)


@triton.jit
def _prune_lists(cx_ptr, ci_ptr, cn_row, base, o_s, n_s, max_n, lb, beta, CAP,
                 NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Drops the row's candidates at or below lb (the splits' best lower
    bound on tau) less twice the solve's rounding margin: the solve starts
    at or above that margin below lb and only moves up, so they have p = 0
    at every threshold it visits. NaN scores stay. The survivors go, in
    chunk order (_store_kept), to the front of the lists, which become
    prefixes again: with K kept and W = NSPLIT * BLOCK_M, list s holds
    (K // W) * BLOCK_M + clamp(K % W - s * BLOCK_M, 0, BLOCK_M). Stores
    those lengths at cn_row[s]; returns (n_s, their max, K)."""
    cut = lb - 2.0 * (tl.abs(lb) + beta) * 4.76837158203125e-07
    kept = tl.zeros([], tl.int32)
    for c0 in range(0, max_n, BLOCK_M):
        b_x, b_tok = _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, c0, CAP, NS_P2, BLOCK_M)
        kept += _store_kept(cx_ptr, ci_ptr, base, kept, b_x, b_tok, ~(b_x <= cut), CAP, NSPLIT, BLOCK_M)
    W = NSPLIT * BLOCK_M
    n_new = (kept // W) * BLOCK_M + tl.minimum(tl.maximum(kept % W - o_s * BLOCK_M, 0), BLOCK_M)
    n_new = tl.where(o_s < NSPLIT, n_new, 0)
    tl.store(cn_row + o_s, n_new, mask=o_s < NSPLIT)
    return n_new, tl.max(n_new, axis=0), kept


@triton.jit
def _attn_finish_kernel(
    cx_ptr, ci_ptr, cn_ptr, clb_ptr, cm_ptr, tinit_ptr, tau_ptr, v_ptr, out_ptr, done_ptr, vpart_ptr, vinfo_ptr,
    alpha, beta, am1, am1_lo, pscale, CAP, OWN, VSTRIDE,
    stride_vp, stride_vh, stride_vr, stride_ob, stride_oh,
    HQ, G,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
    HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr, MODE: tl.constexpr,
    FUSED: tl.constexpr, FORM: tl.constexpr, PRUNE: tl.constexpr, TAIL: tl.constexpr,
    POLL: tl.constexpr, POLLS: tl.constexpr, PDL: tl.constexpr,
):
    """The work of _attn_solve_kernel, _attn_vacc_kernel and _attn_combine_kernel for one
    query head in one program.

    tau is solved over the candidates as _attn_solve_kernel does: in registers
    when every list fits one [NS_P2, BLOCK_K] tile (MODE 0: always, as for
    top-k budgets; 1: when this row's do), else from memory (MODE 2: always).
    Then the support (p > 0, usually a handful of tokens) is compacted into
    the row's own, already read, candidate lists (cumsum positions), and the
    V rows are gathered in blocks of BLOCK_C support tokens, not over every
    candidate; their sum is the output (entmax needs no rescaling across
    splits). POLL: wait for done[row] to reach NSPLIT (the split programs
    counted in, poll_ready) rather than for the whole split pass. PRUNE:
    lists longer than the register tile first lose the candidates below the
    row's lower bound on tau (_prune_lists; their new lengths go to cn), so
    the solve reads the rest only, from registers when they fit. TAIL (the
    tail launch follows): only the first OWN support tokens are gathered
    here; the row's (support size, chunk width, 0) go to vinfo [R, 3] int32
    and, for a longer support, this partial (unscaled) to vpart[row, 0]
    (row stride VSTRIDE) instead of the output."""
    i_r = tl.program_id(0).to(tl.int64)  # b * HQ + query head
    if POLL:
        poll_start(done_ptr + i_r, NSPLIT, POLLS, PDL)
    else:
        pdl_start(PDL)
    o_s = tl.arange(0, NS_P2)
    lb, m, n_s, max_n, total, t_init = _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s,
                                                  NSPLIT, HAS_INIT)
    base = i_r * NSPLIT * CAP
    if PRUNE:
        if max_n > BLOCK_K:
            n_s, max_n, total = _prune_lists(cx_ptr, ci_ptr, cn_ptr + i_r * NSPLIT, base, o_s, n_s, max_n, lb,
                                             beta, CAP, NSPLIT, NS_P2, BLOCK_M)
    if MODE == 0:
        in_regs = True
    elif MODE == 1:
        in_regs = max_n <= BLOCK_K
    else:
        in_regs = False
    if in_regs:
        b_xr, b_tok = _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, 0, CAP, NS_P2, BLOCK_K)
        m, thr, tau = _solve_tau(cx_ptr + base, n_s, max_n, b_xr, lb, m, total,
                                 t_init, alpha, beta, am1, am1_lo, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                                 HALLEY, POLISH, NEWTON_CAP, True, FUSED, FORM)
        n_sup = _compact_support(cx_ptr, ci_ptr, base, 0, b_xr, b_tok, m, thr, am1, beta, am1_lo, CAP, NSPLIT, 0,
                                 BETA_KIND, FORM)
        cw = tl.zeros([], tl.int32) + CAP  # (the flat order)
    else:
        m, thr, tau = _solve_tau(cx_ptr + base, n_s, max_n, lb, lb, m, total,
                                 t_init, alpha, beta, am1, am1_lo, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                                 HALLEY, POLISH, NEWTON_CAP, False, FUSED, FORM)
        # [NSPLIT, BLOCK_M] chunks, columns c0.. of every list at once; the
        # w-th support token goes to the w-th slot in chunk order (chunk,
        # split, column: _support_slot), which is in a chunk already read
        # (w < tokens kept so far <= slots read so far); BLOCK_M divides CAP
        n_sup = tl.zeros([], tl.int32)
        cw = tl.zeros([], tl.int32) + BLOCK_M
        for c0 in range(0, max_n, BLOCK_M):
            b_x, b_tok = _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, c0, CAP, NS_P2, BLOCK_M)
            n_sup += _compact_support(cx_ptr, ci_ptr, base, n_sup, b_x, b_tok, m, thr, am1, beta, am1_lo, CAP,
                                      NSPLIT, BLOCK_M, BETA_KIND, FORM)
    tl.store(tau_ptr + i_r, tau)  # (an empty row: +inf, every p 0 and the output 0)
    tl.debug_barrier()  # the compacted support is read back by other threads of this program
    kvh = (i_r % HQ) // G
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    n_own = n_sup
    if TAIL:
        n_own = tl.minimum(n_sup, OWN)
    b_o = _support_pv(cx_ptr, ci_ptr, v_ptr, base, cw, 0, n_own, kvh, o_d, m_d, CAP,
                      stride_vp, stride_vh, stride_vr, NSPLIT, P, BLOCK_C, BLOCK_D)
    if TAIL:
        tl.store(vinfo_ptr + 3 * i_r, n_sup)
        tl.store(vinfo_ptr + 3 * i_r + 1, cw)
        tl.store(vinfo_ptr + 3 * i_r + 2, 0)  # the tail's arrival counter, zero before it starts
        if n_sup > OWN:
            tl.store(vpart_ptr + i_r * VSTRIDE + o_d, b_o, mask=m_d)  # (VSTRIDE: (tail + 1) * D)
        else:
            _store_row(out_ptr, b_o, pscale, i_r, o_d, m_d, stride_ob, stride_oh, HQ, BETA_KIND)
    else:
        _store_row(out_ptr, b_o, pscale, i_r, o_d, m_d, stride_ob, stride_oh, HQ, BETA_KIND)


@triton.jit
def _support_pv(cx_ptr, ci_ptr, v_ptr, base, cw, lo, hi, kvh, o_d, m_d, CAP,
                stride_vp, stride_vh, stride_vr,
                NSPLIT: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """sum of p * V [BLOCK_D] over the support tokens lo .. hi - 1 of a row
    compacted by _attn_finish_kernel ((p, token id) at _support_slot, chunk
    width cw), in blocks of BLOCK_C."""
    b_acc = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)
    for c0 in range(lo, hi, BLOCK_C):
        o_j = c0 + tl.arange(0, BLOCK_C)
        m_j = o_j < hi
        o_w = _support_slot(base, o_j, CAP, cw, NSPLIT)
        b_pj = tl.load(cx_ptr + o_w, mask=m_j, other=0.0)
        b_tj = tl.load(ci_ptr + o_w, mask=m_j, other=0)
        b_acc += _pv_rows(v_ptr, b_tj, b_pj, m_j, kvh, o_d, m_d, stride_vp, stride_vh, stride_vr, P)
    return tl.sum(b_acc, axis=0)


@triton.jit
def _store_row(out_ptr, b_o, pscale, i_r, o_d, m_d, stride_ob, stride_oh, HQ, BETA_KIND: tl.constexpr):
    """The output row of query-head row i_r from its sum of p * V."""
    if BETA_KIND == 2:  # shifted_prob's p / (alpha-1)^2
        b_o = b_o * pscale
    i_b = i_r // HQ
    i_h = i_r % HQ
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_d, b_o.to(out_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _attn_vtail_kernel(
    cx_ptr, ci_ptr, v_ptr, out_ptr, vpart_ptr, vinfo_ptr,
    pscale, CAP, OWN,
    stride_vp, stride_vh, stride_vr, stride_ob, stride_oh,
    HQ, G,
    NSPLIT: tl.constexpr, TAIL: tl.constexpr, TAIL_P2: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BETA_KIND: tl.constexpr, PDL: tl.constexpr,
):
    """The V rows of a long support, after _attn_finish_kernel (TAIL): program
    (row, j) of a [rows, TAIL] grid gathers the j-th of TAIL equal slices
    (whole blocks of BLOCK_C) of the row's support tokens OWN .. n - 1 into
    vpart[row, j + 1]; the last of the row's programs to arrive (an acq_rel
    counter) adds the TAIL + 1 partials in slot order, so the output does
    not depend on which one it is. Rows with n <= OWN have their output
    already: their programs return at once."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_j = tl.program_id(1)
    n_sup = tl.load(vinfo_ptr + 3 * i_r)
    if n_sup > OWN:
        cw = tl.load(vinfo_ptr + 3 * i_r + 1)
        per = tl.cdiv(tl.cdiv(n_sup - OWN, TAIL), BLOCK_C) * BLOCK_C
        lo = OWN + i_j * per
        hi = tl.minimum(lo + per, n_sup)
        kvh = (i_r % HQ) // G
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_o = _support_pv(cx_ptr, ci_ptr, v_ptr, i_r * NSPLIT * CAP, cw, lo, hi, kvh, o_d, m_d, CAP,
                          stride_vp, stride_vh, stride_vr, NSPLIT, P, BLOCK_C, BLOCK_D)
        p_row = vpart_ptr + i_r * (TAIL + 1) * D
        tl.store(p_row + (i_j + 1) * D + o_d, b_o, mask=m_d)
        tl.debug_barrier()  # every thread's partial is stored before the release
        arrived = tl.atomic_add(vinfo_ptr + 3 * i_r + 2, 1, sem="acq_rel", scope="gpu")
        if arrived == TAIL - 1:
            o_t = tl.arange(0, TAIL_P2)
            b_all = tl.load(p_row + o_t[:, None] * D + o_d[None, :], mask=(o_t[:, None] <= TAIL) & m_d[None, :],
                            other=0.0, volatile=True)
            _store_row(out_ptr, tl.sum(b_all, axis=0), pscale, i_r, o_d, m_d, stride_ob, stride_oh, HQ, BETA_KIND)
