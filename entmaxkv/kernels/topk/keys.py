"""Pass 0 of the top-k selection: the rank keys of every page and KV head
(``_topk_keys_kernel``) and the group maxima of
the key table (``_topk_gmax_kernel``) behind the pre-filter's lower bound."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import grid_ids, pdl_start, publish, store_b32
from ..scoring import page_rows
from .search import INT32_MIN, _gmax_block, page_rank, row_budget, sortable_key


@triton.jit
def _keys_chunk(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr, i_b, i_c,
    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off,
    M, MK, sinks, window, k_pages,
    H: tl.constexpr, G: tl.constexpr, HG: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr, HAS_ALIBI: tl.constexpr,
    WRITE_UB: tl.constexpr, AS_IS: tl.constexpr,
):
    """_topk_keys_kernel's work for batch row i_b and page chunk i_c (a helper, so
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
        b_k = b_raw.to(tl.float32)
        if WRITE_UB:
            b_kabs = tl.max(tl.abs(b_k), axis=2)  # [BLOCK_M, HG, BLOCK_D]
        # a KV head's rank is the largest bound of its G query heads (the
        # metadata is read once for all of them)
        b_rank = tl.full([BLOCK_M, HG], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            o_qh = o_h * G + g  # the query heads of KV heads o_h
            # the step's queries (and slopes) are reloaded per step: L1 hits
            b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qb + o_qh[:, None] * stride_qh + o_d[None, :],
                          mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            # half 0 multiplies k_min (the negative part of q), half 1 k_max (the positive part)
            # (tl.where keeps a NaN of q, which tl.minimum / tl.maximum may drop:
            # NaN bounds, as in the reference)
            b_qq = tl.where((o_2 == 0)[None, :, None], tl.where(b_q > 0.0, 0.0, b_q)[:, None, :],
                            tl.where(b_q < 0.0, 0.0, b_q)[:, None, :])
            b_u = tl.sum(tl.sum(b_k * b_qq[None, :, :, :], axis=3), axis=2) * scale  # [BLOCK_M, HG]
            if HAS_ALIBI:
                b_sl = tl.load(slopes_ptr + o_qh, mask=m_h, other=0.0)
                pos_q = n - 1
                rel_first = (o_m * P - pos_q).to(tl.float32)
                rel_last = (o_m * P + n_tok - 1 - pos_q).to(tl.float32)
                b_u += tl.maximum(rel_first[:, None] * b_sl[None, :], rel_last[:, None] * b_sl[None, :])
            b_u = tl.where(m_v[:, None], b_u, float("-inf"))
            if WRITE_UB:  # the certified policy's safe bound: u + rounding slack (scoring.bound_slack)
                b_mag = tl.sum(b_kabs * tl.abs(b_q)[None, :, :], axis=2) * scale
                if HAS_ALIBI:
                    b_mag += tl.abs(b_sl)[None, :] * (n + 1).to(tl.float32)
                b_slack = (4.0 * (D + 4) * 1.1920928955078125e-07) * b_mag
                o_urow = (i_b * H * G + o_qh).to(tl.int64)
                tl.store(ub_ptr + o_urow[None, :] * M + o_m[:, None], b_u + b_slack,
                         mask=(o_m < M)[:, None] & m_h[None, :])
            b_rank = tl.maximum(b_rank, page_rank(b_u))
        o_row = (i_b * H + o_h).to(tl.int64)
        forced = (o_m < sinks) | (o_m >= npages - wnd)
        b_rank = tl.where(forced[:, None], float("inf"), b_rank)
        b_key = tl.where(m_v[:, None], sortable_key(b_rank), INT32_MIN)
        store_b32(key_ptr + o_row[None, :] * MK + o_m[:, None], b_key, (o_m < MK)[:, None] & m_h[None, :], AS_IS)


@triton.jit
def _topk_keys_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off,
    M, MK, sinks, window, k_pages,
    H: tl.constexpr, G: tl.constexpr, HG: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr, HAS_ALIBI: tl.constexpr,
    WRITE_UB: tl.constexpr, AS_IS: tl.constexpr, cnt_ptr, PUBLISH: tl.constexpr, PDL: tl.constexpr,
):
    """Rank keys of KCH = NSUB * BLOCK_M pages for *all* KV heads of a batch
    row: each page's metadata of HG heads is read as one contiguous run (HG a
    power of two dividing H, or next_pow2(H) masked), one (page block, head
    group) per step; a KV head's rank is the largest bound of its G query
    heads (one selection per KV head; ``ub``, when written, per query head). (Loading the next step's metadata
    before computing this step's keys measured no faster:
    experiments/logs/tune_keys.log.) Keys go to
    key_ptr[(b * H + h) * MK + page] (INT32_MIN past the end, up to
    MK = NCH * CH), in the layout _topk_chunk_kernel reads with KEYS_READY.
    Grid (B, chunks); with PUBLISH (chunks, B), so that programs start in
    batch order, each raising int32 cnt[b] by one once its keys are stored
    (the overlapped selection, TopKConfig.overlap)."""
    pdl_start(PDL)
    i_b, i_c = grid_ids(PUBLISH)
    _keys_chunk(q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, ub_ptr, i_b, i_c,
                scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off, M, MK, sinks, window, k_pages,
                H, G, HG, P, D, BLOCK_D, BLOCK_M, NSUB, HAS_ALIBI, WRITE_UB, AS_IS)
    if PUBLISH:  # every thread's keys stored before the release that publishes them
        publish(cnt_ptr + i_b)


@triton.jit
def _topk_gmax_kernel(key_ptr, gmax_ptr, ready_ptr, MK, NKP, NR, GS: tl.constexpr, GB: tl.constexpr,
                 ZERO: tl.constexpr, PDL: tl.constexpr):
    """The largest key of each group of GS pages of a key-table row
    (gmax[row * NKP + group], NKP = MK // GS groups): the pre-filter's group
    maxima. A pass of its own: carrying the maxima through _topk_keys_kernel's
    loop measured 1.25x slower on that pass (146.6 vs 117.2 us at 1 x 2M),
    and holding a whole row per program (to find lb there too) 12.9 us where
    this pass and _topk_lb_kernel take 3.4 + 4.8 us (8 x 128k). ZERO: the first
    program of row r also zeroes ready[r] and ready[NR + r] (the row's
    Pending.counters, which _topk_rowsel_kernel raises after this launch)."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    _gmax_block(key_ptr + i_r * MK, gmax_ptr + i_r * NKP, tl.program_id(1) * GB + tl.arange(0, GB), NKP, GS, "")
    if ZERO:
        if tl.program_id(1) == 0:
            tl.store(ready_ptr + i_r, 0)
            tl.store(ready_ptr + NR + i_r, 0)
