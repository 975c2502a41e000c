"""Paged attention over selected (or all) pages: softmax and exact alpha-entmax.

Reference: ``entmaxkv.attention.attend``. Shapes: B batch, HQ query heads,
H KV heads, G = HQ // H, S selection heads (H or HQ), NG = HQ // S query heads
served by one selection row, W selection width (pages), P page size, D head dim.

Split-K over the selected pages, in at most four launches, none of which
synchronises with the host:

1. ``_split_kernel`` (grid B*S x NSPLIT). Each program walks a contiguous
   share of its row's selected pages, loading each K tile once for the NG
   query heads that read it.
   * softmax: online softmax over the share, also reading V; writes the
     partial (max, sum, accumulator) of each head.
   * entmax: computes x = (alpha-1) s and never reads V. Any subset's
     threshold is <= the full threshold (docs/spec.md §1), so a running lower
     bound ``lb`` screens the tokens: only x > lb can be in the support. lb
     comes from the per-slot maxima seen so far (distinct tokens), raised by
     a Newton step from the left after each tile (valid because f is convex
     for alpha <= 2). Those *candidates* (score + physical token id) are the
     only scores written to HBM: staged per slot, then compacted in place
     into one list per (query head, split) at the end of the program.
2. ``_solve_kernel`` (grid B*HQ, entmax only): the exact tau of each query
   head over its candidates, whose other kept tokens have x <= lb <= tau and
   so contribute nothing. alpha = 2 / 1.5: Newton from the left until the
   support is stable, then the closed form on it; other alpha: safeguarded
   Halley (as the reference).
3. ``_vacc_kernel`` (grid B*HQ x NSPLIT, entmax only): p = [x - tau]_+^beta over
   each candidate list; V rows are gathered only where p > 0.
4. ``_combine_kernel`` (grid B*HQ): merges the split partials, writes the output
   in q's dtype and tau (softmax: the log-sum-exp; a head with no kept token
   gets zeros and tau = +inf).

Entmax usually replaces 2-4 with one launch, ``_finish_kernel`` (grid B*HQ):
the solve, then the support (p > 0) compacted into the head's own candidate
lists and its V rows gathered, the output written directly (AttentionConfig.finish*
say when).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...types import Selection
from ..config import AttentionConfig, KernelConfig, resolve
from .._common import (
    as_slopes,
    beta_kind,
    cdiv,
    dot_flags,
    entmax_pows,
    entmax_prob,
    grid_ids,
    interpreting,
    kv_strides,
    launch_count,
    launch_opts,
    next_pow2,
    num_sms,
    pdl_start,
    poll_start,
    publish,
)

# Every launch choice is a field of AttentionConfig (kernels/config.py); the
# plan and the launcher take it from the caller's KernelConfig.


def _plan(c: AttentionConfig, B: int, S: int, NG: int, D: int, W: int, P: int, device, softmax: bool,
          itemsize: int = 2, dense: bool = True) -> dict:
    """Block sizes and split count from shapes and ``c`` only (graph-capturable)."""
    # Measured on the H200 (benchmarks/tune.py; experiments/logs/tune*.log):
    # one head per program, d 32: softmax 256 x 4 warps, entmax 512 x 8 warps
    # through a selection's page list (dense: dense_entmax_pipe_*), 3 stages;
    # tl.dot path, d 128 bf16: softmax 32 x 4 warps x 6 stages (dense: 32 x 2
    # warps x 4 stages, 3.88 per SM), entmax (K only) 128 x 4 warps x 3 stages
    # at 2 programs per SM. Deep pipelines of small tiles win there; the stage
    # count is capped so the buffers stay within ~160 KB of shared memory for
    # any head dim and dtype.
    use_dot = NG >= 2
    block_d = next_pow2(D)
    rows = B * S
    many = rows >= num_sms(device)
    loop_stages = None  # tl.range num_stages of the split loop (None: not pipelined)
    if use_dot:
        block_g = max(16, next_pow2(NG))
        block_d = max(16, block_d)
        warps = 4
        if softmax:
            block_t, depth = max(16, min(32, 4096 // block_d)), 6
            if dense:  # with the page-id prefetch (dense_prefetch_dot_softmax)
                depth, warps = 4, 2
        else:  # (3 stages through a page list, and with the prefetch dense: GQA 4 x 32k 0.145 -> 0.138 ms)
            block_t, depth = max(16, min(128, 16384 // block_d)), 3
        stage_bytes = block_t * block_d * itemsize * (2 if softmax else 1)
        stages = max(2, min(depth, (160 * 1024) // stage_bytes))
    else:
        block_g = 1
        if softmax:
            block_t, warps = max(16, min(256, 8192 // block_d)), 4
        elif dense:  # software-pipelined (tiles measured at d 32; larger head dims keep the tile's elements)
            pipe_t, warps, loop_stages = c.dense_entmax_pipe_many if many else c.dense_entmax_pipe_few
            block_t = max(16, pipe_t * 32 // max(32, block_d))
        else:  # through a page list, with the page-id prefetch: 512-token tiles at d 32 (docs/tuning.md)
            block_t, warps = max(16, min(512, 16384 // block_d)), 8
        stages = 3
    if use_dot:
        factor = c.dot_softmax_dense_factor if dense else c.dot_softmax_list_factor
    elif not softmax and dense and many:
        factor = c.entmax_wave_factor
    else:
        factor = c.split_factor
    small = (not use_dot and not dense and block_d <= 64 and W * P <= c.small_sel_tokens
             and (softmax or not many))
    if small:
        (block_t, warps, stages), factor = c.small_sel, c.small_sel_factor
    key = (NG, D, softmax)
    tuned = dict(c.tune)
    if key in tuned:
        (block_t, warps, stages), factor = tuned[key], c.split_factor
    if interpreting():
        block_t = min(block_t, 32)
    if use_dot and not softmax:
        want = max(1, int(c.dot_entmax_per_sm * num_sms(device)) // rows)
    else:
        want = cdiv(max(1, int(factor * num_sms(device))), rows)
    tokens = W * P
    nsplit = max(1, min(want, W, 128, max(1, tokens // (2 * block_t))))
    dense_prefetch = ((c.dense_prefetch_dot_softmax if softmax else c.dense_prefetch_dot_entmax) if use_dot
                      else (c.dense_prefetch_one_head_softmax if softmax else c.dense_prefetch_one_head_entmax))
    prefetch = c.prefetch_pages and (not dense or dense_prefetch)
    # (not for short selections: their many small programs are the point)
    min_per = (c.split_min_tokens_many if many else c.split_min_tokens_few) // P if (not use_dot and not softmax and not dense and not small) else 0
    fold = use_dot and not softmax and c.fold_rows and NG == next_pow2(NG) and NG < block_g
    path = ("dot_folded" if fold else "dot_rows") if use_dot else "one_head"  # (the lb_mode_* field)
    return dict(USE_DOT=use_dot, BLOCK_G=block_g, R=NG if fold else block_g, BLOCK_D=block_d, BLOCK_T=block_t,
                NSPLIT=nsplit, MIN_PER=min_per, PREFETCH=prefetch, PATH=path, num_warps=warps,
                num_stages=stages, LOOP_STAGES=loop_stages)


def _max_share(W: int, nsplit: int, min_per: int) -> int:
    """The most pages one split takes from a row of at most W kept pages (the
    split kernel's shares: ceil(count / used) over used splits)."""
    share = cdiv(W, nsplit)
    if min_per > 0:  # used = clamp(count // min_per, 1, nsplit): the largest count for each used < nsplit
        for used in range(1, nsplit):
            share = max(share, cdiv(min(W, (used + 1) * min_per - 1), used))
    return share


# ---------------------------------------------------------------------------
# kernels
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
def _newton_left(b_t, s0, s1, beta):
    """One Newton step t + f / f' on f = s0 - 1 (s0 = sum u^beta, s1 = sum
    u^(beta-1), u = [top - t]_+), taken only where f > 0 (from the left)."""
    f = s0 - 1.0
    fp = beta * s1
    return tl.where((f > 0) & (fp > 0), b_t + f / tl.where(fp > 0, fp, 1.0), b_t)


@triton.jit
def _lb_update(b_top, b_lb, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr):
    """Raise the lower bounds b_lb [R] on tau from b_top [R, T].

    b_top[r, t] is the largest x seen so far in slot t: distinct tokens, so tau
    over them is <= tau (a subset, docs/spec.md §1) and >= their max - 1. A
    Newton step on their f from a point where it is >= 0 stays below that root
    (f convex for alpha <= 2): lb only grows, stays valid, and tightens as the
    slots collect the split's largest scores.
    """
    b_t = tl.maximum(b_lb, tl.max(b_top, axis=1) - 1.0)
    for _ in tl.static_range(NEWTON):
        u0, u1 = entmax_pows(tl.where(b_top > b_t[:, None], b_top - b_t[:, None], 0.0), beta, BETA_KIND)
        b_t = _newton_left(b_t, tl.sum(u0, axis=1), tl.sum(u1, axis=1), beta)
    return tl.maximum(b_lb, b_t)


@triton.jit
def _lb_update_1d(b_top, b_lb, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr):
    """_lb_update for one head (b_top [T], scalar b_lb): the same step with
    1-D reductions (a [1, T] view measured 2x slower: layout conversions)."""
    b_t = tl.maximum(b_lb, tl.max(b_top, axis=0) - 1.0)
    for _ in tl.static_range(NEWTON):
        u0, u1 = entmax_pows(tl.where(b_top > b_t, b_top - b_t, 0.0), beta, BETA_KIND)
        b_t = _newton_left(b_t, tl.sum(u0, axis=0), tl.sum(u1, axis=0), beta)
    return tl.maximum(b_lb, b_t)


@triton.jit
def _max_sum2(m0, a0, b0, m1, a1, b1):
    return tl.maximum(m0, m1), a0 + a1, b0 + b1


@triton.jit
def _lb_step(b_top, b_lb, b_mx, beta, BETA_KIND: tl.constexpr, NEWTON: tl.constexpr, AXIS: tl.constexpr):
    """_lb_update with one reduction: returns (lb, max of b_top) along AXIS.

    The Newton step (NEWTON 0 or 1) starts from max(lb, b_mx - 1), b_mx the
    max of an *earlier* b_top. Slots only grow, so that start is still <= tau
    over the current slots, and the step stays valid; the max of the current
    slots is reduced together with the step's two sums. Rows with no start
    yet (b_mx = -inf and lb = -inf) only take the max.
    """
    b_t = tl.maximum(b_lb, b_mx - 1.0)
    if NEWTON == 0:
        b_m = tl.max(b_top, axis=AXIS)
        return tl.maximum(b_t, b_m - 1.0), b_m
    else:
        ok = b_t > float("-inf")
        b_ts = tl.where(ok, b_t, 0.0)
        b_te = tl.expand_dims(b_ts, AXIS)
        u0, u1 = entmax_pows(tl.where(b_top > b_te, b_top - b_te, 0.0), beta, BETA_KIND)
        b_m, s0, s1 = tl.reduce((b_top, u0, u1), AXIS, _max_sum2)
        b_t = tl.maximum(tl.where(ok, _newton_left(b_ts, s0, s1, beta), b_t), b_m - 1.0)
        return tl.maximum(b_lb, b_t), b_m


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
def _split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, ids_ptr, pages_ptr, counts_ptr, slopes_ptr,
    pm_ptr, pl_ptr, pacc_ptr,
    cx_ptr, ci_ptr, cn_ptr, clb_ptr, cm_ptr, rdy_ptr, done_ptr,
    scale, am1, beta,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_kr,
    stride_vp, stride_vh, stride_vr,
    stride_bt, stride_pb, stride_ph, stride_cb,
    HQ, G, W, CAP,
    S: tl.constexpr, NG: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr, SOFTMAX: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BETA_KIND: tl.constexpr, NEWTON: tl.constexpr, LB_MODE: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, ROWS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (batch row, selection head, split): scores of a share of the kept tokens.

    USE_DOT (NG >= 2 heads per K tile): scores by tl.dot, one running state per
    head. Otherwise (one head): "lane-parallel" state, one running max / sum /
    accumulator per token slot of the tile, merged once after the loop, so the
    loop body has no cross-warp reduction (softmax) or a single one (entmax).
    Entmax candidates of head r are staged without any per-tile scan: slot t's
    j-th candidate goes to row j, column t of the (r, split) region (CAP =
    rows x BLOCK_T entries at (r * NSPLIT + split) * CAP). After the loop the
    program compacts its region in place into a list (one prefix sum per
    *row*, a handful, instead of one per tile) and writes its length to
    cn[r * NSPLIT + split], so later passes read only real candidates.

    LOOP_STAGES: num_stages of the tile loop's tl.range (None: Triton does
    not software-pipeline a loop without tl.dot; dense_entmax_pipe_*).

    POLL (poll_ready): 1, wait for rdy[row] (the selection's counters[0])
    to reach 1 rather than for the whole previous launch; 2, and at the end
    raise done[row] (counters[1]) by one. ROWS_FIRST: the grid is (NSPLIT,
    rows), so programs are scheduled row by row, in the order rows are
    selected.
    """
    i_r, i_s = grid_ids(ROWS_FIRST)
    if POLL > 0:
        poll_start(rdy_ptr + i_r, 1, POLLS, PDL)
    else:
        pdl_start(PDL)
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
    pos_q = n - 1

    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    o_h = tl.arange(0, R)  # rows of the entmax state: R == BLOCK_G, or NG when the dot's rows repeat the heads
    m_h = o_h < NG
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_tt = tl.arange(0, BLOCK_T)
    p_bt = bt_ptr + seq * stride_bt
    p_pages = pages_ptr + i_b.to(tl.int64) * stride_pb + i_sh * stride_ph
    if USE_DOT:
        if R < BLOCK_G:  # dot row g is head g % R: every row real, BLOCK_G // R copies of each head
            p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g % R)[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_d[None, :], other=0.0)
        else:
            p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g)[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
        if SOFTMAX:
            if HAS_ALIBI:
                b_sl = tl.load(slopes_ptr + h0 + o_g, mask=m_g, other=0.0)
            b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            b_l = tl.zeros([BLOCK_G], tl.float32)
            b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        else:
            if HAS_ALIBI:
                b_sl = tl.load(slopes_ptr + h0 + o_h, mask=m_h, other=0.0)
            b_lb = tl.full([R], float("-inf"), tl.float32)
            b_mx = tl.full([R], float("-inf"), tl.float32)  # max of b_top (LB_MODE 1)
            b_top = tl.full([R, BLOCK_T], float("-inf"), tl.float32)
            b_nc = tl.zeros([R, BLOCK_T], tl.int32)
            o_c = ((i_b * HQ + h0 + o_h).to(tl.int64) * NSPLIT + i_s) * CAP
    else:
        b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qb + h0 * stride_qh + o_d, mask=m_d, other=0.0)
        b_q = b_q.to(tl.float32)
        if HAS_ALIBI:
            b_sl = tl.load(slopes_ptr + h0)
        if SOFTMAX:
            b_m = tl.full([BLOCK_T], float("-inf"), tl.float32)
            b_l = tl.zeros([BLOCK_T], tl.float32)
            b_acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        else:
            b_lb = tl.full([], float("-inf"), tl.float32)
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
        rel = (pos - pos_q).to(tl.float32)
        if PREFETCH:  # the next tile's pages, while this tile's K is in flight
            i_row_nx, pos_nx, m_tok_nx, phys_nx = _tile_pages(t0 + BLOCK_T, o_tt, t_hi, n, p_pages, p_bt,
                                                              P, DENSE)

        if USE_DOT:
            # ---- NG heads share the tile: [BLOCK_G, BLOCK_T] scores by tl.dot
            b_s = _qk(b_q, b_k, DOT_F32, PREC) * scale
            if SOFTMAX:
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
                if R < BLOCK_G:  # the copies of a head hold equal scores: fold them to [R, BLOCK_T]
                    b_s = tl.max(tl.reshape(b_s, [BLOCK_G // R, R, BLOCK_T]), axis=0)
                if HAS_ALIBI:
                    b_s += b_sl[:, None] * rel[None, :]
                b_s = tl.where(m_h[:, None] & m_tok[None, :], b_s, float("-inf"))
                b_x = b_s * am1
                b_top = tl.maximum(b_top, b_x)
                if LB_MODE == 0:
                    b_lb = _lb_update(b_top, b_lb, beta, BETA_KIND, NEWTON)
                else:
                    b_lb, b_mx = _lb_step(b_top, b_lb, b_mx, beta, BETA_KIND, NEWTON, 1)
                m_c = b_x > b_lb[:, None]  # only these can be in the support
                b_nc = _stage(cx_ptr, ci_ptr, o_c[:, None], b_nc, m_c, b_x, (phys * P + i_row).to(tl.int32)[None, :],
                              o_tt[None, :], BLOCK_T)
        else:
            # ---- one head: per-slot running state, no per-tile reduction
            b_s = tl.sum(b_q[None, :] * b_k.to(tl.float32), axis=1) * scale
            if HAS_ALIBI:
                b_s += b_sl * rel
            b_s = tl.where(m_tok, b_s, float("-inf"))
            if SOFTMAX:
                m_new = tl.maximum(b_m, b_s)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.exp(b_s - m_use)
                corr = tl.exp(b_m - m_use)
                b_l = b_l * corr + b_p
                o_v = phys * stride_vp + kvh * stride_vh + i_row * stride_vr
                b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
                b_acc = b_acc * corr[:, None] + b_p[:, None] * b_v.to(tl.float32)
                b_m = m_new
            else:
                b_x = b_s * am1
                b_top = tl.maximum(b_top, b_x)  # as in the tl.dot branch
                if LB_MODE == 0:
                    b_lb = _lb_update_1d(b_top, b_lb, beta, BETA_KIND, NEWTON)
                else:
                    b_lb, b_mx = _lb_step(b_top, b_lb, b_mx, beta, BETA_KIND, NEWTON, 0)
                m_c = b_x > b_lb
                b_nc = _stage(cx_ptr, ci_ptr, o_c, b_nc, m_c, b_x, (phys * P + i_row).to(tl.int32), o_tt, BLOCK_T)
        if PREFETCH:
            i_row, pos, m_tok, phys = i_row_nx, pos_nx, m_tok_nx, phys_nx

    if SOFTMAX:
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
    else:
        # the split's max and a last lb update (a tighter start for the solve)
        o_r = (i_b * HQ + h0 + o_h).to(tl.int64) * NSPLIT + i_s
        if USE_DOT:
            b_lb = _lb_update(b_top, b_lb, beta, BETA_KIND, NEWTON)
            b_cnt = _compact(cx_ptr, ci_ptr, o_c, b_nc, R, BLOCK_T)
            tl.store(cn_ptr + o_r, b_cnt, mask=m_h)
            tl.store(clb_ptr + o_r, b_lb, mask=m_h)
            tl.store(cm_ptr + o_r, tl.max(b_top, axis=1), mask=m_h)
        else:
            b_lb = _lb_update_1d(b_top, b_lb, beta, BETA_KIND, NEWTON)
            b_cnt = _compact(cx_ptr, ci_ptr, o_c + tl.zeros([1], tl.int64), b_nc[None, :], 1, BLOCK_T)
            tl.store(cn_ptr + o_r, b_cnt, mask=m_h)
            tl.store(clb_ptr + o_r, b_lb[None], mask=m_h)
            tl.store(cm_ptr + o_r, tl.max(b_top, axis=0)[None], mask=m_h)
    if POLL == 2:
        publish(done_ptr + i_r)


@triton.jit
def _terms(b_x, tau, mshift, beta, BETA_KIND: tl.constexpr, ORDER: tl.constexpr):
    """Per-candidate terms of the solver's sums (x = -inf: padding, adds nothing).

    ORDER 0: (1, x - mshift, (x - mshift)^2, x, -inf) for x > tau and
    (0, 0, 0, +inf, x) otherwise: summed / min / max they give the count, the
    shifted moments, the smallest x above tau and the largest x at or below
    it, for the closed forms. ORDER 2: (u^beta, u^(beta-1), u^(beta-2)) with
    u = [x - tau]_+, for f, f', f'' (the last two entries unused)."""
    on = b_x > tau
    if ORDER == 0:
        d = tl.where(on, b_x - mshift, 0.0)
        t0 = on.to(tl.float32)
        t1 = d
        t2 = d * d
        t3 = tl.where(on, b_x, float("inf"))
        t4 = tl.where(on, float("-inf"), b_x)
    else:
        b_u = tl.where(on, b_x - tau, 0.0)
        t0, t1 = entmax_pows(b_u, beta, BETA_KIND)
        t2 = tl.where(on, t1 / tl.where(on, b_u, 1.0), 0.0)
        t3 = b_x
        t4 = b_x
    return t0, t1, t2, t3, t4


@triton.jit
def _sum3_min_max(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, tl.minimum(a3, b3), tl.maximum(a4, b4)


@triton.jit
def _sum3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _reduce_terms(t0, t1, t2, t3, t4, AXIS: tl.constexpr, ORDER: tl.constexpr, FUSED: tl.constexpr):
    """The solver's reductions of _terms along AXIS: sums of t0..t2 and (ORDER
    0) the min of t3 and max of t4 (ORDER 2: t2 again in their place). FUSED:
    one multi-operand reduction (one cross-warp exchange for all, not one
    each: the solve is a chain of such rounds)."""
    if ORDER == 0:
        if FUSED:
            r0, r1, r2, r3, r4 = tl.reduce((t0, t1, t2, t3, t4), AXIS, _sum3_min_max)
        else:
            r0 = tl.sum(t0, axis=AXIS)
            r1 = tl.sum(t1, axis=AXIS)
            r2 = tl.sum(t2, axis=AXIS)
            r3 = tl.min(t3, axis=AXIS)
            r4 = tl.max(t4, axis=AXIS)
    else:
        if FUSED:
            r0, r1, r2 = tl.reduce((t0, t1, t2), AXIS, _sum3)
        else:
            r0 = tl.sum(t0, axis=AXIS)
            r1 = tl.sum(t1, axis=AXIS)
            r2 = tl.sum(t2, axis=AXIS)
        r3 = r2
        r4 = r2
    return r0, r1, r2, r3, r4


@triton.jit
def _cand_sums(p_x, n_s, max_n, tau, mshift, beta, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, ORDER: tl.constexpr, FUSED: tl.constexpr):
    """Sums of _terms over the candidates of one head in memory: NSPLIT lists
    of CAP entries at p_x, n_s [NS_P2] entries in use (max_n = their max)."""
    o_s = tl.arange(0, NS_P2)
    a0 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a1 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a2 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a3 = tl.full([NS_P2, BLOCK_K], float("inf"), tl.float32)
    a4 = tl.full([NS_P2, BLOCK_K], float("-inf"), tl.float32)
    for k0 in range(0, max_n, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k[None, :] < n_s[:, None]
        b_x = tl.load(p_x + (o_s.to(tl.int64) * CAP)[:, None] + o_k[None, :], mask=m_k, other=float("-inf"))
        t0, t1, t2, t3, t4 = _terms(b_x, tau, mshift, beta, BETA_KIND, ORDER)
        a0 += t0
        a1 += t1
        a2 += t2
        if ORDER == 0:  # (the extrema are unused for ORDER 2)
            a3 = tl.minimum(a3, t3)
            a4 = tl.maximum(a4, t4)
    r0, r1, r2, r3, r4 = _reduce_terms(a0, a1, a2, a3, a4, 1, ORDER, FUSED)
    return _reduce_terms(r0, r1, r2, r3, r4, 0, ORDER, FUSED)


@triton.jit
def _sums(p_x, n_s, max_n, b_xr, tau, mshift, beta, CAP,
          NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
          BETA_KIND: tl.constexpr, ORDER: tl.constexpr, IN_REGS: tl.constexpr, FUSED: tl.constexpr):
    """The solver's sums over a head's candidates: from memory (_cand_sums) or,
    IN_REGS, over b_xr (1-D, padding -inf) held in registers.

    ORDER 0: (count, sum(x - mshift), sum((x - mshift)^2), min x, max x <= tau)
    over x > tau; ORDER 2: (f, f', f'', -, -) of f = sum [x - tau]_+^beta - 1."""
    if IN_REGS:
        t0, t1, t2, t3, t4 = _terms(b_xr, tau, mshift, beta, BETA_KIND, ORDER)
        r0, r1, r2, r3, r4 = _reduce_terms(t0, t1, t2, t3, t4, 0, ORDER, FUSED)
    else:
        r0, r1, r2, r3, r4 = _cand_sums(p_x, n_s, max_n, tau, mshift, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, ORDER, FUSED)
    if ORDER == 2:
        r0 = r0 - 1.0  # f
        r1 = -beta * r1  # f'
        r2 = beta * (beta - 1.0) * r2  # f''
    return r0, r1, r2, r3, r4


@triton.jit
def _solve_tau(p_x, n_s, max_n, b_xr, lb, m, total, t_init, alpha, beta, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
               HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr,
               IN_REGS: tl.constexpr, FUSED: tl.constexpr):
    """Exact tau of one query head over its ``total`` candidates (lists in
    memory, or b_xr in registers: see _sums), every other kept x being
    <= lb <= tau; m: their largest x; t_init: the warm start (HAS_INIT).
    +inf when there is no candidate."""
    empty = total == 0
    m = tl.where(empty, 0.0, m)

    # Bracket [lo, hi]: f(m - 1) >= 0 and, over c candidates, f(m - c^(1-alpha)) <= 0.
    c = tl.maximum(total, 1).to(tl.float32)
    lo = tl.maximum(tl.where(empty, -1.0, lb), m - 1.0)
    hi = m - tl.exp2((1.0 - alpha) * tl.log2(c))
    lo = tl.minimum(lo, hi)

    if BETA_KIND != 0:
        # Newton from the left (monotone for convex f); on each support try the
        # closed form, which is exact once the support is the final one.
        tau = lo
        it = tl.full([], 0, tl.int32)
        go = tl.full([], 1, tl.int32)
        while (go != 0) & (it < NEWTON_CAP):
            k, s1, s2, mn, mx_off = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                          BETA_KIND, 0, IN_REGS, FUSED)
            kk = tl.maximum(k, 1.0)
            dt = tau - m
            # (tau >= lo, so a closed form rounding below lo is taken as lo)
            if BETA_KIND == 1:
                tc = tl.maximum(m + (s1 - 1.0) / kk, lo)
                t_next = tc
            else:
                disc = s1 * s1 - kk * (s2 - 1.0)
                tc = m + (s1 - tl.sqrt(tl.maximum(disc, 0.0))) / kk
                tc = tl.where(disc >= 0, tl.maximum(tc, lo), float("-inf"))
                # f = sum (d - dt)^2 - 1, f' = -2 sum (d - dt), d = x - m on the support
                f = s2 - 2.0 * dt * s1 + kk * dt * dt - 1.0
                fp = 2.0 * (s1 - kk * dt)
                t_next = tau + f / tl.where(fp > 0, fp, 1.0)
            # exact iff the support of tc is the support it was computed on:
            # every counted x above tc, every other x at or below it (also
            # when rounding puts tc a hair below tau)
            exact = (mn > tc) & (mx_off <= tc) & (k > 0) & (tc > float("-inf"))
            tau = tl.where(exact, tc, tl.maximum(t_next, tau))
            go = tl.where(exact | (k == 0), 0, 1)
            it += 1
    else:
        if HAS_INIT:
            t0 = tl.where(t_init == t_init, t_init, lo)  # NaN -> lo
            tau = tl.minimum(tl.maximum(t0, lo), hi)
        else:
            tau = lo
        for _ in range(HALLEY):
            f, d1, d2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, 2, IN_REGS, FUSED)
            above = f > 0
            lo = tl.where(above, tau, lo)
            hi = tl.where(above, hi, tau)
            d1s = tl.where(d1 != 0, d1, -1.0)
            newton = -f / d1s
            L = f * d2 / (d1s * d1s)
            L = tl.where(L == L, L, 0.0)
            L = tl.minimum(tl.maximum(L, -1.0), 1.0)
            cand = tau + newton / (1.0 - 0.5 * L)
            ok = (cand >= lo) & (cand <= hi) & (d1 != 0)
            tau = tl.where(ok, cand, 0.5 * (lo + hi))
        for _ in range(POLISH):
            f, d1, d2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, 2, IN_REGS, FUSED)
            step = tl.where(d1 != 0, -f / tl.where(d1 != 0, d1, 1.0), 0.0)
            tau = tl.minimum(tl.maximum(tau + step, lo), hi)
    return tl.where(empty, float("inf"), tau)


@triton.jit
def _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s, NSPLIT: tl.constexpr, HAS_INIT: tl.constexpr):
    """What the splits of query-head row i_r left for the solve: (lb, m, the
    list lengths n_s [NS_P2], their max and sum, the warm start or 0)."""
    m_s = o_s < NSPLIT
    lb = tl.max(tl.load(clb_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf")), axis=0)
    m = tl.max(tl.load(cm_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf")), axis=0)
    n_s = tl.load(cn_ptr + i_r * NSPLIT + o_s, mask=m_s, other=0)
    if HAS_INIT:
        t_init = tl.load(tinit_ptr + i_r)
    else:
        t_init = 0.0
    return lb, m, n_s, tl.max(n_s, axis=0), tl.sum(n_s, axis=0), t_init


@triton.jit
def _solve_kernel(
    cx_ptr, cn_ptr, clb_ptr, cm_ptr, tinit_ptr, tau_ptr,
    alpha, beta, CAP,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
    BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
    HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr, IN_REGS: tl.constexpr,
    FUSED: tl.constexpr, PDL: tl.constexpr,
):
    """Exact tau of one query head over the candidate lists of its splits
    (from registers when they fit one tile, else from memory)."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, NS_P2)
    lb, m, n_s, max_n, total, t_init = _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s,
                                                  NSPLIT, HAS_INIT)
    p_x = cx_ptr + i_r * NSPLIT * CAP
    if IN_REGS and max_n <= BLOCK_K:
        # every list fits one [NS_P2, BLOCK_K] tile (short selections): load it
        # once and iterate in registers, not one round trip to L2 per step
        o_k = tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + (o_s.to(tl.int64) * CAP)[:, None] + o_k[None, :],
                      mask=o_k[None, :] < n_s[:, None], other=float("-inf"))
        tau = _solve_tau(p_x, n_s, max_n, tl.reshape(b_x, [NS_P2 * BLOCK_K]), lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, True, FUSED)
    else:
        tau = _solve_tau(p_x, n_s, max_n, lb, lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, False, FUSED)
    tl.store(tau_ptr + i_r, tau)


@triton.jit
def _pv_rows(v_ptr, b_tok, b_p, m_p, kvh, o_d, m_d, stride_vp, stride_vh, stride_vr, P: tl.constexpr):
    """p * V [BLOCK_C, BLOCK_D] for physical token ids b_tok of KV head kvh;
    rows outside m_p load nothing and give 0."""
    o_v = (b_tok // P).to(tl.int64) * stride_vp + kvh * stride_vh + (b_tok % P) * stride_vr
    b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_p[:, None] & m_d[None, :], other=0.0)
    return tl.where(m_p, b_p, 0.0)[:, None] * b_v.to(tl.float32)


@triton.jit
def _vacc_kernel(
    v_ptr, cx_ptr, ci_ptr, cn_ptr, tau_ptr, pacc_ptr,
    beta, CAP,
    stride_vp, stride_vh, stride_vr,
    HQ, G,
    NSPLIT: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BETA_KIND: tl.constexpr, ACC_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """p = [x - tau]_+^beta over the candidate list of one (query head, split);
    V rows are gathered only where p > 0 (usually one short block per list).

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
    tau = tl.load(tau_ptr + r)
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
        b_p = entmax_prob(tl.maximum(b_x - tau, 0.0), beta, BETA_KIND)
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
def _compact_support(cx_ptr, ci_ptr, base, w0, b_x, b_tok, tau, beta, CAP,
                     NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BETA_KIND: tl.constexpr):
    """Stores (p, token id) of the candidates b_x with p > 0 as support
    tokens w0, w0 + 1, ... (_support_slot with chunks of BLOCK_M columns; 0:
    the flat order) and returns how many. All of this program's threads must
    have read those slots already."""
    b_p = entmax_prob(tl.maximum(b_x - tau, 0.0), beta, BETA_KIND)
    keep = b_p > 0
    o_w = w0 + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    if BLOCK_M == 0:
        o_c = base + o_w
    else:
        o_c = _support_slot(base, o_w, CAP, BLOCK_M, NSPLIT)
    tl.debug_barrier()  # every thread's candidates are read before any slot is overwritten
    tl.store(cx_ptr + o_c, b_p, mask=keep)
    tl.store(ci_ptr + o_c, b_tok, mask=keep)
    return tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _finish_kernel(
    cx_ptr, ci_ptr, cn_ptr, clb_ptr, cm_ptr, tinit_ptr, tau_ptr, v_ptr, out_ptr, done_ptr,
    alpha, beta, CAP,
    stride_vp, stride_vh, stride_vr, stride_ob, stride_oh,
    HQ, G,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
    HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr, MODE: tl.constexpr,
    FUSED: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, PDL: tl.constexpr,
):
    """The work of _solve_kernel, _vacc_kernel and _combine_kernel for one
    query head in one program.

    tau is solved over the candidates as _solve_kernel does: in registers
    when every list fits one [NS_P2, BLOCK_K] tile (MODE 0: always, as for
    top-k budgets; 1: when this row's do), else from memory (MODE 2: always).
    Then the support (p > 0, usually a handful of tokens) is compacted into
    the row's own, already read, candidate lists (cumsum positions), and the
    V rows are gathered in blocks of BLOCK_C support tokens, not over every
    candidate; their sum is the output (entmax needs no rescaling across
    splits). POLL: wait for done[row] to reach NSPLIT (the split programs
    counted in, poll_ready) rather than for the whole split pass."""
    i_r = tl.program_id(0).to(tl.int64)  # b * HQ + query head
    if POLL:
        poll_start(done_ptr + i_r, NSPLIT, POLLS, PDL)
    else:
        pdl_start(PDL)
    o_s = tl.arange(0, NS_P2)
    lb, m, n_s, max_n, total, t_init = _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s,
                                                  NSPLIT, HAS_INIT)
    base = i_r * NSPLIT * CAP
    if MODE == 0:
        in_regs = True
    elif MODE == 1:
        in_regs = max_n <= BLOCK_K
    else:
        in_regs = False
    if in_regs:
        b_xr, b_tok = _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, 0, CAP, NS_P2, BLOCK_K)
        tau = _solve_tau(cx_ptr + base, n_s, max_n, b_xr, lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, True, FUSED)
        n_sup = _compact_support(cx_ptr, ci_ptr, base, 0, b_xr, b_tok, tau, beta, CAP, NSPLIT, 0, BETA_KIND)
        cw = tl.zeros([], tl.int32) + CAP  # (the flat order)
    else:
        tau = _solve_tau(cx_ptr + base, n_s, max_n, lb, lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, False, FUSED)
        # [NSPLIT, BLOCK_M] chunks, columns c0.. of every list at once; the
        # w-th support token goes to the w-th slot in chunk order (chunk,
        # split, column: _support_slot), which is in a chunk already read
        # (w < tokens kept so far <= slots read so far); BLOCK_M divides CAP
        n_sup = tl.zeros([], tl.int32)
        cw = tl.zeros([], tl.int32) + BLOCK_M
        for c0 in range(0, max_n, BLOCK_M):
            b_x, b_tok = _list_columns(cx_ptr, ci_ptr, base, o_s, n_s, c0, CAP, NS_P2, BLOCK_M)
            n_sup += _compact_support(cx_ptr, ci_ptr, base, n_sup, b_x, b_tok, tau, beta, CAP,
                                      NSPLIT, BLOCK_M, BETA_KIND)
    tl.store(tau_ptr + i_r, tau)  # (an empty row: +inf, every p 0 and the output 0)
    tl.debug_barrier()  # the compacted support is read back by other threads of this program
    kvh = (i_r % HQ) // G
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_acc = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)
    for c0 in range(0, n_sup, BLOCK_C):
        o_j = c0 + tl.arange(0, BLOCK_C)
        m_j = o_j < n_sup
        o_w = _support_slot(base, o_j, CAP, cw, NSPLIT)
        b_pj = tl.load(cx_ptr + o_w, mask=m_j, other=0.0)
        b_tj = tl.load(ci_ptr + o_w, mask=m_j, other=0)
        b_acc += _pv_rows(v_ptr, b_tj, b_pj, m_j, kvh, o_d, m_d, stride_vp, stride_vh, stride_vr, P)
    b_o = tl.sum(b_acc, axis=0)
    i_b = i_r // HQ
    i_h = i_r % HQ
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_d, b_o.to(out_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, tau_ptr, out_ptr, done_ptr,
    stride_ob, stride_oh, HQ,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTMAX: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, PDL: tl.constexpr,
):
    """Merge a row's NSPLIT partials into its output (softmax: by their
    maxima and sums; entmax: a sum). POLL as _finish_kernel's."""
    i_r = tl.program_id(0).to(tl.int64)
    if POLL:
        poll_start(done_ptr + i_r, NSPLIT, POLLS, PDL)
    else:
        pdl_start(PDL)
    o_s = tl.arange(0, NS_P2)
    m_s = o_s < NSPLIT
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_acc = tl.load(pacc_ptr + (i_r * NSPLIT + o_s)[:, None] * D + o_d[None, :],
                    mask=m_s[:, None] & m_d[None, :], other=0.0)
    if SOFTMAX:
        b_m = tl.load(pm_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf"))
        b_l = tl.load(pl_ptr + i_r * NSPLIT + o_s, mask=m_s, other=0.0)
        m = tl.max(b_m, axis=0)
        empty = m == float("-inf")
        m_use = tl.where(empty, 0.0, m)
        w = tl.exp(b_m - m_use)
        l = tl.sum(w * b_l, axis=0)
        l_use = tl.where(empty, 1.0, l)
        b_o = tl.sum(w[:, None] * b_acc, axis=0) / l_use
        b_o = tl.where(empty, 0.0, b_o)
        tau = tl.where(empty, float("inf"), m_use + tl.log(l_use))
        tl.store(tau_ptr + i_r, tau)
    else:
        b_o = tl.sum(b_acc, axis=0)
    i_b = i_r // HQ
    i_h = i_r % HQ
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_d, b_o.to(out_ptr.dtype.element_ty), mask=m_d)


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, cache) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.kv_heads:
        raise ValueError(f"q: expected [batch, q_heads, {cache.head_dim}] with q_heads a multiple "
                         f"of {cache.kv_heads}, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q: the head_dim axis must be contiguous")
    if cache.num_pages * cache.page_size >= 2**31:
        raise ValueError("cache: num_pages * page_size must stay below 2**31 (token ids are int32)")


def _run(
    q, cache, seq_ids, pages, counts, S: int, W: int, dense: bool, *,
    alpha: float, scale: float, slopes, tau_init, want_out: bool = True, ready=None, config: KernelConfig,
):
    """Launch the split pass and the finishing kernels; returns (out or None, tau).
    ``ready``: Selection.pending.counters (int32 [2, B, S]) or None
    (AttentionConfig.poll_ready); ``config``: the launch choices."""
    c = config.attention
    _check_inputs(q, cache)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    NG = HQ // S
    dev = q.device
    qk = q.float() if q.dtype == torch.float64 else q  # the oracle dtype runs in float32
    softmax = alpha == 1.0
    cfg = _plan(c, B, S, NG, D, W, P, dev, softmax, cache.k_pages.element_size(), dense)
    NSPLIT, BLOCK_T = cfg["NSPLIT"], cfg["BLOCK_T"]
    NS_P2 = next_pow2(NSPLIT)
    dot_f32, prec = dot_flags(cache.dtype)
    if qk.dtype != cache.dtype:
        dot_f32, prec = True, "ieee"
    (skp, skh, skr), (svp, svh, svr) = kv_strides(cache)
    sl = as_slopes(slopes, HQ, dev)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    if dense:  # unread placeholders (DENSE walks every page): torch.empty launches no fill
        pages = torch.empty(1, 1, 1, dtype=torch.int32, device=dev)
        counts = torch.empty(1, 1, dtype=torch.int32, device=dev)
    R = B * HQ
    f32 = torch.float32
    tau = torch.empty(R, dtype=f32, device=dev)
    beta = 1.0 / (alpha - 1.0) if not softmax else 1.0
    bk = beta_kind(alpha)
    CAP = 1
    if softmax:
        pm = torch.empty(R, NSPLIT, dtype=f32, device=dev)
        pl = torch.empty(R, NSPLIT, dtype=f32, device=dev)
        cx = ci = cn = clb = cm = pm  # unused
        finish = False
    else:
        # one candidate list per (query head, split), room for all its tokens
        # (staged as rows of BLOCK_T slots, then compacted in place)
        CAP = cdiv(_max_share(W, NSPLIT, cfg["MIN_PER"]) * P, BLOCK_T) * BLOCK_T
        cx = torch.empty(R * NSPLIT * CAP, dtype=f32, device=dev)
        ci = torch.empty(R * NSPLIT * CAP, dtype=torch.int32, device=dev)
        cn = torch.empty(R, NSPLIT, dtype=torch.int32, device=dev)
        clb = torch.empty(R, NSPLIT, dtype=f32, device=dev)
        cm = torch.empty(R, NSPLIT, dtype=f32, device=dev)
        pm = pl = clb  # unused
        block_k = max(4, c.solve_tile // NS_P2)  # [NS_P2, BLOCK_K] candidates per step
        fits = CAP <= block_k
        finish = want_out and c.finish and (fits or cfg["USE_DOT"] or NSPLIT <= c.finish_max_splits)
    # the split partials, read by _vacc_kernel / _combine_kernel only
    pacc = torch.empty(R, NSPLIT, D, dtype=f32, device=dev) if softmax or (want_out and not finish) else pm
    newton = c.tile_newton if (not softmax and alpha <= 2.0) else 0
    lb_mode = getattr(c, "lb_mode_" + cfg["PATH"]) if newton <= 1 else 0  # the fused step takes one Newton step at most
    opts = launch_opts(dev, config.pdl)
    # poll_ready: the split programs wait for their own rows; with one query
    # head per row and two launches (split, then finish or combine) the
    # second waits for its rows' split programs too
    poll = 0
    if c.poll_ready and ready is not None and not dense and W * P <= c.poll_max_tokens:
        poll = 2 if (S == HQ and want_out and (softmax or finish)) else 1
    rdy = ready[0] if poll else tau
    done = ready[1] if poll == 2 else tau

    rows_first = bool(poll) and c.poll_rows_first and B * S < 65536  # (a grid's y extent)
    _split_kernel[(NSPLIT, B * S) if rows_first else (B * S, NSPLIT)](
        qk, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens, ids, pages, counts, sl,
        pm, pl, pacc,
        cx, ci, cn, clb, cm, rdy, done,
        float(scale), float(alpha - 1.0), float(beta),
        qk.stride(0), qk.stride(1),
        skp, skh, skr, svp, svh, svr,
        cache.block_table.stride(0), pages.stride(0), pages.stride(1), counts.stride(0),
        HQ, G, W, CAP,
        S=S, NG=NG, NSPLIT=NSPLIT, MIN_PER=cfg["MIN_PER"], P=P, D=D,
        BLOCK_G=cfg["BLOCK_G"], R=cfg["R"], BLOCK_D=cfg["BLOCK_D"], BLOCK_T=BLOCK_T,
        DENSE=dense, SOFTMAX=softmax, HAS_ALIBI=slopes is not None,
        BETA_KIND=bk, NEWTON=newton, LB_MODE=lb_mode,
        USE_DOT=cfg["USE_DOT"], DOT_F32=dot_f32, PREC=prec, PREFETCH=cfg["PREFETCH"],
        LOOP_STAGES=cfg["LOOP_STAGES"], POLL=poll, POLLS=c.poll_polls, ROWS_FIRST=rows_first,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **opts,
    )
    if not softmax:
        tinit = tau_init.reshape(R).to(f32).contiguous() if tau_init is not None else tau
        fused = c.fused_sums and (c.fused_sums_interpreted or not interpreting())
        if finish:
            out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev)
            block_d = next_pow2(D)
            _finish_kernel[(R,)](
                cx, ci, cn, clb, cm, tinit, tau, cache.v_pages, out, done,
                float(alpha), float(beta), CAP,
                svp, svh, svr, out.stride(0), out.stride(1),
                HQ, G,
                NSPLIT=NSPLIT, NS_P2=NS_P2, BLOCK_K=block_k, BLOCK_M=min(block_k, BLOCK_T),  # (divides CAP)
                P=P, D=D, BLOCK_D=block_d, BLOCK_C=max(16, min(c.finish_block, 8192 // block_d)),
                BETA_KIND=bk, HAS_INIT=tau_init is not None,
                HALLEY=c.halley_iters, POLISH=c.polish_iters, NEWTON_CAP=c.newton_max,
                MODE=(0 if fits else 1) if c.solve_in_regs else 2, FUSED=fused, POLL=poll == 2, POLLS=c.poll_polls,
                num_warps=c.finish_warps[0 if fits else 1], **opts,
            )
            return out, tau.view(B, HQ)
        _solve_kernel[(R,)](
            cx, cn, clb, cm, tinit, tau,
            float(alpha), float(beta), CAP,
            NSPLIT=NSPLIT, NS_P2=NS_P2, BLOCK_K=block_k,
            BETA_KIND=bk, HAS_INIT=tau_init is not None,
            HALLEY=c.halley_iters, POLISH=c.polish_iters, NEWTON_CAP=c.newton_max, IN_REGS=c.solve_in_regs,
            FUSED=fused, num_warps=8, **opts,
        )
        if not want_out:
            return None, tau.view(B, HQ)
        block_d = next_pow2(D)
        vblock, vwarps, vrows = c.vacc_small_d if block_d <= 64 else c.vacc_large_d
        _vacc_kernel[(R, NSPLIT)](
            cache.v_pages, cx, ci, cn, tau, pacc,
            float(beta), CAP,
            svp, svh, svr,
            HQ, G,
            NSPLIT=NSPLIT, P=P, D=D, BLOCK_D=block_d,
            BLOCK_C=max(16, min(vblock, 8192 // block_d)), BETA_KIND=bk, ACC_ROWS=vrows,
            num_warps=vwarps, **opts,
        )
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev)
    _combine_kernel[(R,)](
        pm, pl, pacc, tau, out, done,
        out.stride(0), out.stride(1), HQ,
        NSPLIT=NSPLIT, NS_P2=NS_P2, D=D, BLOCK_D=next_pow2(D), SOFTMAX=softmax,
        POLL=poll == 2, POLLS=c.poll_polls,
        num_warps=1 if D <= 64 else 2, **opts,
    )
    return out, tau.view(B, HQ)


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    sel: Selection,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    tau_init: Optional[torch.Tensor] = None,
    config=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact alpha-entmax (alpha = 1: softmax) attention over the selected pages.

    Triton twin of ``entmaxkv.attention.attend``: reads only the K of the
    selected pages through the block table (each page once for every query
    head of its selection row), solves tau exactly per query head over the
    kept scores, and reads V only for tokens in the support (softmax: every
    kept token).

    Args:
        q: [batch, q_heads, head_dim] float16/bfloat16/float32 (float64 runs in
            float32), head_dim axis contiguous.
        cache: PagedKVCache (k_pages/v_pages [num_pages, kv_heads, P, D]).
        seq_ids: int32/int64 [batch] cache slots, on the cache device.
        sel: Selection; pages int32 [batch, S, W] logical page ids (any order,
            distinct, first counts[b, s] valid), counts int32 [batch, S],
            S = kv_heads (one selection per KV group) or q_heads. When it
            comes from the launch just before (``pending``), each row starts
            as soon as it is selected (AttentionConfig.poll_ready).
        alpha: >= 1 (1 softmax, 1.5, 2 fast paths; any alpha > 1 works).
        scale: score scale; slopes: optional float [q_heads] ALiBi slopes.
        tau_init: optional float [batch, q_heads] warm start (used, clamped
            into the bracket, by the general-alpha Halley solver only).
    Returns:
        out [batch, q_heads, head_dim] in q's dtype (zeros for a head with no
        kept token) and tau float32 [batch, q_heads] (softmax: log-sum-exp;
        +inf for a head with no kept token).
    Workspace: float32+int32 candidates of size batch * q_heads * W * P for
    entmax (W = sel width), allocated per call.
    """
    B, HQ, _ = q.shape
    pages, counts = sel.pages, sel.counts
    S, W = pages.shape[1], pages.shape[2]
    if S not in (cache.kv_heads, HQ) or pages.shape[0] != B:
        raise ValueError(f"sel: expected pages [batch, kv_heads or q_heads, W], got {tuple(pages.shape)}")
    if pages.dtype != torch.int32:
        pages = pages.to(torch.int32)
    if counts.dtype != torch.int32:
        counts = counts.to(torch.int32)
    counts = counts.contiguous()
    if pages.stride(-1) != 1:
        pages = pages.contiguous()
    ready = None
    if sel.pending is not None and sel.pending.launch == launch_count():  # nothing launched since it
        ready = sel.pending.counters
        if (ready.dtype != torch.int32 or tuple(ready.shape) != (2, B, S) or not ready.is_contiguous()
                or ready.device != q.device):
            raise ValueError(f"sel: pending.counters must be a contiguous int32 [2, {B}, {S}] tensor on "
                             f"{q.device}, got {ready.dtype} {tuple(ready.shape)} on {ready.device}")
    return _run(q, cache, seq_ids, pages, counts, S, max(W, 1), False,
                alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init, ready=ready,
                config=resolve(config))


def dense_attend(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-cache attention (the ``Full`` policy) without a Selection.

    Same algorithm as :func:`attend` with every logical page of each sequence
    kept; the entmax version writes only the candidate scores (x above a
    running lower bound on tau) to HBM, never the whole score row, and reads
    V only for support tokens.

    Args and returns as :func:`attend` (no ``sel``, no ``tau_init``).
    Workspace (entmax): batch * q_heads * max_pages_per_seq * P candidates.
    """
    M = cache.block_table.shape[1]
    return _run(q, cache, seq_ids, None, None, cache.kv_heads, M, True,
                alpha=alpha, scale=scale, slopes=slopes, tau_init=None, config=resolve(config))


def selection_tau(q, cache, seq_ids, sel: Selection, *, alpha: float, scale: float,
                  slopes=None, tau_init=None, config=None) -> torch.Tensor:
    """tau [batch, q_heads] over the selected pages without computing the output
    (entmax only; used by the certified policy)."""
    B, HQ, _ = q.shape
    S, W = sel.pages.shape[1], sel.pages.shape[2]
    _, tau = _run(q, cache, seq_ids, sel.pages.to(torch.int32).contiguous(), sel.counts.to(torch.int32),
                  S, max(W, 1), False, alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init,
                  want_out=False, config=resolve(config))
    return tau
