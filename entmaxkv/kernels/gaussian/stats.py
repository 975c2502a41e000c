"""Passes 1-2 of the Gaussian selection: page statistics and chunk partials
(``_gauss_stats_kernel``), merged into the bracket and the solve's start
(``_gauss_start_kernel``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import pdl_start
from ..scoring import gauss_of, kv_row, load_moments, page_rows
from .moments import _pooled_tau


@triton.jit
def _stats_pages(bt_ptr, kmean_ptr, kstd_ptr, seq, n, o_m, kvh, stride_mp, stride_mh, M, live,
                 P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr):
    """Pages o_m's valid mask, token counts and loaded k_mean / k_std (none
    valid unless ``live``: the prefetch past a chunk's last block). Loaded
    one block ahead, k_std stays in its storage dtype while in flight;
    loaded for use, it is converted at the load, as in ``page_gauss``."""
    phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
    m_v = m_v & live
    b_mean, b_std = load_moments(kmean_ptr, kstd_ptr, phys, m_v, kvh, stride_mp, stride_mh, D, BLOCK_D,
                                 not PREFETCH)
    return m_v, n_tok, b_mean, b_std


@triton.jit
def _gauss_stats_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmean_ptr, kstd_ptr,
    mu_ptr, sg_ptr, st_ptr, counts_ptr,
    scale, am1, stride_qb, stride_qh, stride_mp, stride_mh,
    HQ, G, M,
    H: tl.constexpr, NCH: tl.constexpr, NSR: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    i_c = tl.program_id(1)
    i_b, kvh, h0, seq, n, b_q, b_sl = kv_row(q_ptr, slopes_ptr, ids_ptr, lens_ptr, tl.program_id(0),
                                             stride_qb, stride_qh, G, H, D, BLOCK_G, BLOCK_D, HAS_ALIBI)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    o_row = (i_b * HQ + h0 + o_g).to(tl.int64)
    if i_c == 0:  # the selection's page counts (NSR selection rows per KV row), which it adds to atomically
        tl.store(counts_ptr + tl.program_id(0) * NSR + o_g, tl.zeros([BLOCK_G], tl.int32), mask=o_g < NSR)
    # Token-weighted (count, mean, M2) of the chunk's page mixture from sums
    # shifted by the first sub-block's mean k, accumulated per lane and reduced
    # once per program (no cross-warp reduction or merge inside the loop). With
    # k inside the chunk's range, M2 = S2 - S1^2 / W loses only a few ulps: no
    # E[x^2] - E[x]^2 cancellation under ALiBi offsets or a common score offset.
    k = tl.zeros([BLOCK_G], tl.float32)
    s_w = tl.zeros([BLOCK_M], tl.float32)
    s_1 = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
    s_2 = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
    a_lo = tl.full([BLOCK_G, BLOCK_M], float("-inf"), tl.float32)
    a_hi = tl.full([BLOCK_G, BLOCK_M], float("-inf"), tl.float32)
    # (page offsets are recomputed from j, not carried through the loop: a
    # carried offset measured slower, 232 vs 200 us at 1x2M without prefetch
    # and with k_std converted at its use)
    o_0 = i_c * (NSUB * BLOCK_M) + tl.arange(0, BLOCK_M)
    if PREFETCH:  # the first block's moments; later blocks' are loaded one block ahead
        m_v, n_tok, b_mean, b_std = _stats_pages(bt_ptr, kmean_ptr, kstd_ptr, seq, n, o_0, kvh,
                                                 stride_mp, stride_mh, M, True, P, D, BLOCK_D, PREFETCH)
    for j in range(NSUB):
        o_m = o_0 + j * BLOCK_M
        if PREFETCH:  # the next block's page ids and moments, in flight while this block is reduced
            m_vx, n_tokx, b_meanx, b_stdx = _stats_pages(bt_ptr, kmean_ptr, kstd_ptr, seq, n, o_m + BLOCK_M,
                                                         kvh, stride_mp, stride_mh, M, j + 1 < NSUB,
                                                         P, D, BLOCK_D, PREFETCH)
        else:
            m_v, n_tok, b_mean, b_std = _stats_pages(bt_ptr, kmean_ptr, kstd_ptr, seq, n, o_m, kvh,
                                                     stride_mp, stride_mh, M, True, P, D, BLOCK_D, PREFETCH)
        b_mu, b_sig = gauss_of(b_q, b_sl, b_mean, b_std, m_v, n_tok, o_m * P - (n - 1), scale,
                               HAS_ALIBI, USE_DOT, DOT_F32, PREC)
        o_out = o_row[:, None] * M + o_m[None, :]
        tl.store(mu_ptr + o_out, b_mu, mask=m_g[:, None] & (o_m < M)[None, :])
        tl.store(sg_ptr + o_out, b_sig, mask=m_g[:, None] & (o_m < M)[None, :])
        w = n_tok.to(tl.float32)
        m_ok = m_v[None, :] & m_g[:, None]
        if j == 0:
            k = tl.sum(w[None, :] * b_mu, axis=1) / tl.maximum(tl.sum(w, axis=0), 1.0)
        dev = b_mu - k[:, None]
        s_w += w
        s_1 += w[None, :] * dev
        s_2 += w[None, :] * (dev * dev + b_sig * b_sig)
        a_lo = tl.maximum(a_lo, tl.where(m_ok, b_mu, float("-inf")))
        a_hi = tl.maximum(a_hi, tl.where(m_ok, b_mu + 12.0 * b_sig, float("-inf")))
        if PREFETCH:
            m_v, n_tok, b_mean, b_std = m_vx, n_tokx, b_meanx, b_stdx
    c_w = tl.sum(s_w, axis=0)
    c_1 = tl.sum(s_1, axis=1)
    mean_d = c_1 / tl.maximum(c_w, 1.0)
    c_q = tl.maximum(tl.sum(s_2, axis=1) - c_1 * mean_d, 0.0)
    m_lo = tl.max(a_lo, axis=1)
    m_hi = tl.max(a_hi, axis=1)
    o_st = (o_row * NCH + i_c) * 5
    tl.store(st_ptr + o_st + 0, c_w + tl.zeros([BLOCK_G], tl.float32), mask=m_g)
    tl.store(st_ptr + o_st + 1, k + mean_d, mask=m_g)
    tl.store(st_ptr + o_st + 2, c_q, mask=m_g)
    tl.store(st_ptr + o_st + 3, am1 * m_lo, mask=m_g)
    tl.store(st_ptr + o_st + 4, am1 * m_hi, mask=m_g)


@triton.jit
def _gauss_start_kernel(st_ptr, state_ptr, NC, am1, beta,
                  BLOCK_C: tl.constexpr, POOLED: tl.constexpr, ITERS: tl.constexpr,
                  START_ITERS: tl.constexpr, BETA_KIND: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr):
    """Head r's NC chunk partials (count, mean, M2, bracket maxima) merged in
    float64 (two passes: mean, then M2 about it) into the pooled moments and
    the bracket, and the solve's state 0: (lo, hi, tau_0, aux). Pooled:
    tau_0 is the pooled tau_hat (float64). Otherwise aux is the pooled
    solution in float32 clamped into the bracket. With TWO (ALiBi), tau_0 =
    lo, the left end (F(lo) >= 0): iteration launch 0 evaluates F at both,
    and the solve goes on from the one nearer the root (on i.i.d. keys the
    pooled start needs 2 Halley steps where the left end needs 4; under
    ALiBi the pooled model can be far off, and the left end keeps the solve
    robust). Without ALiBi tau_0 = aux and launch 0 evaluates that one point:
    a float64 replay of the solve on i.i.d., drifting, clustered and
    sink-dominated pages (benchmarks/gaussian_start.py, its output in
    experiments/logs/experiments.log) needed exactly as many
    steps from the pooled start as from the better of the two, while under
    ALiBi slopes it needed up to 2 more."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = st_ptr + r * NC * 5
    sw = tl.zeros([], tl.float64)
    s1 = tl.zeros([], tl.float64)
    mlo = tl.full([], float("-inf"), tl.float32)
    mhi = tl.full([], float("-inf"), tl.float32)
    for c0 in range(0, NC, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < NC
        c_w = tl.load(p + o_c * 5 + 0, mask=m_c, other=0.0).to(tl.float64)
        sw += tl.sum(c_w, axis=0)
        s1 += tl.sum(c_w * tl.load(p + o_c * 5 + 1, mask=m_c, other=0.0).to(tl.float64), axis=0)
        mlo = tl.maximum(mlo, tl.max(tl.load(p + o_c * 5 + 3, mask=m_c, other=float("-inf")), axis=0))
        mhi = tl.maximum(mhi, tl.max(tl.load(p + o_c * 5 + 4, mask=m_c, other=float("-inf")), axis=0))
    mn = s1 / tl.maximum(sw, 1.0)
    sq = tl.zeros([], tl.float64)
    for c0 in range(0, NC, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < NC
        c_w = tl.load(p + o_c * 5 + 0, mask=m_c, other=0.0).to(tl.float64)
        d = tl.load(p + o_c * 5 + 1, mask=m_c, other=0.0).to(tl.float64) - mn
        sq += tl.sum(tl.load(p + o_c * 5 + 2, mask=m_c, other=0.0).to(tl.float64) + c_w * d * d, axis=0)
    lo = mlo.to(tl.float64) - 1.0  # F(lo) >= 0 (Jensen, beta >= 1)
    hi = tl.maximum(mhi.to(tl.float64), lo + 1.0)  # F(hi) < 0 (12-sigma tails)
    if POOLED:
        tau = _pooled_tau(sw, mn, sq, am1, beta, ITERS, BETA_KIND, True)
        aux = tau
    else:
        aux = _pooled_tau(sw, mn, sq, am1, beta, START_ITERS, BETA_KIND, False).to(tl.float64)
        aux = tl.where(aux == aux, tl.minimum(tl.maximum(aux, lo), hi), lo)
        tau = lo if TWO else aux
    p_s = state_ptr + r * 4
    tl.store(p_s + 0, lo)
    tl.store(p_s + 1, hi)
    tl.store(p_s + 2, tau)
    tl.store(p_s + 3, aux)
