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
(docs/spec.md §1), both finished by Newton steps on the detected support.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ._checks import as_dim, as_float, as_float_tensor, check_reduced_shape

__all__ = [
    "entmax_threshold",
    "entmax",
    "entmax_from_tau",
    "sparsemax",
    "entmax15",
]

# Iterations of the safeguarded Halley loop (the general-alpha path), chosen
# by alpha. For alpha <= 2 (beta >= 1) the transformed function h (see
# _h_and_derivs) is convex and Halley from the left end of the bracket
# reached the 300-step answer to 4 ulps within 5 steps on every family we
# tried (random at scales 0.01..10, Cauchy, ties, peaks, clusters, 3e5 equal
# entries, 1e6 entries, 70% masked; float32 and float64); 12 leaves a margin.
# For alpha > 2 the mass has vertical tangents where entries join the
# support, the rtsafe guard falls back to bisection more often, and the
# support can sit within 1e-12 of the max: up to 37 steps were needed at
# alpha = 5, so 64. Each step is one pass over the row.
HALLEY_ITERS_SMALL_ALPHA = 12
HALLEY_ITERS_LARGE_ALPHA = 64
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
    """Return ``alpha`` as a Python float; raise ValueError unless alpha >= 1 is
    a finite Python or NumPy number (a tensor alpha would force a host sync on
    every call to choose the solver, so it is refused too)."""
    return as_float(alpha, "alpha", lo=1.0)


def _check_scores(x, dim, name: str = "x") -> int:
    """Validate the score tensor and its distribution dim; return dim as an int."""
    as_float_tensor(x, name, min_dim=1)
    return as_dim(dim, "dim", x.dim())


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
# numerical core. Every solver works on d = z - max(z) along the last dim
# (z = (alpha-1) x), so that max(d) = 0 and the threshold t = tau - max(z)
# lies in [-1, -n^(1-alpha)]. Why: support entries then have d in [-1, 0],
# where d and t are far finer-grained than z and tau themselves; [d - t]_+ is
# accurate even when the support sits in a 1e-10-wide cluster (alpha > 2).
# --------------------------------------------------------------------------


def _shift(z: torch.Tensor):
    """d = z - m with m the row max over unmasked entries (0 for all-masked rows).

    Returns d [..., n], m [...], the valid count n [...] (int64) and the
    all-masked mask [...]. All-masked rows keep d = -inf everywhere; the
    solvers treat them as a dummy problem and their threshold is set to +inf.
    """
    n = (z > float("-inf")).sum(-1)
    empty = n == 0
    m = torch.where(empty, torch.zeros((), dtype=z.dtype, device=z.device), z.amax(-1))
    return z - m.unsqueeze(-1), m, n, empty


def _bracket(n: torch.Tensor, alpha: float, dtype: torch.dtype):
    """the spec bracket of the shifted threshold: [-1, -n^(1-alpha)].

    lo = -1: the largest entry alone has mass 1 there, so f(lo) >= 0.
    hi = -n^(1-alpha): every entry has mass <= 1/n there, so f(hi) <= 0.
    """
    nf = n.clamp_min(1).to(dtype)
    return -torch.ones_like(nf), -nf.pow(1.0 - alpha)


def _power_sums(d: torch.Tensor, t: torch.Tensor, beta: float, order: int):
    """S0 = sum u^beta, S1 = sum u^(beta-1) and (order 2) S2 = sum u^(beta-2), u = [d - t]_+.

    Sums run over the support (u > 0) only. In these terms the mass is
    f(t) + 1 = S0, f' = -beta S1 and f'' = beta (beta - 1) S2.
    """
    u = (d - t.unsqueeze(-1)).clamp_min(0.0)  # masked entries (d = -inf) give 0
    # Divide by a copy of u with its zeros replaced by 1: u^(beta-1) = u^beta / u
    # is then exactly 0 off the support (0 / 1) instead of inf or NaN, with one
    # pow per step instead of three.
    us = torch.where(u > 0, u, 1.0)
    p0 = u.pow(beta)  # 0^beta = 0 for beta > 0
    p1 = p0 / us
    s0, s1 = p0.sum(-1), p1.sum(-1)
    if order < 2:
        return s0, s1, None
    if beta == 1.0:
        s2 = torch.zeros_like(s0)  # its coefficient beta (beta-1) is 0 anyway
    else:
        s2 = (p1 / us).sum(-1)
    return s0, s1, s2


def _h_and_derivs(s0, s1, s2, alpha: float):
    """h = S0^(alpha-1) - 1 and its t-derivatives h', h'' (h'' only if s2 is given).

    h has the same root and sign as f = S0 - 1, but S0^(alpha-1) is the
    beta-"norm" of u = [d - t]_+ (beta = 1 / (alpha - 1)): it is exactly
    linear in t while the support is fixed and its entries are equal, and
    convex for alpha <= 2. Newton/Halley on h therefore converge in a handful
    of steps where on f (a beta-th power, beta up to ~100 near softmax) they
    crawl.
    """
    beta, g = 1.0 / (alpha - 1.0), alpha - 1.0
    d0 = -beta * s1  # dS0/dt
    sg = s0.pow(g)
    h = sg - 1.0
    # g S0^(g-1) written as g S0^g / S0 so a single pow is needed; S0 = 0 only
    # outside the bracket (the NaN it gives there is rejected by the safeguard).
    gs = g * sg / s0
    h1 = gs * d0
    if s2 is None:
        return h, h1, None
    d2 = beta * (beta - 1.0) * s2
    h2 = gs * ((g - 1.0) * d0 * d0 / s0 + d2)
    return h, h1, h2


def _newton_polish(d, t, alpha, lo, hi, steps):
    """Newton steps on h restricted to the support detected at the current t.

    Starting next to the root, this is an exact re-solve on that support to the
    working precision; the bracket clamp keeps a bad step harmless.
    """
    beta = 1.0 / (alpha - 1.0)
    for _ in range(steps):
        s0, s1, _ = _power_sums(d, t, beta, order=1)
        h, h1, _ = _h_and_derivs(s0, s1, None, alpha)
        step = -h / h1
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        t = torch.minimum(torch.maximum(t + step, lo), hi)
    return t


def _sorted_prefix_threshold(d: torch.Tensor, candidate) -> torch.Tensor:
    """Shared skeleton of the sort-based solvers.

    With the shifted scores sorted descending (ds, masked last), ``candidate``
    maps (ds, k) to t_k, the threshold if the support were the top k entries.
    The support size k* is the largest k with ds_(k) > t_k (the valid k form
    a prefix, up to ties at the threshold, which carry zero mass), and the
    threshold is t_{k*}.
    """
    ds = torch.sort(d, dim=-1, descending=True).values
    valid = ds > float("-inf")
    ds = torch.where(valid, ds, torch.zeros_like(ds))  # keep cumsums finite
    idx = torch.arange(1, d.shape[-1] + 1, device=d.device)
    t_k, ok = candidate(ds, idx.to(d.dtype))
    cond = valid & ok & (ds > t_k)
    kstar = (cond.to(torch.int64) * idx).amax(-1)
    return t_k.gather(-1, (kstar - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)


def _sparsemax_candidates(ds, k):
    """Sparsemax: sum_{i<=k} (ds_i - t) = 1  =>  t_k = (cumsum_k - 1) / k."""
    return (ds.cumsum(-1) - 1.0) / k, torch.ones_like(ds, dtype=torch.bool)


def _entmax15_candidates(ds, k):
    """1.5-entmax: sum_{i<=k} (ds_i - t)^2 = 1  =>  t_k = mean_k - sqrt((1 - ss_k) / k).

    ss_k is the sum of squared deviations from the top-k mean (ss_k > 1: no
    real root, so k is not a support size). Support entries have ds in
    [-1, 0], which keeps the cancellation in ss_k = sum ds^2 - k mean^2 mild.
    """
    mean = ds.cumsum(-1) / k
    ss = ((ds * ds).cumsum(-1) - mean * mean * k).clamp_min(0.0)
    delta = (1.0 - ss) / k
    return mean - delta.clamp_min(0.0).sqrt(), delta >= 0


def _safeguarded_step(t, lo, hi, h, h1, h2, step2, tiny):
    """One safeguarded Halley (h2 given) or Newton (h2 None) step for a root of h.

    [lo, hi] must bracket the root, with t one of its ends (the caller has
    just updated the bracket with the sign of h(t)). The Halley step is the
    Newton step divided by (1 - L/2), L = h h'' / h'^2; clamping L to [-1, 1]
    bounds it to 2/3..2 Newton steps where h'' blows up next to a kink, and
    keeps the cubic endgame (L -> 0 at the root). The step is replaced by
    bisection when it leaves the bracket, is not finite, or is not at most
    half the step made two iterations earlier (``step2``; Numerical Recipes'
    rtsafe rule: it breaks Newton 2-cycles and stalls). Steps up to ``tiny``
    are always accepted, so a converged iterate stays put. Shared with
    entmaxkv.gaussian.solve_tau_hat.
    """
    newton = h / h1
    if h2 is None:
        cand = t - newton
    else:
        L = torch.nan_to_num(h * h2 / (h1 * h1), nan=0.0, posinf=1.0, neginf=-1.0)
        cand = t - newton / (1.0 - 0.5 * L.clamp(-1.0, 1.0))
    size = (cand - t).abs()
    ok = (cand >= lo) & (cand <= hi)  # False for NaN too
    ok &= (size <= 0.5 * step2) | (size <= tiny)
    return torch.where(ok, cand, 0.5 * (lo + hi))


def _threshold_halley(
    d: torch.Tensor,
    n: torch.Tensor,
    alpha: float,
    t_init: Optional[torch.Tensor] = None,
    n_iter: Optional[int] = None,
) -> torch.Tensor:
    """Safeguarded Halley iteration for any alpha > 1 (fixed iteration count).

    Solves h(t) = (sum [d - t]_+^beta)^(alpha-1) - 1 = 0, which has the root
    and sign of f(t) = sum [d - t]_+^beta - 1 but is far closer to linear
    (see _h_and_derivs). The bracket [lo, hi] starts at the spec bounds and
    is tightened with the sign of f at every iterate; each step is a Halley
    step guarded by _safeguarded_step (bisection when it leaves the bracket or
    stalls -- as it does where entries join the support with a vertical
    tangent, alpha > 2). All branch-free; the count is fixed.
    """
    beta = 1.0 / (alpha - 1.0)
    if n_iter is None:
        n_iter = _default_iters(alpha)
    lo, hi = _bracket(n, alpha, d.dtype)
    if t_init is None:
        t = lo.clone()
    else:
        t0 = torch.where(torch.isnan(t_init), lo, t_init)
        t = torch.minimum(torch.maximum(t0, lo), hi)  # a bad warm start is clamped
    tiny = 8.0 * torch.finfo(d.dtype).eps  # |t| <= 1 in shifted coordinates
    step1 = hi - lo  # |step| one and two iterations back (rtsafe bookkeeping)
    step2 = hi - lo
    for _ in range(n_iter):
        s0, s1, s2 = _power_sums(d, t, beta, order=2)
        above = s0 > 1.0  # f(t) > 0: the root lies to the right of t
        lo = torch.where(above, t, lo)
        hi = torch.where(above, hi, t)
        h, h1, h2 = _h_and_derivs(s0, s1, s2, alpha)
        new = _safeguarded_step(t, lo, hi, h, h1, h2, step2, tiny)
        step2, step1 = step1, (new - t).abs()
        t = new
    return _newton_polish(d, t, alpha, lo, hi, POLISH_ITERS)


def _solve_shifted(
    z: torch.Tensor,
    alpha: float,
    tau_init: Optional[torch.Tensor] = None,
    method: str = "auto",
    n_iter: Optional[int] = None,
):
    """Threshold of z = (alpha-1) x along the last dim, in shifted form.

    Returns (d, m, t, n) with d = z - m, tau = m + t, n the valid counts; t is
    +inf on all-masked rows. alpha == 1: t = logsumexp(d).

    ``method``: "auto" (sort for alpha in {1.5, 2}, Halley otherwise), "sort"
    (alpha in {1.5, 2} only) or "halley" (any alpha > 1); tests use it to
    check the two algorithms against each other. ``tau_init`` is used by the
    Halley path only.
    """
    if method not in ("auto", "sort", "halley"):
        raise ValueError(f"unknown method {method!r}")
    d, m, n, empty = _shift(z)
    if alpha == 1.0:
        t = torch.logsumexp(d, dim=-1)
    elif method == "sort" or (method == "auto" and alpha in (1.5, 2.0)):
        if alpha == 2.0:
            t = _sorted_prefix_threshold(d, _sparsemax_candidates)
        elif alpha == 1.5:
            t = _sorted_prefix_threshold(d, _entmax15_candidates)
        else:
            raise ValueError(f"the sort-based solver needs alpha in {{1.5, 2}}, got alpha={alpha}")
        # float32 cumulative sums over long supports lose a few digits: re-solve
        # on the support the sort found.
        lo, hi = _bracket(n, alpha, d.dtype)
        t = _newton_polish(d, t, alpha, lo, hi, POLISH_ITERS)
    else:
        t_init = None if tau_init is None else tau_init.to(d.dtype) - m
        t = _threshold_halley(d, n, alpha, t_init, n_iter)
    t = torch.where(empty, torch.full_like(t, float("inf")), t)
    return d, m, t, n


def _probs_last(d: torch.Tensor, t: torch.Tensor, alpha: float) -> torch.Tensor:
    """p from (shifted) scores d = (alpha-1) x - c and threshold t = tau - c, last dim."""
    if alpha == 1.0:
        # t = +inf on all-masked rows: exp(-inf) = 0, never NaN.
        return torch.exp(d - t.unsqueeze(-1))
    u = (d - t.unsqueeze(-1)).clamp_min(0.0)
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
    """entmax_threshold with the solver choice exposed (for tests)."""
    alpha = _check_alpha(alpha)
    with torch.no_grad():
        z = _scaled_scores(x, alpha, dim)
        if z.shape[-1] == 0:
            shape = z.shape[:-1]
            return (
                torch.full(shape, float("inf"), dtype=z.dtype, device=z.device),
                torch.zeros(shape, dtype=torch.int64, device=z.device),
            )
        d, m, t, n = _solve_shifted(z, alpha, tau_init, method, n_iter)
        if alpha == 1.0:
            support = n  # every unmasked entry has exp(x - tau) > 0 in exact arithmetic
        else:
            support = (d > t.unsqueeze(-1)).sum(-1)
    return m + t, support


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
        ValueError: naming the argument: x not a floating tensor, alpha not a
        finite number >= 1, dim out of range, tau_init of the wrong shape.
    """
    dim = _check_scores(x, dim)
    if tau_init is not None:
        check_reduced_shape(tau_init, "tau_init", x, dim)
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
    dim = _check_scores(x, dim)
    check_reduced_shape(tau, "tau", x, dim)
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
        if z.shape[-1] == 0:
            return x.clone()
        d, _, t, _ = _solve_shifted(z, alpha)
        p = _probs_last(d, t, alpha)
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
    differentiable). Raises ValueError naming the argument for x not a
    floating tensor, alpha not a finite number >= 1 or dim out of range.
    """
    dim = _check_scores(x, dim)
    alpha = _check_alpha(alpha)
    return _EntmaxFunction.apply(x, alpha, dim)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax = ``entmax(x, 2.0, dim)``: the Euclidean projection of x onto the simplex."""
    return entmax(x, 2.0, dim)


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax = ``entmax(x, 1.5, dim)``: p_i = [x_i / 2 - tau]_+^2."""
    return entmax(x, 1.5, dim)
