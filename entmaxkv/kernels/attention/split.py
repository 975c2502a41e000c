"""Pass 1 of the attention: one program per (batch row, selection head, split)
walks its share of the row's kept pages and scores every K tile for the
query heads that read it.

``_attn_split_softmax_kernel`` keeps an online softmax (reading V too);
``_attn_split_entmax_kernel`` reads K only and writes the entmax candidates
s >= lb, lb a running lower bound on the threshold in score units
(docs/spec.md §1). Shared here: the
dot products, a tile's page lookup and the program's share of the pages.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import entmax_pows, grid_ids, pdl_start, poll_start, publish, query_offset, rel_pos


# ---------------------------------------------------------------------------
# dot products and page lookup
# ---------------------------------------------------------------------------


@triton.jit
def _qk(b_q, b_k, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """Dot products [BLOCK_G, BLOCK_T] of query rows and key rows (float32 out)."""
    if DOT_F32:
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision=PREC)
    else:
        b_s = tl.dot(b_q.to(b_k.dtype), tl.trans(b_k))
    return b_s


@triton.jit
def _pv(b_p, b_v, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """sum_t p[g, t] v[t, :] in float32; p is split hi + lo for low-precision V."""
    if DOT_F32:
        b_o = tl.dot(b_p, b_v.to(tl.float32), input_precision=PREC)
    else:
        p_hi = b_p.to(b_v.dtype)
        p_lo = (b_p - p_hi.to(tl.float32)).to(b_v.dtype)
        b_o = tl.dot(p_hi, b_v) + tl.dot(p_lo, b_v)
    return b_o


@triton.jit
def _tile_pages(t0, o_tt, t_hi, n, p_pages, p_bt, P: tl.constexpr, DENSE: tl.constexpr):
    """Token slots t0 + o_tt of a row (below t_hi) -> logical page (the page
    list, or the slot's page when DENSE) -> physical page through the block
    table. Returns (row in page, position, valid token, physical page int64)."""
    o_t = t0 + o_tt
    m_t = o_t < t_hi
    i_slot = o_t // P
    i_row = o_t % P
    if DENSE:
        logical = i_slot
    else:
        logical = tl.load(p_pages + i_slot, mask=m_t, other=0)
    pos = logical * P + i_row
    m_tok = m_t & (pos < n)
    phys = tl.load(p_bt + logical, mask=m_tok, other=0).to(tl.int64)
    return i_row, pos, m_tok, phys


@triton.jit
def _split_share(i_r, i_s, ids_ptr, lens_ptr, counts_ptr, bt_ptr, pages_ptr,
                 stride_bt, stride_pb, stride_ph, stride_cb, G, W,
                 S: tl.constexpr, NG: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                 P: tl.constexpr, DENSE: tl.constexpr):
    """Selection row i_r's first query head, KV head, sequence length, and split
    i_s's share of its kept pages: (i_b, h0, kvh, n, token slots [t_lo, t_hi),
    the row's block-table and page-list pointers)."""
    i_b = i_r // S
    i_sh = i_r % S
    h0 = i_sh * NG  # first query head of this selection row
    kvh = h0 // G

    # -- sequence, selected pages and this program's share of them
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    if DENSE:
        count = (n + P - 1) // P
    else:
        count = tl.minimum(tl.load(counts_ptr + i_b * stride_cb + i_sh), W)
    if MIN_PER > 0:  # splits in use: at least MIN_PER pages each, shares even
        used = tl.minimum(tl.maximum(count // MIN_PER, 1), NSPLIT)
        per = (count + used - 1) // used
    else:
        per = (count + NSPLIT - 1) // NSPLIT
    t_lo = tl.minimum(i_s * per, count) * P  # token slots [t_lo, t_hi) of the row
    t_hi = tl.minimum(i_s * per + per, count) * P
    p_bt = bt_ptr + seq * stride_bt
    p_pages = pages_ptr + i_b.to(tl.int64) * stride_pb + i_sh * stride_ph
    return i_b, h0, kvh, n, t_lo, t_hi, p_bt, p_pages


@triton.jit
def _attn_split_softmax_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, ids_ptr, pages_ptr, counts_ptr, slopes_ptr,
    pm_ptr, pl_ptr, pacc_ptr, rdy_ptr, done_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_kr,
    stride_vp, stride_vh, stride_vr,
    stride_bt, stride_pb, stride_ph, stride_cb,
    HQ, G, W,
    S: tl.constexpr, NG: tl.constexpr, NSPLIT: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr, HAS_ALIBI: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, ROWS_FIRST: tl.constexpr,
    PDL: tl.constexpr, pos_ptr, HAS_POS: tl.constexpr, PSTRIDE: tl.constexpr,
):
    """Softmax pass 1 for one (batch row, selection head, split): an online
    softmax over a share of the kept tokens, reading K and V; writes the
    partial (max, sum, accumulator) of each of the NG query heads.

    USE_DOT (NG >= 2 heads per K tile): scores by tl.dot, one running state per
    head. Otherwise (one head): "lane-parallel" state, one running max / sum /
    accumulator per token slot of the tile, merged once after the loop, so the
    loop body has no cross-warp reduction.

    LOOP_STAGES: num_stages of the tile loop's tl.range (None: not pipelined).
    POLL, ROWS_FIRST: as _attn_split_entmax_kernel's.
    """
    i_r, i_s = grid_ids(ROWS_FIRST)
    if POLL > 0:
        poll_start(rdy_ptr + i_r, 1, POLLS, PDL)
    else:
        pdl_start(PDL)
    i_b, h0, kvh, n, t_lo, t_hi, p_bt, p_pages = _split_share(
        i_r, i_s, ids_ptr, lens_ptr, counts_ptr, bt_ptr, pages_ptr, stride_bt, stride_pb, stride_ph, stride_cb,
        G, W, S, NG, NSPLIT, 0, P, DENSE)
    if HAS_POS:  # a shard of a longer sequence: global positions (ALiBi)
        qoff, _ = query_offset(n, pos_ptr, tl.load(ids_ptr + i_b).to(tl.int64), HAS_POS)
    else:
        qoff = n - 1

    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_tt = tl.arange(0, BLOCK_T)
    if USE_DOT:
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g)[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + h0 + o_g, mask=m_g, other=0.0)
        b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_G], tl.float32)
        b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    else:
        b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qb + h0 * stride_qh + o_d, mask=m_d, other=0.0)
        b_q = b_q.to(tl.float32)
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + h0)
        b_m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_T], tl.float32)
        b_acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)

    if PREFETCH:  # the first tile's pages; later tiles' are loaded one tile ahead
        i_row, pos, m_tok, phys = _tile_pages(t_lo, o_tt, t_hi, n, p_pages, p_bt, P, DENSE)
    for t0 in tl.range(t_lo, t_hi, BLOCK_T, num_stages=LOOP_STAGES):
        if not PREFETCH:
            i_row, pos, m_tok, phys = _tile_pages(t0, o_tt, t_hi, n, p_pages, p_bt, P, DENSE)
        o_k = phys * stride_kp + kvh * stride_kh + i_row * stride_kr
        b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
        rel = rel_pos(pos, qoff, P, PSTRIDE).to(tl.float32)
        if PREFETCH:  # the next tile's pages, while this tile's K is in flight
            i_row_nx, pos_nx, m_tok_nx, phys_nx = _tile_pages(t0 + BLOCK_T, o_tt, t_hi, n, p_pages, p_bt,
                                                              P, DENSE)

        if USE_DOT:
            # ---- NG heads share the tile: [BLOCK_G, BLOCK_T] scores by tl.dot
            b_s = _qk(b_q, b_k, DOT_F32, PREC) * scale
            if HAS_ALIBI:
                b_s += b_sl[:, None] * rel[None, :]
            b_s = tl.where(m_g[:, None] & m_tok[None, :], b_s, float("-inf"))
            m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = tl.exp(b_s - m_use[:, None])
            corr = tl.exp(b_m - m_use)
            b_l = b_l * corr + tl.sum(b_p, axis=1)
            o_v = phys * stride_vp + kvh * stride_vh + i_row * stride_vr
            b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
            b_acc = b_acc * corr[:, None] + _pv(b_p, b_v, DOT_F32, PREC)
            b_m = m_new
        else:
            # ---- one head: per-slot running state, no per-tile reduction
            b_s = tl.sum(b_q[None, :] * b_k.to(tl.float32), axis=1) * scale
            if HAS_ALIBI:
                b_s += b_sl * rel
            b_s = tl.where(m_tok, b_s, float("-inf"))
            m_new = tl.maximum(b_m, b_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = tl.exp(b_s - m_use)
            corr = tl.exp(b_m - m_use)
            b_l = b_l * corr + b_p
            o_v = phys * stride_vp + kvh * stride_vh + i_row * stride_vr
            b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
            b_acc = b_acc * corr[:, None] + b_p[:, None] * b_v.to(tl.float32)
            b_m = m_new
        if PREFETCH:
            i_row, pos, m_tok, phys = i_row_nx, pos_nx, m_tok_nx, phys_nx

    o_r = (i_b * HQ + h0 + o_g).to(tl.int64) * NSPLIT + i_s
    if not USE_DOT:  # merge the per-slot states
        m_all = tl.max(b_m, axis=0)
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp(b_m - m_use)
        b_l = tl.sum(w * b_l, axis=0)[None]
        b_acc = tl.sum(w[:, None] * b_acc, axis=0)[None, :]
        b_m = m_all[None]
    tl.store(pm_ptr + o_r, b_m, mask=m_g)
    tl.store(pl_ptr + o_r, b_l, mask=m_g)
    tl.store(pacc_ptr + o_r[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])
    if POLL == 2:
        publish(done_ptr + i_r)


# ---------------------------------------------------------------------------
# entmax: the running lower bound and the candidates
# ---------------------------------------------------------------------------


# "No bound yet": a finite sentinel below every finite score, so the
# candidate test s >= lb (see _attn_split_entmax_kernel) rejects only the
# masked -inf slots.
NO_LB = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _slot_pows(u_s, am1, beta, BETA_KIND: tl.constexpr):
    """Terms of the bound's Newton step for score gaps u_s = [top - t]_+ >= 0
    (score units): u_s^beta and u_s^(beta-1) for BETA_KIND 1/2 (the scaling
    by alpha - 1, a constant, is folded into _newton_left), else the terms
    of u = (alpha-1) u_s."""
    if BETA_KIND == 0:
        return entmax_pows(am1 * u_s, beta, 0)
    else:
        return entmax_pows(u_s, beta, BETA_KIND)


@triton.jit
def _newton_left(b_t, s0, s1, beta, BETA_KIND: tl.constexpr):
    """One Newton step on f(t) = sum ((alpha-1)[top - t]_+)^beta - 1 in score
    units (t a score; s0, s1 the _slot_pows sums at t), taken only where
    f > 0 (from the left): t + f / |f'|. For BETA_KIND 1/2 the sums are of
    the unscaled gaps: f = s0 / beta^2 - 1 and |f'| = s1 / beta (1.5:
    (s0 - 4) / (2 s1)); otherwise f = s0 - 1 and |f'| = s1."""
    if BETA_KIND == 2:
        f = s0 - beta * beta
        fp = beta * s1
    else:
        f = s0 - 1.0
        fp = s1
    return tl.where((f > 0) & (fp > 0), b_t + f / tl.where(fp > 0, fp, 1.0), b_t)


@triton.jit
def _lb_update(b_top, b_lb, am1, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr):
    """Raise the lower bounds b_lb [R] on tau (score units) from b_top [R, T].

    b_top[r, t] is the largest score seen so far in slot t: distinct tokens,
    so tau over them is <= tau (a subset, docs/spec.md §1) and >= their max
    - beta (in score units, t >= -1). A Newton step on their f from a point
    where it is >= 0 stays below that root (f convex for alpha <= 2): lb only
    grows, stays valid, and tightens as the slots collect the split's
    largest scores.
    """
    b_t = tl.maximum(b_lb, tl.max(b_top, axis=1) - beta)
    for _ in tl.static_range(NEWTON):
        u0, u1 = _slot_pows(tl.where(b_top > b_t[:, None], b_top - b_t[:, None], 0.0), am1, beta, BETA_KIND)
        b_t = _newton_left(b_t, tl.sum(u0, axis=1), tl.sum(u1, axis=1), beta, BETA_KIND)
    return tl.maximum(b_lb, b_t)


@triton.jit
def _lb_update_1d(b_top, b_lb, am1, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr):
    """_lb_update for one head (b_top [T], scalar b_lb): the same step with
    1-D reductions (a [1, T] view measured 2x slower: layout conversions)."""
    b_t = tl.maximum(b_lb, tl.max(b_top, axis=0) - beta)
    for _ in tl.static_range(NEWTON):
        u0, u1 = _slot_pows(tl.where(b_top > b_t, b_top - b_t, 0.0), am1, beta, BETA_KIND)
        b_t = _newton_left(b_t, tl.sum(u0, axis=0), tl.sum(u1, axis=0), beta, BETA_KIND)
    return tl.maximum(b_lb, b_t)


@triton.jit
def _max_sum2(m0, a0, b0, m1, a1, b1):
    return tl.maximum(m0, m1), a0 + a1, b0 + b1


@triton.jit
def _lb_step(b_top, b_lb, b_mx, am1, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr, AXIS: tl.constexpr):
    """_lb_update with one reduction: returns (lb, max of b_top) along AXIS.

    The Newton step (NEWTON 0 or 1) starts from max(lb, b_mx - beta), b_mx
    the max of an *earlier* b_top. Slots only grow, so that start is still
    <= tau over the current slots, and the step stays valid; the max of the
    current slots is reduced together with the step's two sums. Rows with no
    start yet (b_mx = -inf and lb = NO_LB) only take the max.
    """
    b_t = tl.maximum(b_lb, b_mx - beta)
    if NEWTON == 0:
        b_m = tl.max(b_top, axis=AXIS)
        return tl.maximum(b_t, b_m - beta), b_m
    else:
        ok = b_t > NO_LB
        b_ts = tl.where(ok, b_t, 0.0)
        b_te = tl.expand_dims(b_ts, AXIS)
        u0, u1 = _slot_pows(tl.where(b_top > b_te, b_top - b_te, 0.0), am1, beta, BETA_KIND)
        b_m, s0, s1 = tl.reduce((b_top, u0, u1), AXIS, _max_sum2)
        b_t = tl.maximum(tl.where(ok, _newton_left(b_ts, s0, s1, beta, BETA_KIND), b_t), b_m - beta)
        return tl.maximum(b_lb, b_t), b_m


@triton.jit
def _start_lb(lb0_ptr, o_row, m_row, am1, beta, HAS_LB0: tl.constexpr):
    """The split's first lb per row o_row [R] (score units): NO_LB, or with
    HAS_LB0 the rows' lower bounds on tau (tau units) over alpha - 1, less a
    margin far above their float32 rounding (the bound is itself a solved
    tau: a few ulps of the scores), so that no token of the support is
    dropped for an ulp. A bound that is not finite (NaN, an empty seed's
    +inf) gives NO_LB."""
    if HAS_LB0:
        t = tl.load(lb0_ptr + o_row, mask=m_row, other=float("nan")) / am1
        lb = t - (tl.abs(t) + beta) * 7.62939453125e-06  # 2^-17
        ok = (t == t) & (tl.abs(t) < float("inf"))
        return tl.where(ok, lb, NO_LB)
    else:
        return tl.full(o_row.shape, NO_LB, tl.float32)


@triton.jit
def _stage(cx_ptr, ci_ptr, o_c, b_nc, m_c, b_x, b_tok, o_tt, BLOCK_T: tl.constexpr):
    """Stage the candidates m_c of a tile: slot t's j-th candidate at row j,
    column t of its region (o_c); returns the slot counts b_nc + m_c."""
    p_c = o_c + b_nc.to(tl.int64) * BLOCK_T + o_tt
    tl.store(cx_ptr + p_c, b_x, mask=m_c)
    tl.store(ci_ptr + p_c, tl.broadcast_to(b_tok, b_x.shape), mask=m_c)
    return b_nc + m_c.to(tl.int32)


@triton.jit
def _compact(cx_ptr, ci_ptr, o_c, b_nc, R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Compact R staged candidate regions in place; returns their lengths [R].

    Region r (at o_c[r]) holds b_nc[r, t] candidates in column t, rows 0, 1, ...
    Row k is read whole, then written to positions n_<k + prefix < (k + 1) *
    BLOCK_T, so no store reaches a row not yet read; the barrier orders the
    read of row k before its own overwrite across threads (stores and loads
    are by the same program, through L2).
    """
    o_t = tl.arange(0, BLOCK_T)
    b_cnt = tl.zeros([R], tl.int32)
    tl.debug_barrier()  # the staging stores of every thread are visible
    for k in range(0, tl.max(tl.max(b_nc, axis=1), axis=0)):
        m_k = b_nc > k
        p_src = o_c[:, None] + k * BLOCK_T + o_t[None, :]
        b_x = tl.load(cx_ptr + p_src, mask=m_k, other=0.0, cache_modifier=".cg")
        b_i = tl.load(ci_ptr + p_src, mask=m_k, other=0, cache_modifier=".cg")
        tl.debug_barrier()
        f_k = m_k.to(tl.int32)
        p_dst = (o_c + b_cnt)[:, None] + (tl.cumsum(f_k, axis=1) - 1)
        tl.store(cx_ptr + p_dst, b_x, mask=m_k)
        tl.store(ci_ptr + p_dst, b_i, mask=m_k)
        b_cnt += tl.sum(f_k, axis=1)
    return b_cnt


@triton.jit
def _attn_split_entmax_kernel(
    q_ptr, k_ptr, bt_ptr, lens_ptr, ids_ptr, pages_ptr, counts_ptr, slopes_ptr,
    cx_ptr, ci_ptr, cn_ptr, clb_ptr, cm_ptr, rdy_ptr, done_ptr, lb0_ptr,
    scale, am1, beta,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_kr,
    stride_bt, stride_pb, stride_ph, stride_cb,
    HQ, G, W, CAP,
    S: tl.constexpr, NG: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BETA_KIND: tl.constexpr, NEWTON: tl.constexpr, LB_MODE: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, ROWS_FIRST: tl.constexpr,
    HAS_LB0: tl.constexpr,
    PDL: tl.constexpr, pos_ptr, HAS_POS: tl.constexpr, PSTRIDE: tl.constexpr,
):
    """Entmax pass 1 for one (batch row, selection head, split): the scores s
    of a share of the kept tokens, reading K only, and the candidates
    s >= lb (score + physical token id) of each of the NG query heads.

    Everything here is in score units, unscaled by alpha - 1 (lb a lower
    bound on the score threshold tau / (alpha-1)): the later passes shift by
    the row max *before* scaling, so neither large scores (q x 1e8) lose
    their digits nor (alpha-1) s overflows. The test is s >= lb, not s > lb:
    where lb rounds up onto the max (scores far larger than beta), the max
    stays a candidate.

    USE_DOT (NG >= 2 heads per K tile): scores by tl.dot, one running state per
    head (R rows: BLOCK_G, or NG when the dot's rows repeat the heads and are
    folded). Otherwise (one head): "lane-parallel" state, one running max per
    token slot of the tile, so the loop body has a single cross-warp
    reduction (the bound's, LB_MODE 1). Candidates of head r are staged
    without any per-tile scan: slot t's j-th candidate goes to row j, column t
    of the (r, split) region (CAP = rows x BLOCK_T entries at
    (r * NSPLIT + split) * CAP). After the loop the program compacts its
    region in place into a list (one prefix sum per *row*, a handful,
    instead of one per tile) and writes its length to cn[r * NSPLIT + split],
    with the split's lb and max, so later passes read only real candidates.

    LOOP_STAGES: num_stages of the tile loop's tl.range (None: Triton does
    not software-pipeline a loop without tl.dot; dense_entmax_pipe_*).

    POLL (poll_ready): 1, wait for rdy[row] (the selection's counters[0])
    to reach 1 rather than for the whole previous launch; 2, and at the end
    raise done[row] (counters[1]) by one. ROWS_FIRST: the grid is (NSPLIT,
    rows), so programs are scheduled row by row, in the order rows are
    selected.

    HAS_LB0: lb starts at lb0[b * HQ + head] (float32, tau units: a proven
    lower bound on tau over the kept tokens, Selection.tau_lower) instead of
    "no bound", so from the first tile only tokens that can be in the
    support are staged (_start_lb).
    """
    i_r, i_s = grid_ids(ROWS_FIRST)
    if POLL > 0:
        poll_start(rdy_ptr + i_r, 1, POLLS, PDL)
    else:
        pdl_start(PDL)
    # beta as a literal on the fast paths (1 or 2), not one more live
    # register: the bound's steps use it in score units
    if BETA_KIND == 2:
        beta_c = 2.0
    elif BETA_KIND == 1:
        beta_c = 1.0
    else:
        beta_c = beta
    i_b, h0, kvh, n, t_lo, t_hi, p_bt, p_pages = _split_share(
        i_r, i_s, ids_ptr, lens_ptr, counts_ptr, bt_ptr, pages_ptr, stride_bt, stride_pb, stride_ph, stride_cb,
        G, W, S, NG, NSPLIT, MIN_PER, P, DENSE)
    if HAS_POS:  # a shard of a longer sequence: global positions (ALiBi)
        qoff, _ = query_offset(n, pos_ptr, tl.load(ids_ptr + i_b).to(tl.int64), HAS_POS)
    else:
        qoff = n - 1

    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    o_h = tl.arange(0, R)  # rows of the entmax state: R == BLOCK_G, or NG when the dot's rows repeat the heads
    m_h = o_h < NG
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_tt = tl.arange(0, BLOCK_T)
    if USE_DOT:
        if R < BLOCK_G:  # dot row g is head g % R: every row real, BLOCK_G // R copies of each head
            p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g % R)[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_d[None, :], other=0.0)
        else:
            p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g)[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + h0 + o_h, mask=m_h, other=0.0)
        b_lb = _start_lb(lb0_ptr, i_b * HQ + h0 + o_h, m_h, am1, beta_c, HAS_LB0)
        b_mx = tl.full([R], float("-inf"), tl.float32)  # max of b_top (LB_MODE 1)
        b_top = tl.full([R, BLOCK_T], float("-inf"), tl.float32)
        b_nc = tl.zeros([R, BLOCK_T], tl.int32)
        o_c = ((i_b * HQ + h0 + o_h).to(tl.int64) * NSPLIT + i_s) * CAP
    else:
        b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qb + h0 * stride_qh + o_d, mask=m_d, other=0.0)
        b_q = b_q.to(tl.float32)
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + h0)
        b_lb = tl.max(_start_lb(lb0_ptr, i_b * HQ + h0 + tl.zeros([1], tl.int32), tl.full([1], 1, tl.int1),
                                am1, beta_c, HAS_LB0), axis=0)
        b_mx = tl.full([], float("-inf"), tl.float32)
        b_top = tl.full([BLOCK_T], float("-inf"), tl.float32)
        b_nc = tl.zeros([BLOCK_T], tl.int32)
        o_c = ((i_b * HQ + h0).to(tl.int64) * NSPLIT + i_s) * CAP

    if PREFETCH:  # the first tile's pages; later tiles' are loaded one tile ahead
        i_row, pos, m_tok, phys = _tile_pages(t_lo, o_tt, t_hi, n, p_pages, p_bt, P, DENSE)
    for t0 in tl.range(t_lo, t_hi, BLOCK_T, num_stages=LOOP_STAGES):
        if not PREFETCH:
            i_row, pos, m_tok, phys = _tile_pages(t0, o_tt, t_hi, n, p_pages, p_bt, P, DENSE)
        o_k = phys * stride_kp + kvh * stride_kh + i_row * stride_kr
        b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
        rel = rel_pos(pos, qoff, P, PSTRIDE).to(tl.float32)
        if PREFETCH:  # the next tile's pages, while this tile's K is in flight
            i_row_nx, pos_nx, m_tok_nx, phys_nx = _tile_pages(t0 + BLOCK_T, o_tt, t_hi, n, p_pages, p_bt,
                                                              P, DENSE)

        if USE_DOT:
            # ---- NG heads share the tile: [BLOCK_G, BLOCK_T] scores by tl.dot
            b_s = _qk(b_q, b_k, DOT_F32, PREC) * scale
            if R < BLOCK_G:  # the copies of a head hold equal scores: fold them to [R, BLOCK_T]
                b_s = tl.max(tl.reshape(b_s, [BLOCK_G // R, R, BLOCK_T]), axis=0)
            if HAS_ALIBI:
                b_s += b_sl[:, None] * rel[None, :]
            b_s = tl.where(m_h[:, None] & m_tok[None, :], b_s, float("-inf"))
            b_top = tl.maximum(b_top, b_s)
            if LB_MODE == 0:
                b_lb = _lb_update(b_top, b_lb, am1, beta_c, BETA_KIND, NEWTON)
            else:
                b_lb, b_mx = _lb_step(b_top, b_lb, b_mx, am1, beta_c, BETA_KIND, NEWTON, 1)
            m_c = b_s >= b_lb[:, None]  # only these can be in the support
            b_nc = _stage(cx_ptr, ci_ptr, o_c[:, None], b_nc, m_c, b_s, (phys * P + i_row).to(tl.int32)[None, :],
                          o_tt[None, :], BLOCK_T)
        else:
            # ---- one head: per-slot running state, no per-tile reduction
            b_s = tl.sum(b_q[None, :] * b_k.to(tl.float32), axis=1) * scale
            if HAS_ALIBI:
                b_s += b_sl * rel
            b_s = tl.where(m_tok, b_s, float("-inf"))
            b_top = tl.maximum(b_top, b_s)  # as in the tl.dot branch
            if LB_MODE == 0:
                b_lb = _lb_update_1d(b_top, b_lb, am1, beta_c, BETA_KIND, NEWTON)
            else:
                b_lb, b_mx = _lb_step(b_top, b_lb, b_mx, am1, beta_c, BETA_KIND, NEWTON, 0)
            m_c = b_s >= b_lb
            b_nc = _stage(cx_ptr, ci_ptr, o_c, b_nc, m_c, b_s, (phys * P + i_row).to(tl.int32), o_tt, BLOCK_T)
        if PREFETCH:
            i_row, pos, m_tok, phys = i_row_nx, pos_nx, m_tok_nx, phys_nx

    # the split's max and a last lb update (a tighter start for the solve)
    o_r = (i_b * HQ + h0 + o_h).to(tl.int64) * NSPLIT + i_s
    if USE_DOT:
        b_lb = _lb_update(b_top, b_lb, am1, beta_c, BETA_KIND, NEWTON)
        b_cnt = _compact(cx_ptr, ci_ptr, o_c, b_nc, R, BLOCK_T)
        tl.store(cn_ptr + o_r, b_cnt, mask=m_h)
        tl.store(clb_ptr + o_r, b_lb, mask=m_h)
        tl.store(cm_ptr + o_r, tl.max(b_top, axis=1), mask=m_h)
    else:
        b_lb = _lb_update_1d(b_top, b_lb, am1, beta_c, BETA_KIND, NEWTON)
        b_cnt = _compact(cx_ptr, ci_ptr, o_c + tl.zeros([1], tl.int64), b_nc[None, :], 1, BLOCK_T)
        tl.store(cn_ptr + o_r, b_cnt, mask=m_h)
        tl.store(clb_ptr + o_r, b_lb[None], mask=m_h)
        tl.store(cm_ptr + o_r, tl.max(b_top, axis=0)[None], mask=m_h)
    if POLL == 2:
        publish(done_ptr + i_r)
