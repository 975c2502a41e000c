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
* A row holding +inf or NaN gives NaN probabilities (never a plausible
  finite answer).
* The solve runs in float32 for float16 / bfloat16 / float32 inputs (float64
  for alpha > FLOAT64_ABOVE, docs/limits.md) and in
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

from ._checks import as_dim, as_float_tensor, check_reduced_shape
from .limits import FLOAT64_ABOVE, check_alpha, effective_alpha

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
    """The alpha that runs, as a Python float: check_alpha (a finite Python or
    NumPy number in [1, ALPHA_MAX], else ValueError naming ``alpha``; a tensor
    alpha would force a host sync on every call to choose the solver) followed
    by effective_alpha (1.0, softmax, when alpha - 1 < SOFTMAX_BELOW)."""
    return effective_alpha(check_alpha(alpha))


def _check_scores(x, dim, name: str = "x") -> int:
    """Validate the score tensor and its distribution dim; return dim as an int."""
    as_float_tensor(x, name, min_dim=1)
    return as_dim(dim, "dim", x.dim())


def _compute_dtype(dtype: torch.dtype, alpha: float = 1.0) -> torch.dtype:
    """The solve dtype: float64 for float64 inputs and for alpha > FLOAT64_ABOVE
    (where the support clusters within ~n^(1-alpha) of the row max, finer than
    float32 resolves); float32 otherwise."""
    if dtype == torch.float64 or alpha > FLOAT64_ABOVE:
        return torch.float64
    return torch.float32


# --------------------------------------------------------------------------
# numerical core. Every solver works on y = x - max(x) along the last dim
# (the shift comes BEFORE the scaling by alpha - 1, so a finite row never
# overflows, whatever |(alpha-1) x|) and on the log-threshold c, defined by
#
#     tau = (alpha-1) max(x) - exp(-(alpha-1) c),
#     p_i = [(alpha-1) y_i + exp(-(alpha-1) c)]_+ ^ (1/(alpha-1)).
#
# c lies in [0, ln n] for every alpha and tends to logsumexp(y) as alpha -> 1
# (softmax's tau in the same shifted coordinates). Why not solve for
# t = tau - (alpha-1) max(x) = -exp(-(alpha-1) c) in [-1, -n^(1-alpha)]: near
# softmax t = -1 + O(alpha-1) and a float t keeps no digit of the O(alpha-1)
# part (alpha = 1 + 1e-8 in float32 sums to n, not 1), while c keeps them all;
# at large alpha t ~ -n^(1-alpha) is exp(-(alpha-1) c) to full precision too.
# The base of the power, u = (alpha-1) y + exp(-(alpha-1) c), is evaluated in
# whichever of two forms has no cancellation (_base_power).
# --------------------------------------------------------------------------


def _shift(x: torch.Tensor, dim: int, dtype: torch.dtype):
    """y = x - max(x) moved to the last dim, in ``dtype``.

    Returns y [..., n], the row max m [...] (0 for all-masked rows), the valid
    count n [...] (int64, counted before the shift) and the all-masked mask
    [...]. All-masked rows keep y = -inf everywhere.
    """
    z = x.movedim(dim, -1).to(dtype)
    n = (z > float("-inf")).sum(-1)
    # NaN counts as present (not masked), so a row of NaN stays NaN.
    empty = (z == float("-inf")).all(-1)
    m = torch.where(empty, torch.zeros((), dtype=dtype, device=z.device), z.amax(-1))
    return z - m.unsqueeze(-1), m, n, empty


def _c_bracket(n: torch.Tensor, dtype: torch.dtype):
    """[0, ln n] brackets c: at c = 0 the largest entry alone has mass 1, at
    c = ln n every entry has mass <= 1/n."""
    nf = n.clamp_min(1).to(dtype)
    return torch.zeros_like(nf), nf.log()


def _base_power(y: torch.Tensor, c: torch.Tensor, g: float, t=None, far=None):
    """(p, u, on) for u = g y + exp(-g c) [..., n], c [...]: p = u^(1/g) on
    the support (on: u > 0) and 0 elsewhere.

    Two forms of the same number. w = g y + expm1(-g c) = u - 1 adds two
    non-positive terms, so log1p(w) is exact to rounding wherever u >= 1/2 --
    all of the support near softmax, where u = 1 - O(alpha-1) and u itself
    would have lost the O(alpha-1) part. Below 1/2, log(u) with
    u = g y + exp(-g c) is exact to rounding, and it is the form that resolves
    u ~ n^(1-alpha) at large alpha (exact ties: u = exp(-g c)).
    With ``t`` and ``far`` (bool [...], from _finish) the rows where ``far``
    use u = g y - t instead: there the threshold t = -exp(-g c) is in
    (-1/2, 0), where t carries more digits than c (see _finish).
    The power is exp(log1p(w) / g) where u >= 1/2 and pow(u, 1/g) below: the
    exp of a log would multiply u's rounding error by |log p|, while pow
    rounds once (exact for alpha = 2 and 1.5, powers 1 and 2).
    Off the support (and on masked entries, y = -inf) u is replaced by 1 so
    that no log, division or gradient sees a non-positive number.
    """
    gc = (g * c).unsqueeze(-1)
    gy = y * g
    u = gy + torch.exp(-gc)
    w = gy + torch.expm1(-gc)
    near = w > -0.5
    if t is not None:
        f = far.unsqueeze(-1)
        u = torch.where(f, gy - t.unsqueeze(-1), u)
        near = near & ~f
    on = near | (u > 0)
    us = torch.where(on, u, torch.ones_like(u))
    wn = torch.where(near, w, torch.zeros_like(w))
    p = torch.where(near, torch.exp(torch.log1p(wn) / g), us.pow(1.0 / g))
    return torch.where(on, p, torch.zeros_like(p)), us, on


def _power_sums(y: torch.Tensor, c: torch.Tensor, g: float, order: int):
    """S0 = sum u^beta, S1 = sum u^(beta-1) and (order 2) S2 = sum u^(beta-2),
    beta = 1/g, over the support (u > 0) only; S0 is the mass."""
    p0, us, _ = _base_power(y, c, g)
    p1 = p0 / us
    s0, s1 = p0.sum(-1), p1.sum(-1)
    s2 = (p1 / us).sum(-1) if order >= 2 else None
    return s0, s1, s2


def _log_mass(s0, s1, s2, c, g: float):
    """h = log S0 and its c-derivatives h', h'' (h'' only if s2 is given).

    With E = exp(-g c): dS0/dc = -E S1 and dS1/dc = -(1-g) E S2, so
    h' = -E S1 / S0 and h'' = (g E S1 + (1-g) E^2 S2) / S0 - h'^2.
    Why log S0: on a support of k equal entries S0 = k exp(-c), so h is
    exactly linear in c for every alpha, and near softmax
    h = logsumexp(y) - c + O(alpha-1); Newton and Halley on it converge in a
    few steps. S0 >= 1/n > 0 inside the bracket, so the log is finite.
    """
    e = torch.exp(-g * c)
    h = torch.log(s0)
    h1 = -e * s1 / s0
    if s2 is None:
        return h, h1, None
    h2 = (g * e * s1 + (1.0 - g) * e * e * s2) / s0 - h1 * h1
    return h, h1, h2


def _h_and_derivs(s0, s1, s2, alpha: float):
    """h = S0^(alpha-1) - 1 and its t-derivatives h', h'' (h'' only if s2 is given),
    for a threshold t with S0 = sum [d - t]_+^beta (entmaxkv.gaussian's solve).

    h has the same root and sign as f = S0 - 1, but S0^(alpha-1) is the
    beta-"norm" of u = [d - t]_+ (beta = 1 / (alpha - 1)): it is exactly
    linear in t while the support is fixed and its entries are equal, and
    convex for alpha <= 2.
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


def _newton_polish(y, c, g, lo, hi, steps):
    """Newton steps on log S0 restricted to the support detected at the current c.

    Starting next to the root, this is an exact re-solve on that support to the
    working precision; the bracket clamp keeps a bad step harmless.
    """
    for _ in range(steps):
        s0, s1, _ = _power_sums(y, c, g, order=1)
        h, h1, _ = _log_mass(s0, s1, None, c, g)
        step = -h / h1
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        c = torch.minimum(torch.maximum(c + step, lo), hi)
    return c


def _finish(y, c, n, alpha: float, steps: int = POLISH_ITERS):
    """(t, far): the shifted threshold t = -exp(-g c), re-solved in t where it is
    the finer variable, and the rows where it is (far, bool [...]).

    A float c is exact to ~eps * c, a float t to ~eps * |t|; since
    dt = g |t| dc, t is the finer one once |t| < 1/2 (g c > ln 2: large alpha
    or long rows), and there Newton steps on S0^(alpha-1) - 1 in t
    (_h_and_derivs, the form that is linear in t on a fixed support) recover
    the digits c cannot hold (entmax-1.5 over a 2^17-entry float32 support:
    2e-10 -> 5e-11). Elsewhere (near softmax) t is left unused.
    """
    g = alpha - 1.0
    beta = 1.0 / g
    far = g * c > math.log(2.0)
    d = y * g
    t = -torch.exp(-g * c)
    nf = n.clamp_min(1).to(y.dtype)
    lo, hi = -torch.ones_like(t), -nf.pow(-g)  # [-1, -n^(1-alpha)] brackets t
    for _ in range(steps):
        u = (d - t.unsqueeze(-1)).clamp_min(0.0)
        us = torch.where(u > 0, u, torch.ones_like(u))
        p0 = torch.where(u > 0, us.pow(beta), torch.zeros_like(u))
        h, h1, _ = _h_and_derivs(p0.sum(-1), (p0 / us).sum(-1), None, alpha)
        step = -h / h1
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        t = torch.minimum(torch.maximum(t + step, lo), hi)
    return t, far


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
    y: torch.Tensor,
    n: torch.Tensor,
    alpha: float,
    c_init: Optional[torch.Tensor] = None,
    n_iter: Optional[int] = None,
) -> torch.Tensor:
    """Safeguarded Halley iteration for c, any alpha > 1 (fixed iteration count).

    Solves h(c) = log sum_i u_i^beta = 0 (see _log_mass). The bracket [lo, hi]
    starts at [0, ln n] and is tightened with the sign of S0 - 1 at every
    iterate; each step is a Halley step guarded by _safeguarded_step
    (bisection when it leaves the bracket or stalls -- as it does where
    entries join the support with a vertical tangent, alpha > 2). All
    branch-free; the count is fixed.
    """
    g = alpha - 1.0
    if n_iter is None:
        n_iter = _default_iters(alpha)
    lo, hi = _c_bracket(n, y.dtype)
    if c_init is None:
        c = lo.clone()
    else:
        c0 = torch.where(torch.isnan(c_init), lo, c_init)
        c = torch.minimum(torch.maximum(c0, lo), hi)  # a bad warm start is clamped
    tiny = 8.0 * torch.finfo(y.dtype).eps * hi.clamp_min(1.0)
    step1 = hi - lo  # |step| one and two iterations back (rtsafe bookkeeping)
    step2 = hi - lo
    for _ in range(n_iter):
        s0, s1, s2 = _power_sums(y, c, g, order=2)
        above = s0 > 1.0  # mass > 1: the root lies to the right of c
        lo = torch.where(above, c, lo)
        hi = torch.where(above, hi, c)
        h, h1, h2 = _log_mass(s0, s1, s2, c, g)
        new = _safeguarded_step(c, lo, hi, h, h1, h2, step2, tiny)
        step2, step1 = step1, (new - c).abs()
        c = new
    return _newton_polish(y, c, g, lo, hi, POLISH_ITERS)


def _c_from_t(t: torch.Tensor, g: float) -> torch.Tensor:
    """c = -log(-t) / g for a shifted threshold t < 0; t >= 0 (or NaN) maps to
    +inf (or NaN), which the callers clamp into the bracket."""
    return -torch.log(-t) / g


def _solve(
    x: torch.Tensor,
    alpha: float,
    dim: int = -1,
    tau_init: Optional[torch.Tensor] = None,
    method: str = "auto",
    n_iter: Optional[int] = None,
):
    """The log-threshold of alpha-entmax of x along ``dim``.

    Returns (y, m, th, n, empty): y = x - m moved to the last dim in the solve
    dtype (_compute_dtype), m the row max, th = (c, t, far) the threshold
    (c [...] the log-threshold, for softmax c = logsumexp(y) and t = far =
    None; t, far from _finish), n the valid counts, empty the all-masked rows
    (their threshold is meaningless; callers give them tau = +inf, p = 0).

    ``method``: "auto" (sort for alpha in {1.5, 2}, Halley otherwise), "sort"
    (alpha in {1.5, 2} only) or "halley" (any alpha > 1); tests use it to
    check the two algorithms against each other. ``tau_init`` (a threshold
    tau, any float dtype) is used by the Halley path only.
    """
    if method not in ("auto", "sort", "halley"):
        raise ValueError(f"unknown method {method!r}")
    y, m, n, empty = _shift(x, dim, _compute_dtype(x.dtype, alpha))
    g = alpha - 1.0
    if alpha == 1.0:
        c = torch.logsumexp(y, dim=-1)
    elif method == "sort" or (method == "auto" and alpha in (1.5, 2.0)):
        if alpha == 2.0:
            t = _sorted_prefix_threshold(y * g, _sparsemax_candidates)
        elif alpha == 1.5:
            t = _sorted_prefix_threshold(y * g, _entmax15_candidates)
        else:
            raise ValueError(f"the sort-based solver needs alpha in {{1.5, 2}}, got alpha={alpha}")
        # float32 cumulative sums over long supports lose a few digits: re-solve
        # on the support the sort found.
        lo, hi = _c_bracket(n, y.dtype)
        c = torch.minimum(torch.maximum(torch.nan_to_num(_c_from_t(t, g), nan=0.0), lo), hi)
        c = _newton_polish(y, c, g, lo, hi, POLISH_ITERS)
    else:
        c_init = None
        if tau_init is not None:
            c_init = _c_from_t(tau_init.to(y.dtype) - g * m, g)
        c = _threshold_halley(y, n, alpha, c_init, n_iter)
    t = far = None
    if alpha != 1.0:
        t, far = _finish(y, c, n, alpha)
    return y, m, (c, t, far), n, empty


def _probs(y: torch.Tensor, th, empty: torch.Tensor, alpha: float) -> torch.Tensor:
    """p [..., n] from the shifted scores and the threshold th of _solve (zeros on all-masked rows)."""
    c, t, far = th
    if alpha == 1.0:
        c = torch.where(empty, torch.full_like(c, float("inf")), c)
        return torch.exp(y - c.unsqueeze(-1))  # exp(-inf) = 0, never NaN
    g = alpha - 1.0
    return _base_power(y, c, g, t, far)[0]


def _tau(m: torch.Tensor, th, empty: torch.Tensor, alpha: float) -> torch.Tensor:
    """tau = m + c (softmax) or (alpha-1) m + t; +inf on all-masked rows."""
    c, t, far = th
    if alpha == 1.0:
        tau = m + c
    else:
        g = alpha - 1.0
        tau = g * m + torch.where(far, t, -torch.exp(-g * c))
    return torch.where(empty, torch.full_like(tau, float("inf")), tau)


def _support(y, th, n, alpha: float) -> torch.Tensor:
    """int64 [...]: entries with p > 0 (softmax: every unmasked entry)."""
    if alpha == 1.0:
        return n
    c, t, far = th
    _, _, on = _base_power(y, c, alpha - 1.0, t, far)
    return on.sum(-1)


def _entmax_and_threshold(
    x: torch.Tensor, alpha: float, tau_init: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """alpha-entmax along the last dim of x and its threshold, from one solve.

    The one implementation behind entmax() and the decode reference
    (entmaxkv.attention.attend). ``alpha`` is already checked and effective
    (_check_alpha). Returns p [..., n] and tau [...] in the solve dtype
    (_compute_dtype(x.dtype, alpha)); p is built from the shifted scores and
    the log-threshold, never from tau. No autograd graph, no host sync.
    """
    with torch.no_grad():
        if x.shape[-1] == 0:
            dt = _compute_dtype(x.dtype, alpha)
            p = torch.zeros(x.shape, dtype=dt, device=x.device)
            return p, torch.full(x.shape[:-1], float("inf"), dtype=dt, device=x.device)
        y, m, th, _, empty = _solve(x, alpha, -1, tau_init)
        # A NaN or +inf score makes the row max non-finite; the solve clamps
        # its threshold into the bracket, so without this the row would read
        # as a plausible (zero) answer. 0 * m is NaN exactly there.
        p = _probs(y, th, empty, alpha) + 0.0 * m.unsqueeze(-1)
        return p, _tau(m, th, empty, alpha)


def _threshold_impl(x, alpha, dim=-1, tau_init=None, method="auto", n_iter=None):
    """entmax_threshold with the solver choice exposed (for tests)."""
    alpha = _check_alpha(alpha)
    out_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        if x.shape[dim] == 0:
            shape = x.movedim(dim, -1).shape[:-1]
            return (
                torch.full(shape, float("inf"), dtype=out_dt, device=x.device),
                torch.zeros(shape, dtype=torch.int64, device=x.device),
            )
        y, m, th, n, empty = _solve(x, alpha, dim, tau_init, method, n_iter)
        support = _support(y, th, n, alpha)
        return _tau(m, th, empty, alpha).to(out_dt), support


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
        alpha: number in [1, ALPHA_MAX] (1: softmax, 1.5: entmax-1.5, 2: sparsemax;
            softmax below 1 + SOFTMAX_BELOW; docs/limits.md).
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
        alpha: number in [1, ALPHA_MAX] (docs/limits.md).
        dim: the distribution dimension.

    Returns:
        p, same shape and dtype as x (computed in float32, or float64 when x
        or tau is float64). Differentiable w.r.t. x and tau by plain autograd.
    """
    dim = _check_scores(x, dim)
    check_reduced_shape(tau, "tau", x, dim)
    alpha = _check_alpha(alpha)
    cdt = _compute_dtype(torch.float64 if torch.float64 in (x.dtype, tau.dtype) else x.dtype, alpha)
    z = x.movedim(dim, -1).to(cdt)
    t = tau.to(cdt)
    if alpha == 1.0:
        p = torch.exp(z - t.unsqueeze(-1))  # tau = +inf gives zeros
    else:
        # Shift by the row max before scaling: (alpha-1) x may overflow where
        # (alpha-1) (x - max) does not. The max is detached: the shift cancels
        # in u = (alpha-1) x - tau, so it carries no gradient.
        valid = z > float("-inf")
        m = torch.where(valid.any(-1), z.amax(-1), torch.zeros_like(t)).detach()
        g = alpha - 1.0
        u = (z - m.unsqueeze(-1)) * g - (t - g * m).unsqueeze(-1)
        on = u > 0
        # pow on a safe copy: the gradient of u^beta at u = 0 is inf for beta < 1,
        # and inf * 0 from a `where` would be NaN.
        us = torch.where(on, u, torch.ones_like(u))
        p = torch.where(on, us.pow(1.0 / g), torch.zeros_like(u))
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
        if x.shape[dim] == 0:
            return x.clone()
        p, _ = _entmax_and_threshold(x.movedim(dim, -1), alpha)
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
        cdt = _compute_dtype(p.dtype, alpha)  # p^(2-alpha) overflows float32 for alpha > 2
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
        alpha: number in [1, ALPHA_MAX] (docs/limits.md).
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
