"""Truncated Gaussian moments and the Gaussian entmax threshold estimate.

SPEC section 5: a page's token scores are modelled as S_p ~ N(mu_p, sigma_p^2)
and the threshold estimate tau_hat solves the distributional constraint

    sum_p w_p E[g(S_p; tau_hat)] = 1,   g(s; tau) = [(alpha-1) s - tau]_+^beta,

beta = 1/(alpha-1), w_p the number of tokens of page p. With
Y = (alpha-1) S - tau ~ N(m, v^2) every term is a truncated power moment
E[Y_+^beta], in closed form for beta in {0, 1, 2, 3} and by quadrature
otherwise; d/dtau E[Y_+^beta] = -beta E[Y_+^(beta-1)] gives Newton steps.
All solvers run a fixed number of iterations (no host synchronisation).
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Tuple

import numpy as np
import torch

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Quadrature: z in [a, b] mapped by z = a + (b - a) x^2, x in [0, 1], which
# removes the kink of (.)_+^beta at the truncation point a.
_QUAD_NODES = 96
_Z_SPAN = 12.0
_NEWTON_ITERS = 40


def normal_cdf(t: torch.Tensor) -> torch.Tensor:
    """Standard normal cdf Phi(t), elementwise."""
    return 0.5 * torch.erfc(-t / _SQRT2)


def normal_pdf(t: torch.Tensor) -> torch.Tensor:
    """Standard normal pdf phi(t), elementwise."""
    return torch.exp(-0.5 * t * t) * _INV_SQRT_2PI


def normal_icdf(p: torch.Tensor) -> torch.Tensor:
    """Standard normal quantile Phi^{-1}(p), elementwise."""
    return torch.special.ndtri(p)


def page_quantile_z(q_max: float, page_size: int) -> float:
    """z with Phi(z)^P = q_max: the q_max-quantile of the largest of P draws."""
    if not 0.0 < q_max < 1.0:
        raise ValueError(f"q_max: expected a value in (0, 1), got {q_max!r}")
    if page_size < 1:
        raise ValueError(f"page_size: expected >= 1, got {page_size!r}")
    return NormalDist().inv_cdf(q_max ** (1.0 / page_size))


def _closed_form(mu, sigma, t, beta: int):
    """E[Y_+^beta] for Y ~ N(mu, sigma^2), t = mu / sigma, beta in {0,1,2,3}."""
    cdf, pdf = normal_cdf(t), normal_pdf(t)
    if beta == 0:
        return cdf
    if beta == 1:
        return mu * cdf + sigma * pdf
    if beta == 2:
        return (mu * mu + sigma * sigma) * cdf + mu * sigma * pdf
    return (mu**3 + 3 * mu * sigma**2) * cdf + sigma * (mu * mu + 2 * sigma**2) * pdf


def _legendre01(n: int, dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    x, w = np.polynomial.legendre.leggauss(n)
    x = torch.as_tensor((x + 1.0) / 2.0, dtype=dtype, device=device)
    w = torch.as_tensor(w / 2.0, dtype=dtype, device=device)
    return x, w


def _quadrature(mu, sigma, beta: float):
    """E[Y_+^beta] by Gauss-Legendre over z in [max(-mu/sigma, -12), 12]."""
    x, w = _legendre01(_QUAD_NODES, mu.dtype, mu.device)
    s = sigma.clamp(min=torch.finfo(mu.dtype).tiny)
    a = torch.clamp(-mu / s, min=-_Z_SPAN)
    b = torch.maximum(a, torch.full_like(a, _Z_SPAN))
    z = a[..., None] + (b - a)[..., None] * x * x  # [..., nodes]
    y = (mu[..., None] + s[..., None] * z).clamp(min=0)
    f = y.pow(beta) * normal_pdf(z) * 2.0 * (b - a)[..., None] * x
    return (f * w).sum(-1)


def truncated_power_moment(mu: torch.Tensor, sigma: torch.Tensor, beta: float) -> torch.Tensor:
    """E[(Y)_+^beta] for Y ~ N(mu, sigma^2), elementwise over broadcast inputs.

    Closed forms for beta in {0, 1, 2, 3} (SPEC section 5), Gauss-Legendre
    quadrature with a kink-removing change of variables otherwise. sigma = 0
    gives max(mu, 0)^beta (with 0^0 read as P(Y > 0) = 0).

    Args:
        mu, sigma: float tensors (sigma >= 0); beta: Python float > -1
            (negative beta > -1 is the derivative term of alpha > 2).
    Returns:
        float tensor of the broadcast shape.
    """
    if not beta > -1.0:
        raise ValueError(f"beta: expected > -1, got {beta!r}")
    mu, sigma = torch.broadcast_tensors(mu, sigma)
    if not mu.is_floating_point():
        mu = mu.float()
    sigma = sigma.to(mu.dtype)
    # sigma = 0: Y = mu exactly; only mu > 0 contributes (also for beta <= 0).
    deg = torch.where(mu > 0, mu.clamp(min=torch.finfo(mu.dtype).tiny).pow(beta), torch.zeros_like(mu))
    pos = sigma > 0
    s = torch.where(pos, sigma, torch.ones_like(sigma))
    if float(beta).is_integer() and 0 <= beta <= 3:
        val = _closed_form(mu, s, mu / s, int(beta))
    else:
        val = _quadrature(mu, s, beta)
    return torch.where(pos, val.clamp(min=0), deg)


def pooled_moments(mu: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor):
    """One Gaussian for a whole row of pages (SPEC's cheap variant).

    mu_g = sum w mu / n, sigma_g^2 = sum w (sigma^2 + (mu - mu_g)^2) / n, n = sum w,
    reducing the last dim. Rows with n = 0 give (0, 0, 0).
    """
    n = weights.sum(-1)
    n_safe = torch.where(n > 0, n, torch.ones_like(n))
    mu_g = (weights * mu).sum(-1) / n_safe
    var = (weights * (sigma * sigma + (mu - mu_g[..., None]) ** 2)).sum(-1) / n_safe
    return mu_g, var.clamp(min=0).sqrt(), n


def _log_moment(mu: torch.Tensor, sigma: torch.Tensor, beta: float) -> torch.Tensor:
    """log E[(Y)_+^beta], Y ~ N(mu, sigma^2), stable deep in the lower tail.

    For t = mu / sigma < 0 the closed forms cancel catastrophically; there
    E[Y_+^beta] = phi(t) sigma^beta P_beta(t) with the Mills ratio
    R(t) = Phi(t) / phi(t) = sqrt(pi/2) erfcx(-t / sqrt 2), and log phi(t) is
    kept in log space so nothing underflows. sigma = 0 gives beta log(mu_+).
    """
    tiny = torch.finfo(mu.dtype).tiny
    pos = sigma > 0
    s = torch.where(pos, sigma, torch.ones_like(sigma))
    t = mu / s
    if float(beta).is_integer() and 0 <= beta <= 3:
        b = int(beta)
        direct = _closed_form(mu, s, t.clamp(min=0), b).clamp(min=tiny).log()
        tn = t.clamp(max=0)
        R = math.sqrt(math.pi / 2) * torch.special.erfcx(-tn / _SQRT2)
        poly = (R, tn * R + 1, (tn * tn + 1) * R + tn, (tn**3 + 3 * tn) * R + tn * tn + 2)[b]
        tail = -0.5 * tn * tn - 0.5 * math.log(2 * math.pi) + b * s.log() + poly.clamp(min=tiny).log()
        val = torch.where(t >= 0, direct, tail)
    else:
        val = _quadrature(mu, s, beta).clamp(min=tiny).log()
    deg = torch.where(mu > 0, beta * mu.clamp(min=tiny).log(), torch.full_like(mu, -math.inf))
    return torch.where(pos, val, deg)


def solve_tau_hat(
    mu: torch.Tensor, sigma: torch.Tensor, weights: torch.Tensor, alpha: float,
    iters: int = _NEWTON_ITERS,
) -> torch.Tensor:
    """Solve sum_p w_p E[[(alpha-1) S_p - tau]_+^beta] = 1 for tau (last dim).

    Newton on g(tau) = log sum_p w_p E[...] (zero at the solution; the log
    keeps the steps well scaled when tau sits deep in the Gaussian tails, as
    it does for long rows), safeguarded by a bracket [lo, hi] with
    g(lo) >= 0 >= g(hi) built without host branching: at
    lo = max_p (alpha-1)(mu_p - 12 sigma_p) - 1 the best page alone has
    Y >= 1 almost surely (so the sum is >= 1 for w >= 1); at
    hi = max_p (alpha-1)(mu_p + 12 sigma_p) every Y is negative almost
    surely. A step that leaves the bracket is replaced by bisection. Solved
    in float64. alpha == 1 returns the softmax analogue
    logsumexp(log w + mu + sigma^2 / 2).

    Args:
        mu, sigma, weights: float [..., M] (weight 0 = page absent).
    Returns:
        tau_hat [...] (float64 for float64 inputs, float32 otherwise); +inf
        for rows whose weights are all zero.
    """
    if not alpha >= 1.0:
        raise ValueError(f"alpha: expected >= 1, got {alpha!r}")
    out_dt = torch.float64 if mu.dtype == torch.float64 else torch.float32
    mu, sigma, w = (t.to(torch.float64) for t in torch.broadcast_tensors(mu, sigma, weights))
    present = w > 0
    empty = ~present.any(-1)
    neg = torch.full_like(mu, -math.inf)
    logw = torch.where(present, w.clamp(min=1e-300).log(), neg)
    if alpha == 1.0:
        tau = torch.logsumexp(logw + mu + 0.5 * sigma * sigma, dim=-1)
        return torch.where(empty, torch.full_like(tau, math.inf), tau).to(out_dt)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    lo = torch.where(present, am1 * (mu - _Z_SPAN * sigma), neg).amax(-1) - 1.0
    hi = torch.where(present, am1 * (mu + _Z_SPAN * sigma), neg).amax(-1)
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.ones_like(hi), torch.maximum(hi, lo + 1e-9))
    m_y, s_y = am1 * mu, am1 * sigma

    tau = 0.5 * (lo + hi)
    for _ in range(iters):
        m = m_y - tau[..., None]
        g = torch.logsumexp(logw + _log_moment(m, s_y, beta), dim=-1)
        g1 = torch.logsumexp(logw + _log_moment(m, s_y, beta - 1.0), dim=-1)
        lo = torch.where(g >= 0, tau, lo)
        hi = torch.where(g < 0, tau, hi)
        dg = -beta * torch.exp(g1 - g)  # d log F / d tau
        step = tau - g / dg
        inside = (step > lo) & (step < hi)  # False for NaN steps (F underflow)
        tau = torch.where(inside, step, 0.5 * (lo + hi))
    return torch.where(empty, torch.full_like(tau, math.inf), tau).to(out_dt)
