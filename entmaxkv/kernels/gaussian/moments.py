"""Jit math of the Gaussian selection: truncated Gaussian moments in float32
without cancellation in the tail (``_gauss_terms``), the safeguarded Halley
step on log(F + 1), and the scalar pooled solve."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import INLINE_PTX


# _mills fits rho_3(x) = E[(Z - x)_+^3] / E[(Z - x)_+^2] ~= p(x) / q(x) on
# [0, _XMAX]: minimax rational fit of degree (4, 5) against 80-digit values,
# relative error 1.1e-8 (float32 coefficient rounding and Horner add a few 1e-7).
# Every coefficient is positive, so Horner cannot cancel; p / q -> 3 / x like rho_3.
_XMAX = tl.constexpr(14.5)  # phi(14.5) = 1.3e-46: beyond it the float32 terms are exactly 0


# float32 a / b in the per-page terms as div.approx.ftz.f32: MUFU.RCP and one
# multiply, <= 2 ulp for |b| in [2^-126, 2^126] (both divisors here stay
# inside that range; a subnormal quotient flushes to 0, far below the terms'
# 5e-7 error), instead of Triton's division with its range and subnormal
# fix-ups (docs/tuning.md). Inline PTX needs a CUDA GPU: the CPU interpreter
# (and ROCm) divide plainly. _XMAX and _FAST_DIV are read inside jit
# functions: fixed at compile time.
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
