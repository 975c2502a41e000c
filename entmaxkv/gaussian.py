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
from .entmax import _check_alpha, _safeguarded_step

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
# Above this distance d (in curvature widths) from the integrand's peak to
# the kink of (t + Z)_+^b at Z = -t, the kink carries Gaussian weight
# < 5e-15: centred Gauss-Hermite is exact to float64 there, and the
# half-line rule would need a long interval (see _quadrature_moments).
_HERMITE_FROM_D = 8.0
# Below this t the closed forms switch to a continued fraction (see
# _closed_form); at x = -t >= 3 a depth of 48 converges to ~1e-15.
_TAIL_FROM_T = -3.0
_TAIL_CF_DEPTH = 48
# Cap on elements x nodes materialised at once by the quadrature (memory).
_QUAD_CHUNK_ELEMS = 1 << 24

# Iterations of the tau_hat solver on the page mixture, from the pooled
# start (log(F + 1) Halley, see _solve_lambda), and of the pooled start's
# one-term solve from its left end.
TAU_HAT_ITERS = 8
POOLED_START_ITERS = 12


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
    recurrence, then mapped to x = (1 + y) / 2. The weights sum to the total
    mass int_0^1 x^gamma dx = 1 / (gamma + 1): written out, not as a ratio of
    Gamma functions, which overflows a float for gamma > 170. float64, host
    side, cached.
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
    return (1.0 + y) / 2.0, vec[0, :] ** 2 / (gamma + 1.0)


@functools.lru_cache(maxsize=None)
def _half_rule(exponents: Tuple[float, ...], n_half: int, device: torch.device, dtype: torch.dtype):
    """Half-line constants for a tuple of exponents, as cached tensors on the target device.

    Returns (x, c): the nodes x [n_half] on [0, 1] and the matrix
    c [n_half, E] with c[i, e] = w_i x_i^(b_e - gamma) / sqrt(2 pi)
    (Gauss-Jacobi weights for x^gamma, gamma = min exponent, folded with the
    rest of each power and the normal constant). Cached, so calls after the
    first make no host-to-device copy (CUDA-graph friendly).
    """
    gamma = min(exponents)
    xj, wj = _jacobi_rule(gamma, n_half)
    c = np.stack([wj * xj ** (b - gamma) for b in exponents], axis=1) * _INV_SQRT_2PI
    as_t = functools.partial(torch.as_tensor, device=device, dtype=dtype)
    return as_t(xj), as_t(c)


@functools.lru_cache(maxsize=None)
def _hermite_rule(n_herm: int, device: torch.device, dtype: torch.dtype):
    """Gauss-Hermite nodes u [n_herm] and log-weights [n_herm] of E[f(U)], U ~ N(0, 1) (cached)."""
    zh, wh = np.polynomial.hermite_e.hermegauss(n_herm)  # weight exp(-z^2 / 2)
    as_t = functools.partial(torch.as_tensor, device=device, dtype=dtype)
    return as_t(zh), as_t(np.log(wh * _INV_SQRT_2PI))


def _centre(exponents) -> float:
    """The exponent whose integrand's peak centres the shared Hermite nodes:
    the middle one (the solver's exponents are beta, beta-1, beta-2), >= 0."""
    return max(0.5 * (min(exponents) + max(exponents)), 0.0)


def _needs_half_line(exponents, n_herm: int = HERMITE_NODES) -> bool:
    """Whether some element can fall outside the centred Hermite rule's range.

    The rule is valid where d = sqrt(r^2 + b_c) >= _HERMITE_FROM_D (see
    _quadrature_moments), and d >= sqrt(b_c) always: for b_c >= D^2 (alpha
    below ~1.016 in the solver) the half-line rule is never selected and is
    not evaluated. A host-side decision on the exponents, never on data.
    """
    return _centre(exponents) < _HERMITE_FROM_D**2


def _quadrature_moments(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    exponents,
    log_mu=None,
    n_half: int = QUAD_NODES,
    n_herm: int = HERMITE_NODES,
):
    """E[Y_+^b] for each b in ``exponents`` (all > -1), Y ~ N(mu, sigma^2), sigma > 0 assumed.

    ``log_mu``: log(mu) where mu > 0 (any value elsewhere), when the caller
    has it more accurately than ``mu.log()`` (the solver's mu = 1 + (alpha-1) v
    with alpha - 1 down to 2^-33: log1p((alpha-1) v) keeps v's digits that
    1 + (alpha-1) v has rounded away). Every power is formed as
    exp(b * log(...)): b = 1 / (alpha - 1) reaches 2^33, where the powers and
    the Gamma-function sizes of the integrals leave every float range.

    Two rules, both evaluated everywhere (fixed shapes) and selected per
    element, with t = mu / sigma:

    * Centred Gauss-Hermite (Laplace-centred): the integrand of
          E[Y_+^b] = sigma^b int (t + z)_+^b phi(z) dz
      peaks at z* with z* (t + z*) = b_c (b_c = _centre(exponents)); with
      r = t + z*, curvature 1 + b_c / r^2 and d = sqrt(r^2 + b_c), the nodes
      are z = z* + (r / d) u_i, so that
          E[Y_+^b] = (sigma r)^b (r / d) e^(-z*^2/2)
                     sum_i w_i exp(b log1p(u_i / d) - z* (r / d) u_i + b_c u_i^2 / (2 d^2)),
      a sum of nearly constant terms (the linear and quadratic parts of the
      exponent cancel at b = b_c) for any b, however large. log(sigma r) =
      log(mu + sigma z*) is log_mu + log1p(z* / t) for mu > 0. Valid where
      d >= 8: with 20 nodes (|u_i| <= 7.62) every node has t + z > 0, and the
      kink at z = -t sits >= 8 curvature widths from the peak. At b = 0 this
      is plain Gauss-Hermite for t >= 8.
    * d < 8 (t < 8 and b_c < 64): the integral over the positive half-line only,
          E[Y_+^b] = sigma^b int_0^inf s^b phi(s - t) ds,
      truncated at s = L(t) (where the integrand is negligible) and computed
      with a Gauss-Jacobi rule for the weight s^gamma, gamma = min exponent.
      The singular factor s^gamma is integrated exactly, so the kink at 0 costs
      no accuracy; what is left, s^(b-gamma) phi(s - t), is smooth. L(t) is the
      smaller of a Gaussian cut (max(t, 0) + sqrt(b) + 10: beyond it the
      integrand is < e^-50 of its peak) and a Gamma cut for t << 0, where the
      integrand ~ s^b exp(-|t| s) lives on a 1/|t| scale. All exponents share
      the nodes: one exp per node and element, then a small matmul; the
      scale factors are added in the log domain.
    """
    exps = tuple(float(b) for b in exponents)
    b_max, b_min = max(exps), min(exps)
    bc = _centre(exps)
    dev, dt = mu.device, mu.dtype
    t = mu / sigma
    log_s = torch.log(sigma)
    pos = mu > 0
    if log_mu is None:
        log_mu = torch.log(torch.where(pos, mu, torch.ones_like(mu)))

    # centred Hermite: in w = log(Y / Y*) when the half line is never needed
    # (b_c >= 64, the near-softmax range: no kink in w, and the Gamma-like
    # skew of t << 0 is gone), else in z (exact for polynomials at b_c = 0,
    # where the log map is not). r (r - t) = b_c + l, z* = r - t, l = 1 in w
    # and 0 in z, without cancellation on either side of t = 0.
    log_space = not _needs_half_line(exps, n_herm)
    bl = bc + 1.0 if log_space else bc
    q = torch.sqrt(t * t + 4.0 * bl)
    up = t >= 0
    r = torch.where(up, 0.5 * (t + q), 2.0 * bl / (q - t))
    z_star = torch.where(up, 2.0 * bl / (t + q).clamp_min(torch.finfo(dt).tiny), 0.5 * (q - t))
    d = torch.sqrt(r * r + bl)
    hermite = (d >= _HERMITE_FROM_D) & (r > 0)
    d = torch.where(hermite, d, torch.full_like(d, 2.0 * _HERMITE_FROM_D))  # keeps 1 + u / d > 0
    r = torch.where(hermite, r, torch.ones_like(r))
    z_star = torch.where(hermite, z_star, torch.zeros_like(z_star))
    kappa = 1.0 / d if log_space else r / d
    t_safe = torch.where(pos, t, torch.ones_like(t))
    # log(sigma r) = log(mu + sigma z*)
    log_peak = torch.where(pos, log_mu + torch.log1p(z_star / t_safe), log_s + torch.log(r))
    u, log_w = _hermite_rule(n_herm, dev, dt)
    gap = [b - b_min for b in exps]
    int_gaps = all(float(g).is_integer() and g <= 3 for g in gap)

    half_on = _needs_half_line(exps, n_herm)
    if half_on:
        xj, c = _half_rule(exps, n_half, dev, dt)
        neg = (-t).clamp_min(0.0)
        gauss_cut = t.clamp_min(0.0) + (math.sqrt(max(b_max, 0.0)) + 10.0)
        gamma_cut = (2.0 * (b_max + 1.0) + 40.0) / neg.clamp_min(1e-30)
        length = torch.minimum(gauss_cut, gamma_cut)

    shape = mu.shape
    flat = lambda x: x.reshape(-1, 1)  # noqa: E731
    numel = t.numel()
    herm_out = torch.empty(numel, len(exps), dtype=dt, device=dev)
    half_out = torch.empty_like(herm_out) if half_on else None
    n_nodes = max(n_half if half_on else 0, n_herm)
    chunk = max(1, _QUAD_CHUNK_ELEMS // n_nodes)
    f_k, f_z, f_r, f_d = flat(kappa), flat(z_star), flat(r), flat(d)
    if half_on:
        f_t, f_len = flat(t), flat(length)
    log_w_u = log_w + 0.5 * u * u
    for start in range(0, numel, chunk):  # Python loop over shapes only
        sl = slice(start, start + chunk)
        # the sums start from exponent b_min, the others multiply by the
        # ratio y_i = Y_i / Y* to the power gap when the gaps are small integers
        if log_space:
            # w_i = u_i / d, delta_i = r (e^w_i - 1): the exponent is
            # (b + 1) w - z* delta - delta^2 / 2 + u^2 / 2
            lg = f_k[sl] * u  # [chunk, n]
            em = torch.expm1(lg)
            delta = f_r[sl] * em
            base = log_w_u - delta * (f_z[sl] + 0.5 * delta) + lg
            y = 1.0 + em
        else:
            # z_i = z* + kappa u_i: b log1p(u / d) - z* kappa u + (1 - kappa^2) u^2 / 2
            lg = torch.log1p(u / f_d[sl])
            kk = f_k[sl]
            base = log_w + u * (0.5 * (1.0 - kk * kk) * u - kk * f_z[sl])
            y = 1.0 + u / f_d[sl]
        if int_gaps:
            e = torch.exp(base + b_min * lg)
            for i, g in enumerate(gap):
                herm_out[sl, i] = (e * y.pow(int(g)) if g else e).sum(-1)
        else:
            for i, b in enumerate(exps):
                herm_out[sl, i] = torch.exp(base + b * lg).sum(-1)
        if half_on:
            # half line, s = L x: int_0^L s^b phi(s - t) ds = L^(b+1) sum_i c_ib phi-part(L x_i - t)
            arg = f_len[sl] * xj - f_t[sl]
            arg = -0.5 * arg * arg
            top = arg.amax(-1, keepdim=True)
            # log of the sum (-inf where it is 0), so that L^(b+1) sigma^b joins in the log domain
            half_out[sl] = torch.log((torch.exp(arg - top) @ c).clamp_min(0.0)) + top
    out = []
    # w: log(r / d) - z*^2 / 2 (ds = sigma r e^w dw); z: log(kappa) - z*^2 / 2
    head = torch.log(kappa) - 0.5 * z_star * z_star
    if log_space:
        head = head + log_peak - log_s
    for i, b in enumerate(exps):
        g = torch.exp(b * log_peak + head + torch.log(herm_out[:, i].reshape(shape)))
        if half_on:
            h = torch.exp(half_out[:, i].reshape(shape) + (b + 1.0) * torch.log(length) + b * log_s)
            g = torch.where(hermite, g, h)
        out.append(g)
    return out


def _moments(mu: torch.Tensor, sigma: torch.Tensor, exponents, log_mu=None):
    """E[Y_+^b] for each b in ``exponents``; sigma == 0 (or too small to
    matter, see below) gives max(mu, 0)^b (1{mu > 0} for b = 0).

    Closed forms when every exponent is in {0, 1, 2, 3}, quadrature otherwise.
    ``log_mu``: an accurate log(mu) where mu > 0 (see _quadrature_moments).
    """
    # A spread that no exponent can resolve counts as none: where
    # max(|b|, 1) sigma <= eps |mu|, E[Y_+^b] = max(mu, 0)^b (1 + O(eps^2)),
    # and the rules below never see |t| = |mu| / sigma > max(|b|, 1) / eps,
    # which keeps t^2 finite (a float32 sigma of 1e-30 would overflow it).
    b_abs = max(max(abs(float(b)) for b in exponents), 1.0)
    pos_sigma = sigma * b_abs > mu.abs() * torch.finfo(mu.dtype).eps
    sig = torch.where(pos_sigma, sigma, torch.ones_like(sigma))  # no 0/0 in t
    mu_q = torch.where(pos_sigma, mu, torch.zeros_like(mu))
    if all(float(b).is_integer() and 0 <= b <= 3 for b in exponents):
        vals = [_closed_form(mu_q, sig, int(b)) for b in exponents]
    else:
        log_q = None if log_mu is None else torch.where(pos_sigma, log_mu, torch.zeros_like(log_mu))
        vals = _quadrature_moments(mu_q, sig, exponents, log_q)
    on = mu > 0
    mu_safe = torch.where(on, mu, torch.ones_like(mu))
    out = []
    for b, v in zip(exponents, vals):
        # sigma = 0: Y = mu exactly. Y_+^0 is read as 1{Y > 0}, consistent with
        # E[Y_+^0] = Phi(t) and d/dtau E[Y_+] = -E[Y_+^0]. With log_mu the
        # power is formed from it (mu itself may have lost the digits).
        power = mu_safe.pow(b) if log_mu is None else torch.exp(b * log_mu)
        degenerate = torch.where(on, power, torch.zeros_like(mu))
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


class PageSums:
    """Reductions over the page axis (the last dim) of the pages this
    process holds. ``entmaxkv.distributed`` passes one that also reduces
    across the ranks holding the other pages of the same rows, so that the
    same solver gives the tau_hat of the whole sequence."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax(-1)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(x, -1)


LOCAL = PageSums()


def pooled_moments(
    mu: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor, pages: PageSums = LOCAL,
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
        pages: how the page axis is reduced (``PageSums``; default: locally).

    Returns:
        (mu_g, sigma_g, n), each [...] in float32 (float64 for float64 input).
        Rows with n == 0 give mu_g = sigma_g = 0. ``solve_tau_hat(mu_g[..., None],
        sigma_g[..., None], n[..., None], alpha)`` is the pooled estimate.
    """
    mu, sigma, w = (torch.as_tensor(a) for a in (mu, sigma, weights))
    dtype = _float_dtype(mu, sigma, w)
    mu, sigma, w = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype), w.to(dtype))
    zero = torch.zeros_like(mu)
    # where() rather than w * mu: an absent page may carry garbage (even inf).
    n, wmu = pages.sum(torch.stack((w, torch.where(w > 0, w * mu, zero))))
    n_safe = torch.where(n > 0, n, torch.ones_like(n))
    mu_g = wmu / n_safe
    dev = mu - mu_g.unsqueeze(-1)
    var = pages.sum(torch.where(w > 0, w * (sigma * sigma + dev * dev), zero)) / n_safe
    return mu_g, var.sqrt(), n


def _entmax_sums(v, s, w, a: float, exps, pages: PageSums = LOCAL):
    """S_j = sum_p w_p E[(1 + a (v_p + s_p Z))_+^(beta - j)] along the last dim, one per exponent.

    Y = 1 + a (v + s Z) is formed in score units: its log is log1p(a v) at
    the mean, which keeps the digits of v that 1 + a v rounds away when a is
    tiny (alpha - 1 down to 2^-33).
    """
    m = 1.0 + a * v
    log_m = torch.log1p(torch.where(m > 0, a * v, torch.zeros_like(v)))
    e = _moments(m, a * s, exps, log_m)
    return list(pages.sum(torch.stack([w * x for x in e])))


def _lambda_bracket(mu, sigma, w, present, a: float, pages: PageSums = LOCAL):
    """[lo, hi] around the root in lambda (tau = a lambda - 1), scores shifted to max 0.

    lo: page p alone has mass >= 1 there (see solve_tau_hat). hi: the smaller
    of the Gaussian-tail bound and the softmax bound; the latter holds since
    (1 + a y)_+^(1/a) <= e^y for every y, so F(lambda) <= sum_p w_p
    e^(mu_p - lambda + sigma_p^2 / 2), which is <= 1 at its logsumexp.
    """
    beta = 1.0 / a
    ninf = torch.full_like(mu, float("-inf"))
    w_safe = torch.where(present, w, torch.ones_like(w))
    # (2 / w)^a = 1 + a (mu_p - lo_p): expm1 keeps it exact for tiny a
    lo = pages.max(torch.where(present, mu - torch.expm1(a * torch.log(2.0 / w_safe)) / a, ninf))
    # Gaussian tail: J_beta(-k) <= phi(k) 2^((beta-1)/2) Gamma((beta+1)/2), in logs
    log_c = 0.5 * (beta - 1.0) * math.log(2.0) + math.lgamma(0.5 * (beta + 1.0)) + math.log(_INV_SQRT_2PI)
    s = a * sigma
    log_terms = torch.where(present & (s > 0), torch.log(w_safe) + beta * torch.log(s.clamp_min(1e-300)), ninf)
    log_spread = pages.logsumexp(log_terms) + log_c
    k = (2.0 * log_spread.clamp_min(0.0)).sqrt()
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
    hi_tail = pages.max(torch.where(present, mu + k.unsqueeze(-1) * sigma, ninf)) + beta
    hi_soft = pages.logsumexp(torch.where(present, torch.log(w_safe) + mu + 0.5 * sigma * sigma, ninf))
    hi = torch.minimum(hi_tail, hi_soft)
    return torch.minimum(lo, hi), hi


def _solve_lambda(mu, sigma, w, present, alpha: float, start, lo, hi, iters: int, pages: PageSums = LOCAL):
    """Safeguarded Halley (Newton for alpha >= 2) on g(lambda) = log S0(lambda), fixed steps.

    S0 = F + 1 = sum_p w_p E[Y_p+^beta], Y_p = 1 + a (mu_p - lambda + sigma_p Z):
    dS0/dlambda = -S1 (a beta = 1) and d^2S0/dlambda^2 = (1 - a) S2, so
    g' = -S1 / S0, g'' = (1 - a) S2 / S0 - g'^2. g is exactly linear in the
    softmax limit and close to linear-quadratic otherwise (each term decays
    like a Gaussian tail), so Halley from a pooled start converges in a few
    steps; entmaxkv.entmax._safeguarded_step bisects when a step leaves the
    bracket or stalls.
    """
    a = alpha - 1.0
    beta = 1.0 / a
    halley = beta > 1.0
    exps = [beta, beta - 1.0, beta - 2.0] if halley else [beta, beta - 1.0]
    tiny = 8.0 * torch.finfo(mu.dtype).eps
    # a start outside the bracket restarts from its left end (F >= 0, smooth)
    # rather than from hi, which sits on the kink of a zero-sigma page
    lam = torch.where((start > lo) & (start < hi), start, lo)
    step2 = hi - lo
    step1 = hi - lo
    for _ in range(iters):
        sums = _entmax_sums(mu - lam.unsqueeze(-1), sigma, w, a, exps, pages)
        s0, s1 = sums[0], sums[1]
        above = s0 > 1.0  # F > 0: the root lies to the right
        lo = torch.where(above, lam, lo)
        hi = torch.where(above, hi, lam)
        # g = log S0 where S0 >= 1; (S0^a - 1) / a to the right of the root
        # (same root, value and slope at S0 = 1; expm1 keeps its digits for
        # tiny a), which stays finite with a finite slope where S0 -> 0 at
        # the kink of a zero-sigma page: there log S0 is steep enough that
        # a Newton step from next to the kink rounds to no step at all.
        log_s0 = torch.log(s0)
        pa = torch.where(above, torch.ones_like(s0), torch.exp(a * log_s0))  # S0^a, or 1
        r1 = s1 / s0
        r2 = sums[2] / s0 if halley else None
        g = torch.where(above, log_s0, torch.expm1(a * log_s0) / a)
        g1 = -pa * r1
        if halley:
            g2 = torch.where(above, (1.0 - a) * r2 - r1 * r1, (1.0 - a) * pa * (r2 - r1 * r1))
        else:
            g2 = None
        new = _safeguarded_step(lam, lo, hi, g, g1, g2, step2, tiny * (1.0 + lam.abs()))
        step2, step1 = step1, (new - lam).abs()
        lam = new
    return lam


def solve_tau_hat(
    mu: torch.Tensor,
    sigma: torch.Tensor,
    weights: torch.Tensor,
    alpha: float,
    iters: int = TAU_HAT_ITERS,
    pages: PageSums = LOCAL,
) -> torch.Tensor:
    """Estimate the entmax threshold from per-page Gaussian score models (docs/spec.md, Eq. 18).

    Solves, along the last dim,

        F(tau) = sum_p w_p E[ [(alpha-1) S_p - tau]_+^beta ] - 1 = 0,
        S_p ~ N(mu_p, sigma_p^2),  beta = 1 / (alpha - 1),

    for every alpha > 1, including alpha - 1 down to 2^-33 (where beta is
    2^33 and Gamma(beta) has long left every float range). It solves for
    lambda with tau = (alpha - 1) lambda - 1, so that, with a = alpha - 1,

        (alpha-1) S_p - tau = 1 + a (S_p - lambda),

    a quantity whose deviation from 1 stays in score units (lambda -> the
    log-partition as alpha -> 1), and forms every moment in the log domain
    (_quadrature_moments). After shifting the scores by their row max:

      * bracket: lo = max_p (mu_p - ((2 / w_p)^a - 1) / a): at lo page p alone
        has Y_p >= (2 / w_p)^a whenever S_p >= mu_p (probability >= 1/2), so
        its mass is >= w_p (1/2) (2 / w_p) = 1 and F(lo) >= 0; hi = the
        smaller of max_p (mu_p + k sigma_p) + 1 / a, with k chosen so that
        sum_p w_p (a sigma_p)^beta J_beta(-k) <= 1 (using J_beta(-k) <=
        phi(k) 2^((beta-1)/2) Gamma((beta+1)/2), in logs), and the softmax
        bound logsumexp_p(log w_p + mu_p + sigma_p^2 / 2); F(hi) <= 0.
      * start: the same equation for the pooled Gaussian (``pooled_moments``,
        one term: cheap), solved from its own left end, clamped into the bracket.
      * ``iters`` safeguarded Halley steps on log(F + 1) (_solve_lambda).

    Args:
        mu: float [..., M], per-page mean score.
        sigma: float [..., M], per-page score standard deviation (>= 0).
        weights: float [..., M], valid tokens per page (0 = page absent;
            absent pages may hold any finite or infinite mu/sigma).
        alpha: Python float >= 1. alpha == 1 returns the softmax analogue
            logsumexp_p(log w_p + mu_p + sigma_p^2 / 2) (the log of the
            expected partition function).
        iters: number of Halley steps on the page mixture (fixed: no
            data-dependent stopping).
        pages: how sums and maxima over the page axis are taken
            (``PageSums``; default: over the pages given, in this process).

    Returns:
        tau_hat [...]: float32 (float64 if any input is float64); +inf on rows
        whose weights are all zero.
    """
    alpha = _check_alpha(alpha)
    mu, sigma, w = (torch.as_tensor(a) for a in (mu, sigma, weights))
    dtype = _float_dtype(mu, sigma, w)
    mu, sigma, w = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype), w.to(dtype))
    present = w > 0
    none = pages.max(present.to(dtype)) <= 0
    inf = torch.full(mu.shape[:-1], float("inf"), dtype=dtype, device=mu.device)
    # Absent pages get neutral, finite stand-ins so that no inf/NaN enters sums.
    mu = torch.where(present, mu, torch.zeros_like(mu))
    sigma = torch.where(present, sigma, torch.zeros_like(sigma))
    w = torch.where(present, w, torch.zeros_like(w))

    if alpha == 1.0:
        logw = torch.where(present, w, torch.ones_like(w)).log()
        terms = logw + mu + 0.5 * sigma * sigma
        terms = torch.where(present, terms, torch.full_like(mu, float("-inf")))
        return torch.where(none, inf, pages.logsumexp(terms))

    a = alpha - 1.0
    # shift by the row max so that lambda - c is O(log n + k sigma)
    c = pages.max(torch.where(present, mu, torch.full_like(mu, float("-inf"))))
    c = torch.where(none, torch.zeros_like(c), c)
    mu = torch.where(present, mu - c.unsqueeze(-1), torch.zeros_like(mu))
    lo, hi = _lambda_bracket(mu, sigma, w, present, a, pages)
    lo = torch.where(none, torch.full_like(lo, -1.0), lo)
    hi = torch.where(none, torch.zeros_like(hi), hi)

    # pooled start: one Gaussian, its own bracket and left end
    mu_g, sigma_g, n_g = (x.unsqueeze(-1) for x in pooled_moments(mu, sigma, w, pages))
    p_g = n_g > 0
    lo_g, hi_g = _lambda_bracket(mu_g, sigma_g, n_g, p_g, a)
    lo_g = torch.where(none, lo, lo_g)
    hi_g = torch.where(none, hi, hi_g)
    start = _solve_lambda(mu_g, sigma_g, torch.where(p_g, n_g, torch.ones_like(n_g)), p_g, alpha,
                          lo_g, lo_g, hi_g, POOLED_START_ITERS)
    start = torch.where(torch.isfinite(start), start, lo)
    lam = _solve_lambda(mu, sigma, w, present, alpha, start, lo, hi, iters, pages)
    # tau = a (lambda + c) - 1
    return torch.where(none, inf, a * (lam + c) - 1.0)
