"""Truncated Gaussian moments and the Gaussian estimate of the entmax threshold.

The Gaussian-aware selector (docs/spec.md §5) models the score of a token of
page p as S_p ~ N(mu_p, sigma_p^2) and estimates the entmax threshold tau_hat
from the distributional constraint

    sum_p w_p E[ g_alpha(S_p; tau_hat) ] = 1,
    g_alpha(s; tau) = [(alpha - 1) s - tau]_+^beta,   beta = 1 / (alpha - 1),

with w_p the number of valid tokens of page p. Writing
Y = (alpha - 1) S - tau ~ N(mu_Y, sigma_Y^2), each expectation is a truncated
power moment E[Y_+^beta]; ``truncated_power_moment`` evaluates it (closed
forms for beta in {0, 1, 2, 3}, quadrature otherwise) and ``solve_tau_hat``
solves the constraint with a safeguarded Halley iteration.

Notation: t = mu / sigma and J_b(t) = E[(t + Z)_+^b] for Z ~ N(0, 1), so that
E[Y_+^b] = sigma^b J_b(t). Integration by parts gives, for every b > 1,

    J_b(t) = t J_(b-1)(t) + (b - 1) J_(b-2)(t),    dJ_b/dt = b J_(b-1)(t),

which yields the spec closed forms from J_0 = Phi(t), J_1 = t Phi(t) + phi(t),
and d/dtau E[Y_+^b] = -b E[Y_+^(b-1)].

Like entmaxkv.entmax, nothing here calls ``.item()`` or branches on tensor
values: the solvers run on CUDA without host synchronisation and can be
captured in a CUDA graph (quadrature nodes are cached per device and dtype,
so make one call before capture).
"""
from __future__ import annotations

import functools
import math
import statistics
from typing import Tuple

import numpy as np
import torch

# one alpha validation and one root-finding safeguard for the whole package
from .entmax import _check_alpha, _h_and_derivs, _safeguarded_step

__all__ = [
    "normal_cdf",
    "normal_pdf",
    "normal_icdf",
    "truncated_power_moment",
    "page_quantile_z",
    "solve_tau_hat",
    "pooled_moments",
]

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)

# Quadrature for non-integer exponents (see _quadrature_moments). With 48
# half-line nodes the rule agrees with the closed forms at integer exponents
# to ~3e-13 relative for t in [-30, 30] (32 nodes: ~1e-9, 24: ~5e-6);
# tests/test_gaussian.py checks 1e-8. The selector itself needs ~1e-3.
QUAD_NODES = 48
HERMITE_NODES = 20  # <= 20 keeps every node above -8 (see _quadrature_moments)
# Above this t = mu / sigma the kink of (t + Z)_+^b at Z = -t carries
# Gaussian weight phi(t) < 5e-15: plain Gauss-Hermite is exact to float64
# there, and the half-line rule would need a long interval.
_HERMITE_FROM_T = 8.0
# Below this t the closed forms switch to a continued fraction (see
# _closed_form); at x = -t >= 3 a depth of 48 converges to ~1e-15.
_TAIL_FROM_T = -3.0
_TAIL_CF_DEPTH = 48
# Cap on elements x nodes materialised at once by the quadrature (memory).
_QUAD_CHUNK_ELEMS = 1 << 24

# Iterations of the tau_hat solver. Started at the left end of its bracket,
# it reached the 300-step answer to 8 ulps within 5 steps for alpha < 2
# (Halley) and within 14 for alpha in [2, 5] (Newton), on random pages,
# 65536 pages, zero-sigma pages, fractional weights; 20 leaves a margin.
TAU_HAT_ITERS = 20


# --------------------------------------------------------------------------
# standard normal
# --------------------------------------------------------------------------


def normal_cdf(t: torch.Tensor) -> torch.Tensor:
    """Phi(t), the standard normal CDF, accurate to relative precision in the lower tail.

    Computed as erfc(-t / sqrt 2) / 2: torch.special.ndtr loses the lower tail
    on CPU (it returns 0 at t = -10 in float64, where Phi = 7.6e-24).
    """
    return 0.5 * torch.special.erfc(-t * _INV_SQRT_2)


def normal_pdf(t: torch.Tensor) -> torch.Tensor:
    """phi(t) = exp(-t^2 / 2) / sqrt(2 pi)."""
    return torch.exp(-0.5 * t * t) * _INV_SQRT_2PI


def normal_icdf(p: torch.Tensor) -> torch.Tensor:
    """Phi^{-1}(p), the standard normal quantile (-inf at 0, +inf at 1)."""
    return torch.special.ndtri(p)


def page_quantile_z(q_max: float, page_size: int) -> float:
    """z = Phi^{-1}(q_max^(1/page_size)): the q_max-quantile of the max of page_size N(0,1) draws.

    P(max of P iid N(0,1) <= z) = Phi(z)^P = q_max. Computed on the host in
    float64 (it is a configuration constant, not a per-step tensor).
    """
    q_max = float(q_max)
    if not 0.0 < q_max < 1.0:
        raise ValueError(f"q_max must lie in (0, 1), got q_max={q_max}")
    if int(page_size) != page_size or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got page_size={page_size}")
    # q^(1/P) = exp(log(q) / P); expm1 keeps 1 - q^(1/P) accurate when it is tiny.
    upper_tail = -math.expm1(math.log(q_max) / page_size)
    return -statistics.NormalDist().inv_cdf(upper_tail)


# --------------------------------------------------------------------------
# truncated power moments E[Y_+^b], Y ~ N(mu, sigma^2)
# --------------------------------------------------------------------------


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _closed_form(mu: torch.Tensor, sigma: torch.Tensor, k: int) -> torch.Tensor:
    """E[Y_+^k] for integer k in {0, 1, 2, 3} (docs/spec.md §5), sigma > 0 assumed.

    For t = mu / sigma >= -3 the spec formulas, written in mu and sigma rather
    than t so that a tiny sigma (t -> +-inf) cannot overflow. Below t = -3
    their terms cancel (relative error ~ eps t^2), so there the moments are
    built as products J_k = Phi(t) rho_1 ... rho_k of the ratios
    rho_j = J_j / J_(j-1), which satisfy (from the recurrence, x = -t)
    rho_j = j / (x + rho_(j+1)), a continued fraction that converges fast for
    x >= 3 and involves no subtraction. (float32 keeps ~1e-4 relative error
    just above t = -3, where the spec terms still cancel ~100-fold.)
    """
    t = mu / sigma
    cdf, pdf = normal_cdf(t), normal_pdf(t)
    if k == 0:
        return cdf
    if k == 1:
        direct = mu * cdf + sigma * pdf
    elif k == 2:
        direct = (mu * mu + sigma * sigma) * cdf + mu * sigma * pdf
    else:
        s2 = sigma * sigma
        direct = mu * (mu * mu + 3.0 * s2) * cdf + sigma * (mu * mu + 2.0 * s2) * pdf
    x = (-t).clamp_min(-_TAIL_FROM_T)  # only read where t < _TAIL_FROM_T
    ratio = torch.zeros_like(x)
    tail = cdf
    for j in range(k + _TAIL_CF_DEPTH, 0, -1):  # bottom-up continued fraction
        ratio = j / (x + ratio)
        if j <= k:
            tail = tail * ratio
    tail = tail * sigma.pow(k)
    return torch.where(t < _TAIL_FROM_T, tail, direct.clamp_min(0.0))


@functools.lru_cache(maxsize=None)
def _jacobi_rule(gamma: float, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Gauss rule for int_0^1 x^gamma f(x) dx (gamma > -1), by Golub-Welsch.

    Nodes/weights of the Jacobi weight (1 + y)^gamma on [-1, 1] from the
    eigen-decomposition of the (symmetric) Jacobi matrix of its three-term
    recurrence, then mapped to x = (1 + y) / 2. float64, host side, cached.
    """
    a, b = 0.0, gamma
    i = np.arange(n, dtype=np.float64)
    s = 2.0 * i + a + b
    with np.errstate(divide="ignore", invalid="ignore"):
        diag = (b * b - a * a) / (s * (s + 2.0))
    diag[0] = (b - a) / (a + b + 2.0)  # the general formula is 0/0 at i = 0 when a + b = 0
    j = np.arange(1, n, dtype=np.float64)
    sj = 2.0 * j + a + b
    off2 = 4.0 * j * (j + a) * (j + b) * (j + a + b) / (sj * sj * (sj + 1.0) * (sj - 1.0))
    jac = np.diag(diag) + np.diag(np.sqrt(off2), 1) + np.diag(np.sqrt(off2), -1)
    y, vec = np.linalg.eigh(jac)
    mass = 2.0 ** (a + b + 1.0) * math.gamma(a + 1.0) * math.gamma(b + 1.0)
    mass /= math.gamma(a + b + 2.0)  # total weight of (1 - y)^a (1 + y)^b on [-1, 1]
    w = mass * vec[0, :] ** 2
    return (1.0 + y) / 2.0, w * 2.0 ** (-gamma - 1.0)


@functools.lru_cache(maxsize=None)
def _rule_tensors(
    exponents: Tuple[float, ...], n_half: int, n_herm: int, device: torch.device, dtype: torch.dtype
):
    """Quadrature constants for a tuple of exponents, as cached tensors on the target device.

    Returns (x, c, z, w): the half-line nodes x [n_half] on [0, 1] and the
    matrix c [n_half, E] with c[i, e] = w_i x_i^(b_e - gamma) / sqrt(2 pi)
    (Gauss-Jacobi weights for x^gamma, gamma = min exponent, folded with the
    rest of each power and the normal constant); the Gauss-Hermite nodes z
    [n_herm] and weights w [n_herm] of E[f(Z)], Z ~ N(0, 1). Cached, so calls
    after the first make no host-to-device copy (CUDA-graph friendly).
    """
    gamma = min(exponents)
    xj, wj = _jacobi_rule(gamma, n_half)
    c = np.stack([wj * xj ** (b - gamma) for b in exponents], axis=1) * _INV_SQRT_2PI
    zh, wh = np.polynomial.hermite_e.hermegauss(n_herm)  # weight exp(-z^2 / 2)
    as_t = functools.partial(torch.as_tensor, device=device, dtype=dtype)
    return as_t(xj), as_t(c), as_t(zh), as_t(wh * _INV_SQRT_2PI)


def _quadrature_moments(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    exponents,
    n_half: int = QUAD_NODES,
    n_herm: int = HERMITE_NODES,
):
    """E[Y_+^b] for each b in ``exponents`` (all > -1), Y ~ N(mu, sigma^2), sigma > 0 assumed.

    Two rules, both evaluated everywhere (fixed shapes) and selected per
    element by t = mu / sigma:

    * t < 8: the integral over the positive half-line only,
          E[Y_+^b] = sigma^b int_0^inf s^b phi(s - t) ds,
      truncated at s = L(t) (where the integrand is negligible) and computed
      with a Gauss-Jacobi rule for the weight s^gamma, gamma = min exponent.
      The singular factor s^gamma is integrated exactly, so the kink at 0 costs
      no accuracy; what is left, s^(b-gamma) phi(s - t), is smooth. L(t) is the
      smaller of a Gaussian cut (max(t, 0) + sqrt(b) + 10: beyond it the
      integrand is < e^-50 of its peak) and a Gamma cut for t << 0, where the
      integrand ~ s^b exp(-|t| s) lives on a 1/|t| scale. All exponents share
      the nodes: one exp per node and element, then a small matmul.
    * t >= 8: Gauss-Hermite, E[Y_+^b] = sigma^b E[(t + Z)^b]. With 20 nodes the
      lowest node is -7.6 > -t, so every t + z_i > 0 and the kink at Z = -t
      (Gaussian weight < 5e-15 there) is never sampled.
    """
    exps = tuple(float(b) for b in exponents)
    b_max = max(exps)
    xj, c, zh, wh = _rule_tensors(exps, n_half, n_herm, mu.device, mu.dtype)
    t = mu / sigma
    neg = (-t).clamp_min(0.0)
    gauss_cut = t.clamp_min(0.0) + (math.sqrt(max(b_max, 0.0)) + 10.0)
    gamma_cut = (2.0 * (b_max + 1.0) + 40.0) / neg.clamp_min(1e-30)
    length = torch.minimum(gauss_cut, gamma_cut)
    hermite = t >= _HERMITE_FROM_T
    t_h = t.clamp_min(_HERMITE_FROM_T)  # keeps t + z > 0 where the rule is not used either

    shape = mu.shape
    flat_t, flat_len, flat_th = t.reshape(-1, 1), length.reshape(-1, 1), t_h.reshape(-1, 1)
    numel = flat_t.shape[0]
    half = torch.empty(numel, len(exps), dtype=mu.dtype, device=mu.device)
    herm = torch.empty_like(half)
    chunk = max(1, _QUAD_CHUNK_ELEMS // max(n_half, n_herm))
    for start in range(0, numel, chunk):  # Python loop over shapes only
        sl = slice(start, start + chunk)
        # half line, s = L x: int_0^L s^b phi(s - t) ds = L^(b+1) sum_i c_ib phi-part(L x_i - t)
        arg = flat_len[sl] * xj - flat_t[sl]
        half[sl] = torch.exp(-0.5 * arg * arg) @ c
        # Hermite: E[(t + Z)^b] = sum_i w_i exp(b log(t + z_i))
        log_tz = torch.log(flat_th[sl] + zh)
        herm[sl] = torch.stack([torch.exp(e * log_tz) @ wh for e in exps], dim=-1)
    out = []
    for i, e in enumerate(exps):
        h = half[:, i].reshape(shape) * length.pow(e + 1.0)
        g = herm[:, i].reshape(shape)
        out.append(torch.where(hermite, g, h) * sigma.pow(e))
    return out


def _moments(mu: torch.Tensor, sigma: torch.Tensor, exponents):
    """E[Y_+^b] for each b in ``exponents``; sigma == 0 gives max(mu, 0)^b (1{mu > 0} for b = 0).

    Closed forms when every exponent is in {0, 1, 2, 3}, quadrature otherwise.
    """
    pos_sigma = sigma > 0
    sig = torch.where(pos_sigma, sigma, torch.ones_like(sigma))  # no 0/0 in t
    if all(float(b).is_integer() and 0 <= b <= 3 for b in exponents):
        vals = [_closed_form(mu, sig, int(b)) for b in exponents]
    else:
        vals = _quadrature_moments(mu, sig, exponents)
    on = mu > 0
    mu_safe = torch.where(on, mu, torch.ones_like(mu))
    out = []
    for b, v in zip(exponents, vals):
        # sigma = 0: Y = mu exactly. Y_+^0 is read as 1{Y > 0}, consistent with
        # E[Y_+^0] = Phi(t) and d/dtau E[Y_+] = -E[Y_+^0].
        degenerate = torch.where(on, mu_safe.pow(b), torch.zeros_like(mu))
        out.append(torch.where(pos_sigma, v, degenerate))
    return out


def truncated_power_moment(mu: torch.Tensor, sigma: torch.Tensor, beta: float) -> torch.Tensor:
    """E[(Y)_+^beta] for Y ~ N(mu, sigma^2), elementwise.

    Args:
        mu: float tensor, any shape (broadcast with sigma).
        sigma: float tensor of standard deviations (>= 0), broadcastable.
        beta: Python float >= 0. beta in {0, 1, 2, 3} uses the spec closed
            forms; any other value a Gauss-Jacobi / Gauss-Hermite quadrature
            (~1e-12 relative error; see _quadrature_moments). Exponents in
            (-1, 0) are accepted too (the integral over Y > 0 is finite): the
            solver's derivatives E[Y_+^(beta-1)] need them for beta < 1.

    Returns:
        float32 tensor of the broadcast shape (float64 if an input is float64).
        sigma == 0 gives max(mu, 0)^beta, with Y_+^b read as 0 wherever
        Y <= 0 (so beta = 0 gives P(Y > 0) = Phi(mu / sigma), and 1{mu > 0}
        at sigma = 0). Never NaN for finite mu and sigma >= 0.
    """
    beta = float(beta)
    if not beta > -1.0 or math.isinf(beta):
        raise ValueError(f"beta must be a finite number > -1, got beta={beta}")
    mu = torch.as_tensor(mu)
    sigma = torch.as_tensor(sigma)
    dtype = _float_dtype(mu, sigma)
    mu, sigma = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype))
    return _moments(mu, sigma, [beta])[0]


# --------------------------------------------------------------------------
# the threshold estimate
# --------------------------------------------------------------------------


def pooled_moments(
    mu: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The single Gaussian that matches the mean and variance of the page mixture.

    With token counts w_p as weights (a random token of the sequence falls in
    page p with probability w_p / n):

        n       = sum_p w_p
        mu_g    = sum_p w_p mu_p / n
        sigma_g = sqrt( sum_p w_p sigma_p^2 / n + sum_p w_p (mu_p - mu_g)^2 / n )

    (within-page variance plus the variance of the page means).

    Args:
        mu, sigma, weights: float tensors [..., M] (broadcastable); weight 0
            marks an absent page.

    Returns:
        (mu_g, sigma_g, n), each [...] in float32 (float64 for float64 input).
        Rows with n == 0 give mu_g = sigma_g = 0. ``solve_tau_hat(mu_g[..., None],
        sigma_g[..., None], n[..., None], alpha)`` is the pooled estimate.
    """
    mu, sigma, w = (torch.as_tensor(a) for a in (mu, sigma, weights))
    dtype = _float_dtype(mu, sigma, w)
    mu, sigma, w = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype), w.to(dtype))
    n = w.sum(-1)
    n_safe = torch.where(n > 0, n, torch.ones_like(n))
    zero = torch.zeros_like(mu)
    # where() rather than w * mu: an absent page may carry garbage (even inf).
    mu_g = torch.where(w > 0, w * mu, zero).sum(-1) / n_safe
    dev = mu - mu_g.unsqueeze(-1)
    var = torch.where(w > 0, w * (sigma * sigma + dev * dev), zero).sum(-1) / n_safe
    return mu_g, var.sqrt(), n


def solve_tau_hat(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    weights: torch.Tensor,
    alpha: float,
    iters: int = TAU_HAT_ITERS,
) -> torch.Tensor:
    """Estimate the entmax threshold from per-page Gaussian score models (docs/spec.md, Eq. 18).

    Solves, along the last dim,

        F(tau) = sum_p w_p E[ [(alpha-1) S_p - tau]_+^beta ] - 1 = 0,
        S_p ~ N(mu_p, sigma_p^2),  beta = 1 / (alpha - 1).

    With a = alpha - 1, each term is w_p E[Y_+^beta] for
    Y ~ N(a mu_p - tau, (a sigma_p)^2), and dF/dtau = -beta sum_p w_p E[Y_+^(beta-1)].

    The root is bracketed without host branching:
      * lo = max_p (a mu_p - (2 / w_p)^a): at tau = lo, Y_p >= (2 / w_p)^a
        whenever S_p >= mu_p (probability >= 1/2), so page p alone has mass
        >= w_p (1/2) (2 / w_p) = 1 and F(lo) >= 0;
      * hi = max_p (a mu_p + k a sigma_p), with k chosen so that
        sum_p w_p (a sigma_p)^beta J_beta(-k) <= 1, using
        J_beta(-k) <= phi(k) 2^((beta-1)/2) Gamma((beta+1)/2); so F(hi) <= 0.
    It then runs a fixed number of Halley steps (Newton for alpha >= 2, where
    E[Y_+^(beta-2)] diverges) on h = (F + 1)^(alpha-1) - 1, an L^beta norm of
    Y_+ under the page mixture: convex for alpha <= 2 and exactly linear for
    a single page with sigma = 0. Steps fall back to bisection when they leave
    the bracket or stall (entmaxkv.entmax._safeguarded_step, shared with the
    exact solver).

    Args:
        mu: float [..., M], per-page mean score.
        sigma: float [..., M], per-page score standard deviation (>= 0).
        weights: float [..., M], valid tokens per page (0 = page absent;
            absent pages may hold any finite or infinite mu/sigma).
        alpha: Python float >= 1. alpha == 1 returns the softmax analogue
            logsumexp_p(log w_p + mu_p + sigma_p^2 / 2) (the log of the
            expected partition function).
        iters: number of Halley steps (fixed: no data-dependent stopping).

    Returns:
        tau_hat [...]: float32 (float64 if any input is float64); +inf on rows
        whose weights are all zero.
    """
    alpha = _check_alpha(alpha)
    mu, sigma, w = (torch.as_tensor(a) for a in (mu, sigma, weights))
    dtype = _float_dtype(mu, sigma, w)
    mu, sigma, w = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype), w.to(dtype))
    present = w > 0
    none = ~present.any(-1)
    inf = torch.full(mu.shape[:-1], float("inf"), dtype=dtype, device=mu.device)
    # Absent pages get neutral, finite stand-ins so that no inf/NaN enters sums.
    mu = torch.where(present, mu, torch.zeros_like(mu))
    sigma = torch.where(present, sigma, torch.zeros_like(sigma))

    if alpha == 1.0:
        logw = torch.where(present, w, torch.ones_like(w)).log()
        terms = logw + mu + 0.5 * sigma * sigma
        terms = torch.where(present, terms, torch.full_like(mu, float("-inf")))
        return torch.where(none, inf, torch.logsumexp(terms, dim=-1))

    a = alpha - 1.0
    beta = 1.0 / a
    m = a * mu  # mean of (alpha-1) S_p
    s = a * sigma  # std of (alpha-1) S_p
    ninf = torch.full_like(m, float("-inf"))

    # Bracket (see docstring). Shifting by c = max_p m_p keeps tau - c O(1..k s).
    c = torch.where(present, m, ninf).amax(-1)
    c = torch.where(none, torch.zeros_like(c), c)
    m = m - c.unsqueeze(-1)
    w_safe = torch.where(present, w, torch.ones_like(w))
    lo = torch.where(present, m - (2.0 / w_safe).pow(a), ninf).amax(-1)
    c_beta = 2.0 ** ((beta - 1.0) / 2.0) * math.gamma((beta + 1.0) / 2.0) * _INV_SQRT_2PI
    spread = (w * s.pow(beta)).sum(-1) * c_beta  # absent pages: w = 0, s = 0
    floor = torch.finfo(dtype).tiny  # log(0) guard; spread < 1 gives k = 0 anyway
    k = (2.0 * torch.log(spread.clamp_min(floor)).clamp_min(0.0)).sqrt()
    hi = torch.where(present, m + k.unsqueeze(-1) * s, ninf).amax(-1)
    lo = torch.where(none, torch.full_like(lo, -1.0), lo)
    hi = torch.where(none, torch.zeros_like(hi), hi)
    lo = torch.minimum(lo, hi)

    # Moments needed per step: beta (mass), beta-1 (F'), beta-2 (F'') while
    # the last is integrable (beta > 1); Newton only otherwise.
    halley = beta > 1.0
    exps = [beta, beta - 1.0, beta - 2.0] if halley else [beta, beta - 1.0]

    def power_sums(tau):
        # the entmax solver's S0, S1, S2 with sums over tokens replaced by
        # expectations: S_j = sum_p w_p E[Y_p+^(beta-j)]
        e = _moments(m - tau.unsqueeze(-1), s, exps)
        sums = [(w * v).sum(-1) for v in e]
        return sums[0], sums[1], sums[2] if halley else None

    tiny = 8.0 * torch.finfo(dtype).eps
    tau = lo.clone()
    step1 = hi - lo  # |step| one and two iterations back (rtsafe bookkeeping)
    step2 = hi - lo
    for _ in range(iters):
        s0, s1, s2 = power_sums(tau)
        above = s0 > 1.0  # F(tau) > 0: the root lies to the right
        lo = torch.where(above, tau, lo)
        hi = torch.where(above, hi, tau)
        h, h1, h2 = _h_and_derivs(s0, s1, s2, alpha)
        new = _safeguarded_step(tau, lo, hi, h, h1, h2, step2, tiny * (1.0 + tau.abs()))
        step2, step1 = step1, (new - tau).abs()
        tau = new
    return torch.where(none, inf, tau + c)
