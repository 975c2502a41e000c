"""Gaussian-aware page selection: page statistics, the tau_hat solve, the threshold test.

Reference: ``entmaxkv.policies.select`` with ``Gaussian`` (and
``entmaxkv.gaussian.solve_tau_hat``). Shapes: B batch, HQ query heads,
H KV heads, S selection heads, NG = HQ // S, M logical pages, P page size,
NCH page chunks of CH pages.

Model (docs/spec.md §5): a token score of page p is S_p ~ N(mu_p, sigma_p^2);
tau_hat solves F(tau) = sum_p n_p E[((alpha-1) S_p - tau)_+^beta] - 1 = 0, with
closed forms for beta = 1, 2, 3 (alpha = 2, 1.5, 4/3). Page p is kept when
(alpha-1) (mu_p + z_{n_p} sigma_p) > tau_hat - margin for any head of its
selection row, z_n = Phi^{-1}(q_max^(1/n)).

Launches (no host synchronisation, fixed count):
1. ``_stats_kernel`` (B*H x NCS chunks of CHS <= CH pages): mu, sigma of
   every page and head (one read of k_mean / k_std, optionally prefetched
   one block ahead: GaussianConfig.stats_tune) plus per-chunk partials: token-weighted sums for the
   pooled Gaussian (shifted sums, accumulated per lane, one reduction per
   program) and the maxima that bracket tau_hat.
2. ``_start_kernel`` (B*HQ): the chunk partials merged in float64 into the
   bracket and the pooled moments; state 0 = the start (the bracket's left
   end under ALiBi, else the pooled-Gaussian solution; the policy's tau_hat
   when pooled) and the pooled solution.
3. ``_iter_kernel`` x nit (B*HQ x NCH): safeguarded Halley on log(F + 1),
   one launch per iteration. Launch 0 evaluates F, F', F'' at the start
   (under ALiBi at both points of state 0); later launches rebuild the same
   float64 iterate in every program of a head from the previous launch's
   partial sums (deterministic: same data, same order), then write their
   chunk's sums at the new iterate. Once a step moves tau by <= conv_tol
   (relative) the solve is final and the launches skip their pages.
   Skipped when pooled.
4. ``_select_kernel`` (B*S x blocks of at most sel_ch pages): final
   iterate, threshold test, forced pages, compaction with one atomic per
   block (pages unsorted).

Precision of the per-page terms (launch 3, the hot loop: up to nit x B*HQ*M pages).
They are float32, summed per lane in float32 over at most CH / BLOCK pages,
then across lanes and chunks in float64; the iterate and its bracket are
float64. tau_hat sits deep in the lower tail at long context (x = -mu_Y / s_Y
of 4-7 for most pages), where the textbook closed forms in Phi(t), phi(t)
cancel (relative error ~x^(k+1) eps) and (1 + erf) / 2 has no relative
accuracy: a plain float32 port is 6e-7 .. 1e-5 (relative) off in tau_hat,
which is why these were float64 (compute-bound: transcendentals in float64).
``_gauss_terms`` instead writes every moment as products and sums of positive
terms (``_mills``: a rational fit of the ratio E[(Z-x)+^3] / E[(Z-x)+^2] and
a backward recurrence, one exp and two divisions per page), relative error
about 5e-7 + 1e-7 x^2 against float64 (tests/test_gaussian_kernel.py); tau_hat is
then within one float32 ulp of the float64 solve on the same page statistics.
The pooled solve (scalar) uses the same formulas in float64.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...types import Selection
from ..config import GaussianConfig, resolve
from .._common import (ATOMIC_SEM, INLINE_PTX, as_slopes, cdiv, interpreting, launch_opts, next_pow2, num_sms,
                      pdl_start)
from ..scoring import gauss_of, kv_row, load_moments, meta_strides, page_rows, prep_query, score_plan

# Every launch choice is a field of GaussianConfig (kernels/config.py); the
# plan and the launcher take it from the caller's KernelConfig.

# ---------------------------------------------------------------------------
# heuristics
# ---------------------------------------------------------------------------


def gauss_plan(c: GaussianConfig, M: int, NG: int, D: int, q_dtype, cache_dtype, rows: int = 1, sms: int = 1,
               interpreted: Optional[bool] = None) -> dict:
    """Launch plan for ``rows`` = B*H KV rows of NG query heads, M pages.

    CH pages per program of the iteration and selection launches: up to
    c.max_ch_many (rows * NG >= sms) or c.max_ch_few, halved (not below 1024)
    while the rows * NG query-head rows would give fewer than c.iter_per_sm
    programs per SM. CHS <= CH pages per program of the stats launch, halved
    (not below c.min_ch) until its programs hold the tuned warps per SM: 4 x
    32k GQA rows are 32 rows of 2048 pages, one chunk each kept 100 of 132
    SMs idle (68 us; 20 us at 256 programs). The stats launch's block
    (SBLOCK_M pages, SNSUB blocks per chunk), warps, stages and prefetch come
    from c.stats_tune / c.dot_stats_tune. ``interpreted``: plan for Triton's
    CPU interpreter (smaller blocks); None: whether it is running."""
    if interpreted is None:
        interpreted = interpreting()
    cfg = score_plan(NG, D, q_dtype, cache_dtype)
    block_m = cfg["BLOCK_M"]
    if cfg["USE_DOT"]:
        prefetch, (sbm, warps, stages, per_sm) = False, c.dot_stats_tune
    else:
        prefetch, sbm, warps, stages, per_sm = c.stats_tune
    sbm = sbm or block_m
    if stages is not None:  # pipelined k_mean / k_std blocks within 128 KB of shared memory
        per_stage = 2 * sbm * cfg["BLOCK_D"] * cache_dtype.itemsize
        stages = max(2, min(stages, (128 << 10) // per_stage))
    if interpreted:
        sbm = min(sbm, 64)
    many = rows * NG >= sms
    ch = max(block_m, sbm, min(256 if interpreted else (c.max_ch_many if many else c.max_ch_few), next_pow2(M)))
    while ch > max(block_m, sbm, 1024) and rows * NG * cdiv(M, ch) < c.iter_per_sm * sms:
        ch //= 2
    chs = ch
    while chs > max(sbm, c.min_ch) and rows * cdiv(M, chs) * warps < per_sm * sms:
        chs //= 2
    cfg.update(CH=ch, NCH=cdiv(M, ch), CHS=chs, NCS=cdiv(M, chs), SBLOCK_M=sbm, SNSUB=chs // sbm,
               SWARPS=warps, SSTAGES=stages, SPREFETCH=prefetch)
    return cfg


_ZTAB = {}


def z_table(q_max: float, P: int, device) -> torch.Tensor:
    """float32 [P + 1]: z_n = Phi^{-1}(q_max^(1/n)) for n = 1..P (index 0 unused).

    Cached per (q_max, P, device) so that a captured CUDA graph never copies
    from the host.
    """
    key = (float(q_max), int(P), str(device))
    if key not in _ZTAB:
        n = torch.arange(1, P + 1, dtype=torch.float32)
        p = torch.as_tensor(q_max, dtype=torch.float32) ** (1.0 / n)
        try:
            from ..gaussian import normal_icdf

            z = normal_icdf(p)
        except (ImportError, TypeError):
            z = torch.special.ndtri(p)
        _ZTAB[key] = torch.cat([torch.zeros(1), z.to(torch.float32)]).to(device)
    return _ZTAB[key]


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


# _mills fits rho_3(x) = E[(Z - x)_+^3] / E[(Z - x)_+^2] ~= p(x) / q(x) on
# [0, _XMAX]: minimax rational fit of degree (4, 5) against 80-digit values,
# relative error 1.1e-8 (float32 coefficient rounding and Horner add a few 1e-7).
# Every coefficient is positive, so Horner cannot cancel; p / q -> 3 / x like rho_3.
_XMAX = tl.constexpr(14.5)  # phi(14.5) = 1.3e-46: beyond it the float32 terms are exactly 0
# float32 a / b in the per-page terms as div.approx.ftz.f32: MUFU.RCP and one
# multiply, <= 2 ulp for |b| in [2^-126, 2^126] (both divisors here stay
# inside that range; a subnormal quotient flushes to 0, far below the terms'
# 5e-7 error). Triton's own float32 division is div.full.f32 (Triton 3.6) or
# div.approx.f32 (tl.math.fdiv approx), ~8 SASS instructions each with their
# range and subnormal fix-ups: the 2 divisions took 16 of the 71
# instructions per page of the iteration loop (sm_90, beta = 2; 570 -> 463
# per 8 pages with these and _rcp; experiments/logs/fast_div.log). Inline PTX needs
# a CUDA GPU: the CPU interpreter (and ROCm) divide plainly.
_FAST_DIV = INLINE_PTX


@triton.jit
def _div(a, b, F64: tl.constexpr):
    if F64 or not _FAST_DIV:
        return a / b
    else:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rcp(b, F64: tl.constexpr):
    """1 / b, as rcp.approx.ftz.f32 on the GPU (``_div(1.0, b)`` leaves a
    multiply by one behind)."""
    if F64 or not _FAST_DIV:
        return 1.0 / b
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mills(x, F64: tl.constexpr):
    """g_k(x) = E[(Z - x)_+^k] / phi(x) for k = 0..3 and 0 <= x <= _XMAX (x's dtype).

    From the fitted ratio rho_3 = g_3 / g_2 the backward recurrence
    g_(k-2) = (g_k + x g_(k-1)) / (k - 1) (integration by parts) gives the rest
    as sums of positive terms over one common denominator: no cancellation, one
    division, and an error in rho_3 is damped on the way down (never amplified).
    """
    p = (((0.0021099732546354362 * x + 0.028989846763116903) * x + 0.19598963083019613) * x
         + 0.7469297506737255) * x + 1.5957691382854409
    q = ((((0.0007032396406077254 * x + 0.009668694155750748) * x + 0.06799103124200852) * x
          + 0.2901329361698832) * x + 0.7522713601796289) * x + 1.0
    # (g_0, g_1, g_2, g_3) = (b2, b3, 2 q, 2 p) / b1, every b a sum of positive terms
    b3 = x * q + p
    b2 = x * b3 + 2.0 * q
    b1 = x * b2 + b3
    inv = _rcp(b1, F64)  # b1 in [1.59, 3.7e6]
    return b2 * inv, b3 * inv, 2.0 * q * inv, 2.0 * p * inv


@triton.jit
def _gauss_terms(mu_y, sig_y, BETA_KIND: tl.constexpr, F64: tl.constexpr):
    """Truncated moments of Y ~ N(mu_y, sig_y^2), in float32 (float64 with F64).

    Returns e_b = E[Y+^beta], e_b1 = E[Y+^(beta-1)] and e_b2 = d^2/dtau^2 E[Y+^beta]
    (BETA_KIND 1/2/3: beta = 1/2/3), so F = sum w e_b, F' = -beta sum w e_b1,
    F'' = sum w e_b2. sig_y <= 1e-30 is the point mass.

    Numerically stable in the tail, where tau_hat sits at long context (there
    the textbook closed forms in Phi(t), phi(t) cancel, error ~x^(k+1) eps, and
    Phi = (1 + erf) / 2 has no relative accuracy left). With t = mu / s and
    x = |t|, the tail moments h_k = s^k phi(x) g_k(x) (``_mills``) are
    products of positive factors: E[Y+^k] for mu <= 0, E[Y-^k] for mu > 0.
    For mu > 0, E[Y+^k] = E[Y^k] - (-1)^k E[Y-^k]: 1 - h_0, mu + h_1,
    mu^2 + s^2 - h_2 (h_2 <= s^2 / 2 there), mu^3 + 3 mu s^2 + h_3, again free of
    cancellation.

    float32: relative error about 5e-7 + 1e-7 x^2 against float64 (measured
    8.1e-7 for x <= 3, 2.8e-6 for x <= 6, 9.4e-6 at x = 12; the x^2 part is the
    conditioning of phi in x = |mu| / s, the size of rounding mu to float32);
    exactly 0, never NaN, past x = 14.5. float64: 1.1e-8 (the fit); past
    x = 14.5 the terms (< 1.3e-46 s^k) are only approximate.
    """
    if F64:
        m = mu_y.to(tl.float64)
        s = sig_y.to(tl.float64)
    else:
        m = mu_y.to(tl.float32)
        s = sig_y.to(tl.float32)
    # the point mass as x = inf: phi = 0, h_k = 0 and the mu > 0 forms reduce
    # to 1{mu > 0}, mu, mu^2, mu^3 (s^2 <= 1e-60 vanishes next to mu^2)
    point = s <= 1e-30
    s1 = tl.where(point, 1.0, s)
    x = tl.where(point, float("inf"), _div(tl.abs(m), s1, F64))  # s1 in [1e-30, ...]
    phi = 0.3989422804014327 * tl.exp2(x * (x * -0.7213475204444817))  # -log2(e) / 2
    g0, g1, g2, g3 = _mills(tl.minimum(x, _XMAX), F64)
    pos = m > 0
    sp = s * phi
    e1 = tl.where(pos, m, 0.0) + sp * g1
    if BETA_KIND == 1:
        h0 = phi * g0
        e_b = e1
        e_b1 = tl.where(pos, 1.0 - h0, h0)
        e_b2 = _div(phi, s1, F64)  # the density of Y at 0
    else:
        h2 = s * sp * g2
        e2 = tl.where(pos, m * m + s * s - h2, h2)
        if BETA_KIND == 2:
            h0 = phi * g0
            e_b = e2
            e_b1 = e1
            e_b2 = 2.0 * tl.where(pos, 1.0 - h0, h0)
        else:
            e_b = tl.where(pos, m * (m * m + 3.0 * s * s), 0.0) + s * s * sp * g3
            e_b1 = e2
            e_b2 = 6.0 * e1
    return e_b, e_b1, e_b2


@triton.jit
def _halley_update(sm, d1, d2, tau, lo, hi):
    """One safeguarded Halley step on g(tau) = log(F(tau) + 1), F + 1 = sm > 0.

    g is close to linear-quadratic over the whole bracket (each term decays
    like a Gaussian tail), so from the left end this converges in 3-4 steps
    where Halley on F itself needs ~10. The bracket keeps the sign of F; a
    step that leaves it (or is not finite) is replaced by bisection.
    Returns (next iterate, lo, hi, whether it is the Halley step).
    """
    above = sm > 1.0
    lo = tl.where(above, tau, lo)
    hi = tl.where(above, hi, tau)
    pos = sm > 0
    sms = tl.where(pos, sm, 1.0)
    g = tl.log(sms)
    # three divisions, not five: this runs (redundantly, in float64) in
    # every program of an iteration launch
    r = 1.0 / sms
    g1 = d1 * r
    g2 = d2 * r - g1 * g1
    inv = 1.0 / tl.where(g1 != 0, g1, -1.0)
    step = g * inv
    L = step * g2 * inv
    L = tl.where(L == L, L, 0.0)
    L = tl.minimum(tl.maximum(L, -1.0), 1.0)
    cand = tau - step / (1.0 - 0.5 * L)
    ok = (cand >= lo) & (cand <= hi) & (g1 != 0) & pos
    return tl.where(ok, cand, 0.5 * (lo + hi)), lo, hi, ok


@triton.jit
def _pooled_tau(sw, mn, sq, am1, beta, ITERS: tl.constexpr, BETA_KIND: tl.constexpr, F64: tl.constexpr):
    """tau solving n_g E[((alpha-1) S - tau)_+^beta] = 1 for the pooled Gaussian
    S ~ N(mu_g, sigma_g^2): token-weighted moments of the page mixture
    (n_g = sw tokens, mu_g = mn, sigma_g^2 = sq / sw); float64 with F64,
    else float32 (the mixture solve's start)."""
    dt: tl.constexpr = tl.float64 if F64 else tl.float32
    n_g = tl.maximum(sw.to(dt), 1.0)
    mu_g = mn.to(dt)
    sig_g = tl.sqrt(tl.maximum(sq.to(dt) / n_g, 0.0))
    lo = am1 * mu_g - 1.0
    hi = tl.maximum(am1 * (mu_g + 12.0 * sig_g), lo + 1.0)
    tau = lo
    for _ in range(ITERS):
        e_b, e_b1, e_b2 = _gauss_terms(am1 * mu_g - tau, am1 * sig_g, BETA_KIND, F64)
        tau, lo, hi, _h = _halley_update(n_g * e_b, -beta * n_g * e_b1, n_g * e_b2, tau, lo, hi)
    return tau


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


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
def _stats_kernel(
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
        b_mu, b_sig = gauss_of(b_q, b_sl, b_mean, b_std, m_v, n_tok, o_m, n - 1, scale,
                               P, HAS_ALIBI, USE_DOT, DOT_F32, PREC)
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
def _start_kernel(st_ptr, state_ptr, NC, am1, beta,
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


@triton.jit
def _converged(state_ptr, r, it, R):
    """Whether head r's solve had converged by state it-1 (the flag slot of
    states 1.. ; state 0 holds the pooled start there)."""
    aux = tl.load(state_ptr + ((it - 1) * R + r) * 4 + 3)
    return (aux != 0) & ((it + tl.zeros([], tl.int32)) > 1)


@triton.jit
def _iterate(part_ptr, state_ptr, r, it, R, beta, NCH: tl.constexpr, NCH_P2: tl.constexpr, CONV: tl.constexpr,
             TWO: tl.constexpr):
    """(tau_it, lo, hi, converged) of head r for it >= 1 and a state it-1
    that has not converged: one safeguarded Halley step from state it-1 and
    the F, F', F'' that launch it-1 summed there. With TWO launch 0
    evaluated two points (state 0's tau = lo and its aux, the pooled start):
    the second tightens the bracket and the step starts from whichever has
    the smaller |log(F + 1)|. A Halley step that moves tau by <= CONV relative ends the
    solve (cubic convergence: the next step would be below the float32
    noise of the sums); later launches forward the state without reading
    their pages."""
    p_s = state_ptr + ((it - 1) * R + r) * 4
    lo = tl.load(p_s + 0)
    hi = tl.load(p_s + 1)
    tau = tl.load(p_s + 2)
    aux = tl.load(p_s + 3)
    o_c = tl.arange(0, NCH_P2)
    m_c = o_c < NCH
    p = part_ptr + (((it - 1) * R + r) * NCH + o_c) * 6
    f = tl.sum(tl.load(p + 0, mask=m_c, other=0.0), axis=0)
    d1 = -beta * tl.sum(tl.load(p + 1, mask=m_c, other=0.0), axis=0)
    d2 = tl.sum(tl.load(p + 2, mask=m_c, other=0.0), axis=0)
    if TWO:
        m_2 = m_c & (o_c * 0 + it == 1)
        two = tl.max(m_2.to(tl.int32), axis=0) > 0  # it == 1, as a tensor on the interpreter too
        f_b = tl.sum(tl.load(p + 3, mask=m_2, other=0.0), axis=0)
        d1_b = -beta * tl.sum(tl.load(p + 4, mask=m_2, other=0.0), axis=0)
        d2_b = tl.sum(tl.load(p + 5, mask=m_2, other=0.0), axis=0)
        # the second point: its sign tightens the bracket, and it is the base
        # when nearer the root in log(F + 1): F(lo) >= 0, so f >= 1, and
        # |log f_b| < log f is f_b < f above 1 and f f_b > 1 below (no logs)
        above_b = f_b > 1.0
        lo = tl.where(two & above_b, aux, lo)
        hi = tl.where(two & ~above_b, aux, hi)
        use_b = two & (f_b > 0) & tl.where(f_b >= 1.0, f_b < f, f * f_b > 1.0)
        f = tl.where(use_b, f_b, f)
        d1 = tl.where(use_b, d1_b, d1)
        d2 = tl.where(use_b, d2_b, d2)
        tau = tl.where(use_b, aux, tau)
    nxt, lo, hi, halley = _halley_update(f, d1, d2, tau, lo, hi)
    return nxt, lo, hi, halley & (tl.abs(nxt - tau) <= CONV * tl.abs(nxt))


@triton.jit
def _pages4(n, P: tl.constexpr):
    """Pages holding the row's n tokens, rounded up to 4: a mask at this bound
    allows 16-byte vector loads of mu, sigma (the stats kernel wrote 0 on every
    page past the length). Masked page by page instead, each thread's four
    scalar loads strided the warp over 4x the sectors (the selection launch at
    8x1M: 71% excess sectors, 48.6 us; 0% and 44.3 us with this bound;
    experiments/logs/ncu_gaussian.log)."""
    return tl.multiple_of((n + 4 * P - 1) // (4 * P) * 4, 4)


@triton.jit
def _load_mu_sg(mu_ptr, sg_ptr, i_r, o_m, M, lim):
    """mu, sigma of pages o_m < min(M, lim) of query-head row i_r (0 elsewhere)."""
    m_v = (o_m < M) & (o_m < lim)
    b_mu = tl.load(mu_ptr + i_r * M + o_m, mask=m_v, other=0.0)
    b_sg = tl.load(sg_ptr + i_r * M + o_m, mask=m_v, other=0.0)
    return b_mu, b_sg


@triton.jit
def _eval_chunk(mu_ptr, sg_ptr, part_ptr, b_mu, b_sg, n, npg4, i_r, i_c, it, R, M, am1, tau, tau_b,
                NCH: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr,
                BETA_KIND: tl.constexpr, TWO: tl.constexpr):
    """Chunk i_c's sums of w E[Y+^beta], w E[Y+^(beta-1)], d^2/dtau^2 at tau
    (and at tau_b with TWO) into launch it's partials. b_mu, b_sg: the
    chunk's first block (``_load_mu_sg`` up to npg4), loaded by the caller;
    each later block is loaded while the previous one's terms are computed
    (ALU work: one exp and two divisions per page; 8x1M launch 1 45.6 ->
    43.9 us, experiments/logs/gaussian_launches.log)."""
    # Y_p = am1 S_p - tau in float32: am1 (mu_p - c), c = tau / am1 split as
    # c_hi + c_lo, so mu_y carries a relative (not |tau|-sized) rounding error.
    c = tau / am1
    c_hi = c.to(tl.float32)
    c_lo = (c - c_hi.to(tl.float64)).to(tl.float32)
    cb = tau_b / am1
    cb_hi = cb.to(tl.float32)
    cb_lo = (cb - cb_hi.to(tl.float64)).to(tl.float32)
    # float32 terms, summed per lane over the chunk (CH / BLOCK <= 4 terms on
    # the GPU), then across lanes and chunks in float64
    a0 = tl.zeros([BLOCK], tl.float32)
    a1 = tl.zeros([BLOCK], tl.float32)
    a2 = tl.zeros([BLOCK], tl.float32)
    b0 = tl.zeros([BLOCK], tl.float32)
    b1 = tl.zeros([BLOCK], tl.float32)
    b2 = tl.zeros([BLOCK], tl.float32)
    for j0 in range(0, CH, BLOCK):
        o_m = i_c * CH + j0 + tl.arange(0, BLOCK)
        nx_mu, nx_sg = _load_mu_sg(mu_ptr, sg_ptr, i_r, o_m + BLOCK, M, tl.where(j0 + BLOCK < CH, npg4, 0))
        w = tl.minimum(tl.maximum(n - o_m * P, 0), P).to(tl.float32)
        e_b, e_b1, e_b2 = _gauss_terms(((b_mu - c_hi) - c_lo) * am1, b_sg * am1, BETA_KIND, False)
        # w = 0 on invalid pages, whose terms are finite (mu = sigma = 0)
        a0 += w * e_b
        a1 += w * e_b1
        a2 += w * e_b2
        if TWO:
            e_b, e_b1, e_b2 = _gauss_terms(((b_mu - cb_hi) - cb_lo) * am1, b_sg * am1, BETA_KIND, False)
            b0 += w * e_b
            b1 += w * e_b1
            b2 += w * e_b2
        b_mu, b_sg = nx_mu, nx_sg
    p = part_ptr + ((it * R + i_r) * NCH + i_c) * 6
    tl.store(p + 0, tl.sum(a0.to(tl.float64), axis=0))
    tl.store(p + 1, tl.sum(a1.to(tl.float64), axis=0))
    tl.store(p + 2, tl.sum(a2.to(tl.float64), axis=0))
    if TWO:
        tl.store(p + 3, tl.sum(b0.to(tl.float64), axis=0))
        tl.store(p + 4, tl.sum(b1.to(tl.float64), axis=0))
        tl.store(p + 5, tl.sum(b2.to(tl.float64), axis=0))


@triton.jit
def _iter_kernel(
    ids_ptr, lens_ptr, mu_ptr, sg_ptr, part_ptr, state_ptr,
    it, R, M, am1, beta,
    NCH: tl.constexpr, NCH_P2: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr,
    HQ: tl.constexpr, P: tl.constexpr, BETA_KIND: tl.constexpr, FIRST: tl.constexpr, CONV: tl.constexpr,
    TWO: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    seq = tl.load(ids_ptr + i_r // HQ).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npg4 = _pages4(n, P)
    o_0 = i_c * CH + tl.arange(0, BLOCK)
    if FIRST:  # state 0 (_start_kernel): F at tau_0 (and, with TWO, at the pooled start)
        p_s = state_ptr + i_r * 4
        b_mu, b_sg = _load_mu_sg(mu_ptr, sg_ptr, i_r, o_0, M, npg4)
        _eval_chunk(mu_ptr, sg_ptr, part_ptr, b_mu, b_sg, n, npg4, i_r, i_c, it, R, M, am1,
                    tl.load(p_s + 2), tl.load(p_s + 3), NCH, CH, BLOCK, P, BETA_KIND, TWO)
    else:
        p_s = state_ptr + (it * R + i_r) * 4
        if _converged(state_ptr, i_r, it, R):  # forward the state, read nothing else
            if i_c == 0:
                p_p = state_ptr + ((it - 1) * R + i_r) * 4
                tl.store(p_s + 0, tl.load(p_p + 0))
                tl.store(p_s + 1, tl.load(p_p + 1))
                tl.store(p_s + 2, tl.load(p_p + 2))
                tl.store(p_s + 3, tl.load(p_p + 3))
        else:
            tau, lo, hi, conv = _iterate(part_ptr, state_ptr, i_r, it, R, beta, NCH, NCH_P2, CONV, TWO)
            if i_c == 0:
                tl.store(p_s + 0, lo)
                tl.store(p_s + 1, hi)
                tl.store(p_s + 2, tau)
                tl.store(p_s + 3, conv.to(tl.float64))
            if not conv:  # a final tau needs no F (nothing reads this launch's partials)
                b_mu, b_sg = _load_mu_sg(mu_ptr, sg_ptr, i_r, o_0, M, npg4)
                _eval_chunk(mu_ptr, sg_ptr, part_ptr, b_mu, b_sg, n, npg4, i_r, i_c, it, R, M, am1, tau, tau,
                            NCH, CH, BLOCK, P, BETA_KIND, False)


@triton.jit
def _select_kernel(
    ids_ptr, lens_ptr, mu_ptr, sg_ptr, part_ptr, state_ptr, z_ptr,
    pages_ptr, counts_ptr, tauhat_ptr,
    R, M, am1, beta, margin, sinks, window,
    NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK: tl.constexpr,
    HQ: tl.constexpr, S: tl.constexpr, NG: tl.constexpr, BLOCK_G: tl.constexpr, P: tl.constexpr,
    NIT: tl.constexpr, CONV: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr,
):
    """Threshold test of BLOCK pages of selection row i_r (union over its NG
    heads), compacted into the row's page list with one atomic."""
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = i_r // S
    h0 = (i_r % S) * NG
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages = (n + P - 1) // P
    o_m = i_c * BLOCK + tl.arange(0, BLOCK)
    n_tok = tl.minimum(tl.maximum(n - o_m * P, 0), P)
    m_v = (o_m < M) & (n_tok > 0)
    npg4 = _pages4(n, P)  # (vector loads, see _pages4)
    if NG == 1:  # 1-D (a [1, BLOCK] tile measured 52.7 us against 48.6 before the mask change)
        b_mu, b_sg = _load_mu_sg(mu_ptr, sg_ptr, (i_b * HQ + h0).to(tl.int64), o_m, M, npg4)
    else:
        m_2 = m_g[:, None] & m_v[None, :]
        m_ld2 = m_g[:, None] & ((o_m < M) & (o_m < npg4))[None, :]
        o_rows = (i_b * HQ + h0 + o_g).to(tl.int64) * M
        b_mu = tl.load(mu_ptr + o_rows[:, None] + o_m[None, :], mask=m_ld2, other=0.0)
        b_sg = tl.load(sg_ptr + o_rows[:, None] + o_m[None, :], mask=m_ld2, other=0.0)
    b_z = tl.load(z_ptr + n_tok, mask=m_v, other=0.0)
    # -- tau_hat of each head of the row (same value in every program)
    b_tau = tl.zeros([BLOCK_G], tl.float32)
    for g in range(NG):  # (float64 iterate, float32 tau_hat as the reference returns)
        r = (i_b * HQ + h0 + g).to(tl.int64)
        if NIT == 0:  # pooled: _start_kernel solved it
            t = tl.load(state_ptr + r * 4 + 2)
        elif _converged(state_ptr, r, NIT, R):
            t = tl.load(state_ptr + ((NIT - 1) * R + r) * 4 + 2)
        else:
            t, _lo, _hi, _conv = _iterate(part_ptr, state_ptr, r, NIT, R, beta, NCH, NCH_P2, CONV, TWO)
        t = t.to(tl.float32)
        b_tau = tl.where(o_g == g, t, b_tau)
        if i_c == 0:
            tl.store(tauhat_ptr + r, t)
    # -- threshold test on the block's pages, union over the heads
    if NG == 1:
        keep = am1 * (b_mu + b_z * b_sg) > tl.max(b_tau, axis=0) - margin
    else:
        hit = m_2 & (am1 * (b_mu + b_z[None, :] * b_sg) > b_tau[:, None] - margin)
        keep = tl.max(hit.to(tl.int32), axis=0) > 0
    keep = (keep | (o_m < sinks) | (o_m >= npages - tl.maximum(window, 1))) & m_v
    f_keep = keep.to(tl.int32)
    # relaxed: the atomic only reserves this block's slots in the row's list, which
    # later launches read (the default acq_rel put a MEMBAR.GPU before it)
    base = tl.atomic_add(counts_ptr + i_r, tl.sum(f_keep, axis=0), sem=ATOMIC_SEM)
    i_out = base + tl.cumsum(f_keep, axis=0) - 1
    tl.store(pages_ptr + i_r.to(tl.int64) * M + i_out, o_m, mask=keep)


# ---------------------------------------------------------------------------
# launcher / public function
# ---------------------------------------------------------------------------


def _beta_kind3(alpha: float) -> int:
    for bk, a in ((1, 2.0), (2, 1.5), (3, 4.0 / 3.0)):
        if abs(alpha - a) < 1e-12:
            return bk
    return 0


def select_gaussian(policy, q, cache, seq_ids, *, alpha: float, scale: float, slopes=None,
                    config=None) -> Selection:
    """Gaussian-aware selection (Triton).

    Args:
        policy: entmaxkv.policies.Gaussian (q_max, margin, pooled, sinks,
            window, per_query_head).
        q: [batch, q_heads, head_dim]; cache; seq_ids int [batch]; alpha > 1;
            scale; slopes optional [q_heads].
    Returns:
        Selection(pages int32 [batch, S, M] unsorted, counts int32 [batch, S],
        tau_hat float32 [batch, q_heads]).
    alpha must be 2, 1.5 or 4/3 (closed-form truncated moments); other alpha
    use the reference implementation (correct, not fused).
    """
    if alpha <= 1.0:
        raise ValueError("policy: gaussian needs entmax (alpha > 1)")
    bk = _beta_kind3(alpha)
    if bk == 0:
        from ... import policies as _ref

        return _ref.select(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes)
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    S = HQ if policy.per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    R = B * HQ
    dev = q.device
    config = resolve(config)
    c = config.gaussian
    cfg = gauss_plan(c, M, G, D, q.dtype, cache.dtype, B * H, num_sms(dev))
    NCH, CH = cfg["NCH"], cfg["CH"]
    nch_p2 = next_pow2(NCH)
    smp, smh = meta_strides(cache, ("k_mean", "k_std"))
    sl = as_slopes(slopes, HQ, dev)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    am1, beta = float(alpha - 1.0), float(1.0 / (alpha - 1.0))
    mu = torch.empty(B, HQ, M, dtype=torch.float32, device=dev)
    sg = torch.empty_like(mu)
    opts = launch_opts(dev, config.pdl)
    NC = cfg["NCS"]
    stages = {} if cfg["SSTAGES"] is None else dict(num_stages=cfg["SSTAGES"])
    pages = torch.empty(B, S, M, dtype=torch.int32, device=dev)  # padding past counts is never read
    counts = torch.empty(B, S, dtype=torch.int32, device=dev)  # zeroed by the stats launch
    tau_hat = torch.empty(B, HQ, dtype=torch.float32, device=dev)
    st = torch.empty(R, NC, 5, dtype=torch.float32, device=dev)
    _stats_kernel[(B * H, NC)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_mean, cache.k_std,
        mu, sg, st, counts,
        float(scale), am1, q.stride(0), q.stride(1), smp, smh,
        HQ, G, M,
        H=H, NCH=NC, NSR=S // H, P=P, D=D, BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"],
        BLOCK_M=cfg["SBLOCK_M"], NSUB=cfg["SNSUB"], HAS_ALIBI=slopes is not None,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"], PREFETCH=cfg["SPREFETCH"],
        num_warps=cfg["SWARPS"], **stages, **opts,
    )
    nit = 0 if policy.pooled else c.nit
    # two start points only under ALiBi (see _start_kernel)
    two = slopes is not None and not policy.pooled
    state = torch.empty(max(nit, 1), R, 4, dtype=torch.float64, device=dev)
    part = torch.empty(max(nit, 1), R, NCH, 6, dtype=torch.float64, device=dev)
    _start_kernel[(R,)](
        st, state, NC, am1, beta,
        BLOCK_C=min(1024, next_pow2(NC)), POOLED=policy.pooled, ITERS=c.scalar_iters, START_ITERS=c.start_iters,
        BETA_KIND=bk, TWO=two, num_warps=4, **opts,
    )
    block = min(c.iter_block, CH)
    for it in range(nit):
        _iter_kernel[(R, NCH)](
            ids, cache.seq_lens, mu, sg, part, state,
            it, R, M, am1, beta,
            NCH=NCH, NCH_P2=nch_p2, CH=CH, BLOCK=block, HQ=HQ, P=P,
            BETA_KIND=bk, FIRST=it == 0, CONV=float(c.conv_tol), TWO=two, num_warps=c.iter_warps, **opts,
        )
    # one block of pages per program (no partials to merge, unlike the iteration launches)
    sel = max(16, min(CH, c.sel_ch, 4096 // next_pow2(NG)))
    _select_kernel[(B * S, cdiv(M, sel))](
        ids, cache.seq_lens, mu, sg, part, state, z_table(policy.q_max, P, dev),
        pages, counts, tau_hat,
        R, M, am1, beta, float(policy.margin), int(policy.sinks), int(policy.window),
        NCH=NCH, NCH_P2=nch_p2, BLOCK=sel,
        HQ=HQ, S=S, NG=NG, BLOCK_G=next_pow2(NG), P=P, NIT=nit, CONV=float(c.conv_tol), TWO=two,
        num_warps=c.select_warps,
        **opts,
    )
    return Selection(pages, counts, tau_hat)
