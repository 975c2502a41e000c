"""alpha-entmax: thresholds, supports and probabilities (alpha = 1 is softmax).

For scores x in R^n and alpha > 1, alpha-entmax is the solution of

    p* = argmax_{p in simplex}  p.x + H_alpha(p),
    H_alpha(p) = (1 - sum_i p_i^alpha) / (alpha (alpha - 1))     (Tsallis entropy)

whose closed form, with beta = 1 / (alpha - 1), is

    p_i = [(alpha - 1) x_i - tau]_+ ^ beta,    tau the unique value with sum_i p_i = 1.

alpha = 2 is sparsemax, alpha = 1.5 gives p_i = [x_i / 2 - tau]_+^2 and alpha -> 1
is softmax; for alpha == 1 this module uses p_i = exp(x_i - tau) with
tau = logsumexp(x), so that "tau" always means "the number that turns scores
into probabilities" (docs/contracts.md).

Conventions shared by every function here:

* Masked entries are ``-inf``. They never enter the support and are not
  counted in n (the row length used by the bracket).
* A row whose entries are all masked has no distribution. Its threshold is
  defined as ``tau = +inf`` (so every p_i = [(alpha-1) x_i - tau]_+^beta, or
  exp(x_i - tau), is exactly 0), its support is 0 and its probabilities are
  zeros -- never NaN.
* Entries equal to +inf or NaN are not supported (the result is undefined).
* The solve runs in float32 for float16 / bfloat16 / float32 inputs and in
  float64 for float64 inputs: an fp16 threshold is wrong at long context.
* Nothing here calls ``.item()`` or branches in Python on tensor *values*
  (only on shapes, dtypes and the Python float ``alpha``), so every function
  runs on CUDA without a host synchronisation and inside CUDA-graph capture.

Algorithms: exact sort-based solutions for alpha == 2 and alpha == 1.5 and a
safeguarded Halley iteration with a fixed iteration count for other alpha
(SPEC section 1), both finished by Newton steps on the detected support.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "entmax_threshold",
    "entmax",
    "entmax_from_tau",
    "sparsemax",
    "entmax15",
]

# Iterations of the safeguarded Halley loop (the general-alpha path), chosen
# by alpha. For alpha <= 2 (beta >= 1) the transformed function h (see
# _threshold_halley) is convex and Halley from the left end converges in <= 6
# steps on every family we tried (ties, peaks, 1e6 equal entries, wide and
# narrow spreads); 16 leaves a wide margin. For alpha > 2 the function has
# vertical tangents where entries join the support and the safeguard falls
# back to bisection more often; 48 steps reach float64 resolution even then.
# Each step is one pass over the row.
HALLEY_ITERS_SMALL_ALPHA = 16
HALLEY_ITERS_LARGE_ALPHA = 48
# Newton steps on the detected support that finish every alpha > 1 solve
# (makes the sort-based float32 thresholds and the iterative ones exact to
# the working precision).
POLISH_ITERS = 2


def _default_iters(alpha: float) -> int:
    return HALLEY_ITERS_SMALL_ALPHA if alpha <= 2.0 else HALLEY_ITERS_LARGE_ALPHA


# --------------------------------------------------------------------------
# validation and dtype helpers
# --------------------------------------------------------------------------


def _check_alpha(alpha) -> float:
    """Return ``alpha`` as a Python float; raise ValueError unless alpha >= 1 is finite."""
    if isinstance(alpha, torch.Tensor):
        # A tensor alpha would force a host sync on every call; refuse it loudly.
        raise TypeError("alpha must be a Python float, not a tensor")
    try:
        a = float(alpha)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"alpha must be a real number >= 1, got {alpha!r}") from exc
    if math.isnan(a) or math.isinf(a) or a < 1.0:
        raise ValueError(f"alpha must be a finite number >= 1, got alpha={alpha!r}")
    return a


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is solved in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled_scores(x: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
    """z = (alpha - 1) x (or x itself for softmax), moved to the last dim, in the solve dtype."""
    z = x.movedim(dim, -1).to(_compute_dtype(x.dtype))
    if alpha != 1.0:
        z = z * (alpha - 1.0)  # -inf stays -inf because alpha - 1 > 0
    return z


# --------------------------------------------------------------------------
# numerical core: thresholds of z = (alpha-1) x along the last dim
# --------------------------------------------------------------------------


def _row_stats(z: torch.Tensor, alpha: float):
    """Per-row valid count n, max m and the SPEC bracket [m - 1, m - n^(1-alpha)].

    All-masked rows get m = 0 and n = 1 internally (a harmless dummy problem);
    the caller overwrites their threshold with +inf.
    """
    valid = z > float("-inf")
    n = valid.sum(-1)
    empty = n == 0
    m = torch.where(empty, torch.zeros((), dtype=z.dtype, device=z.device), z.amax(-1))
    nf = n.clamp_min(1).to(z.dtype)
    lo = m - 1.0  # the largest entry alone has mass 1 here: f(lo) >= 0
    hi = m - nf.pow(1.0 - alpha)  # every entry has mass <= 1/n here: f(hi) <= 0
    return n, empty, m, lo, hi


def _power_sums(z: torch.Tensor, tau: torch.Tensor, beta: float, order: int):
    """S0 = sum u^beta, S1 = sum u^(beta-1) and (order 2) S2 = sum u^(beta-2), u = [z - tau]_+.

    Sums run over the support (u > 0) only. In these terms the mass is
    f(tau) + 1 = S0, f' = -beta S1 and f'' = beta (beta - 1) S2.
    """
    u = (z - tau.unsqueeze(-1)).clamp_min(0.0)
    on = u > 0
    # Work on a safe copy of u so that powers of 0 (or of masked entries) never
    # produce inf/NaN that a `where` would then have to hide.
    us = torch.where(on, u, torch.ones_like(u))
    zero = torch.zeros_like(u)
    p0 = torch.where(on, us.pow(beta), zero)
    p1 = torch.where(on, p0 / us, zero)  # u^(beta-1), one division instead of a pow
    s0, s1 = p0.sum(-1), p1.sum(-1)
    if order < 2:
        return s0, s1, None
    if beta == 1.0:
        s2 = torch.zeros_like(s0)  # its coefficient beta (beta-1) is 0 anyway
    else:
        s2 = torch.where(on, p1 / us, zero).sum(-1)
    return s0, s1, s2


def _h_and_derivs(s0, s1, s2, alpha: float):
    """h = S0^(alpha-1) - 1 and its tau-derivatives h', h'' (h'' only if s2 is given).

    h has the same root and sign as f = S0 - 1, but S0^(alpha-1) is the
    beta-"norm" of u = [z - tau]_+ (beta = 1 / (alpha - 1)): it is exactly
    linear in tau while the support is fixed and its entries are equal, and
    convex for alpha <= 2. Newton/Halley on h therefore converge in a handful
    of steps where on f (a beta-th power, beta up to ~100 near softmax) they
    crawl.
    """
    beta, g = 1.0 / (alpha - 1.0), alpha - 1.0
    d0 = -beta * s1  # dS0/dtau
    sg = s0.pow(g)
    h = sg - 1.0
    # g S0^(g-1) written as g S0^g / S0 so a single pow is needed; S0 = 0 only
    # outside the bracket (NaN there is rejected by the safeguard).
    gs = g * sg / s0
    h1 = gs * d0
    if s2 is None:
        return h, h1, None
    d2 = beta * (beta - 1.0) * s2
    h2 = gs * ((g - 1.0) * d0 * d0 / s0 + d2)
    return h, h1, h2


def _newton_polish(z, tau, alpha, lo, hi, steps):
    """Newton steps on h restricted to the support detected at the current tau.

    Starting next to the root, this is an exact re-solve on that support to the
    working precision; the bracket clamp keeps a bad step harmless.
    """
    beta = 1.0 / (alpha - 1.0)
    for _ in range(steps):
        s0, s1, _ = _power_sums(z, tau, beta, order=1)
        h, h1, _ = _h_and_derivs(s0, s1, None, alpha)
        step = -h / h1
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        tau = torch.minimum(torch.maximum(tau + step, lo), hi)
    return tau


def _threshold_sparsemax_sort(z: torch.Tensor) -> torch.Tensor:
    """Exact sparsemax threshold (z already equals x since alpha - 1 = 1).

    With z sorted descending, the support size k* is the largest k with
    1 + k z_(k) > sum_{i<=k} z_(i), and tau = (sum_{i<=k*} z_(i) - 1) / k*.
    """
    _, empty, m, _, _ = _row_stats(z, 2.0)
    zs = torch.sort(z, dim=-1, descending=True).values
    valid = zs > float("-inf")
    # Shift by the max so that the cumulative sums only see values in [-1, 0]
    # on the support (no cancellation against a large common offset).
    d = torch.where(valid, zs - m.unsqueeze(-1), torch.zeros_like(zs))
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    tau_k = (d.cumsum(-1) - 1.0) / k
    cond = valid & (d > tau_k)
    kstar = (cond.to(torch.int64) * torch.arange(1, z.shape[-1] + 1, device=z.device)).amax(-1)
    idx = (kstar - 1).clamp_min(0).unsqueeze(-1)
    tau = tau_k.gather(-1, idx).squeeze(-1) + m
    return torch.where(empty, torch.full_like(tau, float("inf")), tau)


def _threshold_entmax15_sort(z: torch.Tensor) -> torch.Tensor:
    """Exact 1.5-entmax threshold for z = x / 2, p_i = [z_i - tau]_+^2.

    For the top-k entries (sorted descending), sum_{i<=k} (z_(i) - tau)^2 = 1
    has the root tau_k = mean_k - sqrt((1 - ss_k) / k), ss_k the sum of squared
    deviations from the mean; k* is the largest k with tau_k < z_(k).
    """
    _, empty, m, _, _ = _row_stats(z, 1.5)
    zs = torch.sort(z, dim=-1, descending=True).values
    valid = zs > float("-inf")
    d = torch.where(valid, zs - m.unsqueeze(-1), torch.zeros_like(zs))
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    mean = d.cumsum(-1) / k
    ss = ((d * d).cumsum(-1) - mean * mean * k).clamp_min(0.0)
    delta = (1.0 - ss) / k
    tau_k = mean - delta.clamp_min(0.0).sqrt()
    cond = valid & (delta >= 0) & (d > tau_k)
    kstar = (cond.to(torch.int64) * torch.arange(1, z.shape[-1] + 1, device=z.device)).amax(-1)
    idx = (kstar - 1).clamp_min(0).unsqueeze(-1)
    tau = tau_k.gather(-1, idx).squeeze(-1) + m
    return torch.where(empty, torch.full_like(tau, float("inf")), tau)


def _threshold_halley(
    z: torch.Tensor,
    alpha: float,
    tau_init: Optional[torch.Tensor] = None,
    n_iter: Optional[int] = None,
) -> torch.Tensor:
    """Safeguarded Halley iteration for any alpha > 1 (fixed iteration count).

    Solves h(tau) = (sum [z - tau]_+^beta)^(alpha-1) - 1 = 0, which has the
    root and sign of f(tau) = sum [z - tau]_+^beta - 1 but is far closer to
    linear (see _h_and_derivs). Safeguards, all branch-free:

    * the bracket [lo, hi] starts at the SPEC bounds [m - 1, m - n^(1-alpha)]
      and is tightened with the sign of f at every iterate;
    * the Halley step is the Newton step divided by (1 - L/2), L = h h''/h'^2;
      clamping L to [-1, 1] bounds it to 2/3..2 Newton steps where h'' blows
      up next to a kink, and keeps the cubic endgame (L -> 0 at the root);
    * a step is replaced by bisection when it leaves the bracket, is not
      finite, or is not at most half the step made two iterations earlier
      (Numerical Recipes' rtsafe rule: it breaks Newton 2-cycles and stalls
      where entries join the support with a vertical tangent, alpha > 2);
      steps below a few ulps are always accepted, so a converged iterate
      stays put.
    """
    beta = 1.0 / (alpha - 1.0)
    if n_iter is None:
        n_iter = _default_iters(alpha)
    _, empty, _, lo, hi = _row_stats(z, alpha)
    if tau_init is None:
        tau = lo.clone()
    else:
        t0 = tau_init.to(device=z.device, dtype=z.dtype).expand_as(lo)
        t0 = torch.where(torch.isnan(t0), lo, t0)
        tau = torch.minimum(torch.maximum(t0, lo), hi)  # a bad warm start is clamped
    tiny = 8.0 * torch.finfo(z.dtype).eps
    step1 = hi - lo  # |step| one and two iterations back (rtsafe bookkeeping)
    step2 = hi - lo
    for _ in range(n_iter):
        s0, s1, s2 = _power_sums(z, tau, beta, order=2)
        above = s0 > 1.0  # f(tau) > 0: the root lies to the right of tau
        lo = torch.where(above, tau, lo)
        hi = torch.where(above, hi, tau)
        h, h1, h2 = _h_and_derivs(s0, s1, s2, alpha)
        L = torch.nan_to_num(h * h2 / (h1 * h1), nan=0.0, posinf=1.0, neginf=-1.0)
        cand = tau - (h / h1) / (1.0 - 0.5 * L.clamp(-1.0, 1.0))
        size = (cand - tau).abs()
        ok = (cand >= lo) & (cand <= hi)  # False for NaN too
        ok &= (size <= 0.5 * step2) | (size <= tiny * (1.0 + tau.abs()))
        new = torch.where(ok, cand, 0.5 * (lo + hi))
        step2, step1 = step1, (new - tau).abs()
        tau = new
    tau = _newton_polish(z, tau, alpha, lo, hi, POLISH_ITERS)
    return torch.where(empty, torch.full_like(tau, float("inf")), tau)


def _threshold_last(
    z: torch.Tensor,
    alpha: float,
    tau_init: Optional[torch.Tensor] = None,
    method: str = "auto",
    n_iter: Optional[int] = None,
) -> torch.Tensor:
    """Threshold of z = (alpha-1) x along the last dim (alpha = 1: z = x, tau = logsumexp).

    ``method``: "auto" (sort for alpha in {1.5, 2}, Halley otherwise), "sort"
    (only alpha in {1.5, 2}) or "halley" (any alpha > 1); used by tests to
    check the two algorithms against each other.
    """
    if z.shape[-1] == 0:
        return torch.full(z.shape[:-1], float("inf"), dtype=z.dtype, device=z.device)
    if alpha == 1.0:
        tau = torch.logsumexp(z, dim=-1)
        # logsumexp of an all -inf row is -inf; the module convention is +inf.
        return torch.where(tau == float("-inf"), torch.full_like(tau, float("inf")), tau)
    if method not in ("auto", "sort", "halley"):
        raise ValueError(f"unknown method {method!r}")
    use_sort = method == "sort" or (method == "auto" and alpha in (1.5, 2.0))
    if use_sort:
        if alpha == 2.0:
            tau = _threshold_sparsemax_sort(z)
        elif alpha == 1.5:
            tau = _threshold_entmax15_sort(z)
        else:
            raise ValueError(f"the sort-based solver needs alpha in (1.5, 2), got alpha={alpha}")
        _, empty, _, lo, hi = _row_stats(z, alpha)
        # float32 cumulative sums over long supports lose a few digits: re-solve
        # on the detected support (the sort already found it).
        tau = _newton_polish(z, tau, alpha, lo, hi, POLISH_ITERS)
        return torch.where(empty, torch.full_like(tau, float("inf")), tau)
    return _threshold_halley(z, alpha, tau_init, n_iter)


def _support_last(z: torch.Tensor, tau: torch.Tensor, alpha: float) -> torch.Tensor:
    """int64 count of entries with p > 0, i.e. z > tau (softmax: unmasked entries)."""
    if alpha == 1.0:
        return (z > float("-inf")).sum(-1)
    return (z > tau.unsqueeze(-1)).sum(-1)


def _probs_last(z: torch.Tensor, tau: torch.Tensor, alpha: float) -> torch.Tensor:
    """p from z = (alpha-1) x and tau along the last dim, in z's dtype."""
    if alpha == 1.0:
        # tau = +inf on all-masked rows: exp(-inf) = 0, never NaN.
        return torch.exp(z - tau.unsqueeze(-1))
    u = (z - tau.unsqueeze(-1)).clamp_min(0.0)
    if alpha == 2.0:
        return u
    if alpha == 1.5:
        return u * u
    on = u > 0
    # pow on a safe copy: the gradient of u^beta at u = 0 is inf for beta < 1,
    # and inf * 0 from a `where` would be NaN.
    us = torch.where(on, u, torch.ones_like(u))
    return torch.where(on, us.pow(1.0 / (alpha - 1.0)), torch.zeros_like(u))


def _threshold_impl(x, alpha, dim=-1, tau_init=None, method="auto", n_iter=None):
    alpha = _check_alpha(alpha)
    with torch.no_grad():
        z = _scaled_scores(x, alpha, dim)
        if tau_init is not None:
            tau_init = tau_init.to(z.dtype)
        tau = _threshold_last(z, alpha, tau_init, method, n_iter)
        support = _support_last(z, tau, alpha)
    return tau, support


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def entmax_threshold(
    x: torch.Tensor,
    alpha: float,
    dim: int = -1,
    tau_init: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Threshold tau and support size of alpha-entmax along ``dim``.

    tau is the unique value with sum_i [(alpha-1) x_i - tau]_+^(1/(alpha-1)) = 1
    (alpha > 1), or logsumexp(x) (alpha == 1).

    Args:
        x: float tensor [..., n, ...] of scores; -inf entries are masked.
        alpha: Python float >= 1 (1: softmax, 1.5: entmax-1.5, 2: sparsemax).
        dim: the dimension that holds a distribution.
        tau_init: optional warm start, same shape as the returned tau. Used by
            the iterative (alpha not in {1, 1.5, 2}) solver only; it is clamped
            into the bracket, so a bad warm start costs iterations, not
            correctness.

    Returns:
        tau: x's shape with ``dim`` removed; float32 (float64 for float64 x).
            +inf for all-masked rows (every p is then 0).
        support: int64, same shape: the number of entries with p > 0, i.e.
            (alpha-1) x_i > tau; for softmax the number of unmasked entries;
            0 for all-masked rows.

    Both outputs are detached (no autograd graph). No host synchronisation.

    Raises:
        ValueError: if alpha < 1, NaN or infinite.
    """
    return _threshold_impl(x, alpha, dim, tau_init)


def entmax_from_tau(
    x: torch.Tensor, tau: torch.Tensor, alpha: float, dim: int = -1
) -> torch.Tensor:
    """Probabilities for a given threshold: p_i = [(alpha-1) x_i - tau]_+^(1/(alpha-1)).

    (alpha == 1: p_i = exp(x_i - tau).) Used by the decode reference, where tau
    is solved once over the kept tokens.

    Args:
        x: float tensor [..., n, ...]; -inf entries give p = 0.
        tau: x's shape with ``dim`` removed (any float dtype); +inf gives a row
            of zeros.
        alpha: Python float >= 1.
        dim: the distribution dimension.

    Returns:
        p, same shape and dtype as x (computed in float32, or float64 when x
        or tau is float64). Differentiable w.r.t. x and tau by plain autograd.
    """
    alpha = _check_alpha(alpha)
    cdt = torch.float64 if torch.float64 in (x.dtype, tau.dtype) else torch.float32
    z = x.movedim(dim, -1).to(cdt)
    if alpha != 1.0:
        z = z * (alpha - 1.0)
    p = _probs_last(z, tau.to(cdt), alpha)
    return p.movedim(-1, dim).to(x.dtype)


class _EntmaxFunction(torch.autograd.Function):
    """alpha-entmax with a closed-form backward.

    For alpha > 1 the Jacobian is J = diag(g) - g g^T / sum(g) with
    g_i = p_i^(2-alpha) on the support (0 elsewhere), so
    dx = g * dy - g * sum(g * dy) / sum(g): one pass, no n x n matrix.
    For alpha == 1 it is the softmax backward dx = p * (dy - sum(p * dy)).
    """

    @staticmethod
    def forward(x: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
        z = _scaled_scores(x, alpha, dim)
        tau = _threshold_last(z, alpha)
        p = _probs_last(z, tau, alpha)
        return p.movedim(-1, dim).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, alpha, dim = inputs
        ctx.alpha = alpha
        ctx.dim = dim
        # Only the output is needed: g is a function of p.
        ctx.save_for_backward(output)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        (p,) = ctx.saved_tensors
        alpha, dim = ctx.alpha, ctx.dim
        cdt = _compute_dtype(p.dtype)
        pc = p.to(cdt)
        dyc = dy.to(cdt)
        if alpha == 1.0:
            dx = pc * (dyc - (pc * dyc).sum(dim, keepdim=True))
        else:
            on = pc > 0
            if alpha == 2.0:
                g = on.to(cdt)
            else:
                g = torch.where(on, pc, torch.ones_like(pc)).pow(2.0 - alpha)
                g = torch.where(on, g, torch.zeros_like(pc))
            gsum = g.sum(dim, keepdim=True)
            gdy = (g * dyc).sum(dim, keepdim=True)
            # all-masked rows: g = 0 everywhere, dx = 0 (guard the 0/0).
            gsum = torch.where(gsum > 0, gsum, torch.ones_like(gsum))
            dx = g * dyc - g * (gdy / gsum)
        return dx.to(p.dtype), None, None


def entmax(x: torch.Tensor, alpha: float, dim: int = -1) -> torch.Tensor:
    """alpha-entmax along ``dim``.

    Solves  p = argmax_{p in simplex} p.x + (1 - sum_i p_i^alpha) / (alpha (alpha-1)),
    i.e. p_i = [(alpha-1) x_i - tau]_+^(1/(alpha-1)) with sum_i p_i = 1;
    alpha == 1 is softmax.

    Args:
        x: float tensor [..., n, ...] (float16/bfloat16/float32/float64);
            -inf entries are masked (p = 0).
        alpha: Python float >= 1.
        dim: the distribution dimension.

    Returns:
        p: same shape and dtype as x. Sums to 1 along ``dim`` with exact zeros
        outside the support (alpha > 1); all-masked rows give zeros.

    Differentiable (custom backward, O(n) memory and time; not twice
    differentiable). Raises ValueError for alpha < 1, NaN or infinite.
    """
    alpha = _check_alpha(alpha)
    return _EntmaxFunction.apply(x, alpha, dim)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax = ``entmax(x, 2.0, dim)``: the Euclidean projection of x onto the simplex."""
    return entmax(x, 2.0, dim)


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax = ``entmax(x, 1.5, dim)``: p_i = [x_i / 2 - tau]_+^2."""
    return entmax(x, 1.5, dim)
