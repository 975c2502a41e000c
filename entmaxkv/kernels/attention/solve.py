"""Pass 2 of entmax attention: the exact tau of each query head over its
candidate lists (``_attn_solve_kernel``), and the solver it shares with the
one-launch finish (finish.py).

The candidates are scores s; the solve works in the shifted form, relative
to the row max m (entmax_form in _common.py): y = s - m <= 0 is exact near
the max whatever the size of s, and the threshold t = tau - (alpha-1) m lies
in [-1, -c^(1-alpha)] over c candidates. alpha = 2 / 1.5: Newton from the
left in score units (T = t beta) until the support is stable, with the
closed form tried on each support; other alpha: safeguarded Halley on t
(FORM 0), on t in float64 (FORM 2, alpha > 2), or Newton on log S0 in r =
t + 1 (FORM 1, alpha < 1.5, through log1p). The sums of a step come from
registers when a head's lists fit one tile, else from memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import entmax_pows, log1p_f32, pdl_start, to_f64


@triton.jit
def _terms(b_x, tau, mshift, am1, beta, am1_lo, BETA_KIND: tl.constexpr, ORDER: tl.constexpr,
           FORM: tl.constexpr):
    """Per-candidate terms of the solver's sums; b_x holds scores (-inf:
    padding, adds nothing), mshift the row max m, y = b_x - m <= 0.

    ORDER 0 (FORM 0, BETA_KIND 1/2; tau = T in score units): (1, y, y^2, y,
    -inf) for y > T and (0, 0, 0, +inf, y) otherwise: summed / min / max they
    give the count, the moments, the smallest y above T and the largest y at
    or below it, for the closed forms. ORDER 2: (u^beta, u^(beta-1),
    u^(beta-2)) with u = [(alpha-1) y - t]_+ (FORM 0, tau = t; FORM 2 the
    same in float64, tau = t float64), or u = 1 + (alpha-1) y - r (FORM 1,
    tau = r = t + 1, through log1p), for f, f', f'' (the last two entries
    unused)."""
    if FORM == 2:
        a64 = to_f64(am1) + to_f64(am1_lo)
        b_u = a64 * (b_x.to(tl.float64) - mshift.to(tl.float64)) - tau
        on = b_u > 0
        us = tl.where(on, b_u, 1.0)
        lu = tl.log(us)
        t0 = tl.where(on, tl.exp(lu / a64), 0.0)
        t1 = tl.where(on, t0 / us, 0.0)
        t2 = tl.where(on, t1 / us, 0.0)
        t3 = t2
        t4 = t2
    elif FORM == 1:
        w = am1 * (b_x - mshift) - tau
        on = w > -1.0
        ws = tl.where(on, w, 0.0)
        t0 = tl.where(on, tl.exp(beta * log1p_f32(ws)), 0.0)
        u1 = 1.0 + ws
        t1 = tl.where(on, t0 / u1, 0.0)
        t2 = tl.where(on, t1 / u1, 0.0)
        t3 = t2
        t4 = t2
    elif ORDER == 0:
        y = b_x - mshift
        on = y > tau
        d = tl.where(on, y, 0.0)
        t0 = on.to(tl.float32)
        t1 = d
        t2 = d * d
        t3 = tl.where(on, y, float("inf"))
        t4 = tl.where(on, float("-inf"), y)
    else:
        b_u = am1 * (b_x - mshift) - tau
        on = b_u > 0
        b_u = tl.where(on, b_u, 0.0)
        t0, t1 = entmax_pows(b_u, beta, BETA_KIND)
        t2 = tl.where(on, t1 / tl.where(on, b_u, 1.0), 0.0)
        t3 = t2
        t4 = t2
    return t0, t1, t2, t3, t4


@triton.jit
def _sum3_min_max(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, tl.minimum(a3, b3), tl.maximum(a4, b4)


@triton.jit
def _sum3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _reduce_terms(t0, t1, t2, t3, t4, AXIS: tl.constexpr, ORDER: tl.constexpr, FUSED: tl.constexpr):
    """The solver's reductions of _terms along AXIS: sums of t0..t2 and (ORDER
    0) the min of t3 and max of t4 (ORDER 2: t2 again in their place). FUSED:
    one multi-operand reduction (one cross-warp exchange for all, not one
    each: the solve is a chain of such rounds)."""
    if ORDER == 0:
        if FUSED:
            r0, r1, r2, r3, r4 = tl.reduce((t0, t1, t2, t3, t4), AXIS, _sum3_min_max)
        else:
            r0 = tl.sum(t0, axis=AXIS)
            r1 = tl.sum(t1, axis=AXIS)
            r2 = tl.sum(t2, axis=AXIS)
            r3 = tl.min(t3, axis=AXIS)
            r4 = tl.max(t4, axis=AXIS)
    else:
        if FUSED:
            r0, r1, r2 = tl.reduce((t0, t1, t2), AXIS, _sum3)
        else:
            r0 = tl.sum(t0, axis=AXIS)
            r1 = tl.sum(t1, axis=AXIS)
            r2 = tl.sum(t2, axis=AXIS)
        r3 = r2
        r4 = r2
    return r0, r1, r2, r3, r4


@triton.jit
def _cand_sums(p_x, n_s, max_n, tau, mshift, am1, beta, am1_lo, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, ORDER: tl.constexpr, FUSED: tl.constexpr, FORM: tl.constexpr):
    """Sums of _terms over the candidates of one head in memory: NSPLIT lists
    of CAP entries at p_x, n_s [NS_P2] entries in use (max_n = their max);
    float64 sums for FORM 2."""
    o_s = tl.arange(0, NS_P2)
    if FORM == 2:
        a0 = tl.zeros([NS_P2, BLOCK_K], tl.float64)
        a1 = tl.zeros([NS_P2, BLOCK_K], tl.float64)
        a2 = tl.zeros([NS_P2, BLOCK_K], tl.float64)
    else:
        a0 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
        a1 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
        a2 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a3 = tl.full([NS_P2, BLOCK_K], float("inf"), tl.float32)
    a4 = tl.full([NS_P2, BLOCK_K], float("-inf"), tl.float32)
    for k0 in range(0, max_n, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k[None, :] < n_s[:, None]
        b_x = tl.load(p_x + (o_s.to(tl.int64) * CAP)[:, None] + o_k[None, :], mask=m_k, other=float("-inf"))
        t0, t1, t2, t3, t4 = _terms(b_x, tau, mshift, am1, beta, am1_lo, BETA_KIND, ORDER, FORM)
        a0 += t0
        a1 += t1
        a2 += t2
        if ORDER == 0:  # (the extrema are unused for ORDER 2)
            a3 = tl.minimum(a3, t3)
            a4 = tl.maximum(a4, t4)
    if ORDER == 0:
        r0, r1, r2, r3, r4 = _reduce_terms(a0, a1, a2, a3, a4, 1, ORDER, FUSED)
    else:
        r0, r1, r2, r3, r4 = _reduce_terms(a0, a1, a2, a2, a2, 1, ORDER, FUSED)
    return _reduce_terms(r0, r1, r2, r3, r4, 0, ORDER, FUSED)


@triton.jit
def _sums(p_x, n_s, max_n, b_xr, tau, mshift, am1, beta, am1_lo, CAP,
          NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
          BETA_KIND: tl.constexpr, ORDER: tl.constexpr, IN_REGS: tl.constexpr, FUSED: tl.constexpr,
          FORM: tl.constexpr):
    """The solver's sums over a head's candidates: from memory (_cand_sums) or,
    IN_REGS, over b_xr (1-D, padding -inf) held in registers.

    ORDER 0: (count, sum y, sum y^2, min y, max y <= T) over y = x - m > T;
    ORDER 2: (S0, S1, S2, -, -), the sums of _terms (f = S0 - 1, f' =
    -beta S1, f'' = beta (beta - 1) S2 in the solve's variable)."""
    if IN_REGS:
        t0, t1, t2, t3, t4 = _terms(b_xr, tau, mshift, am1, beta, am1_lo, BETA_KIND, ORDER, FORM)
        r0, r1, r2, r3, r4 = _reduce_terms(t0, t1, t2, t3, t4, 0, ORDER, FUSED)
    else:
        r0, r1, r2, r3, r4 = _cand_sums(p_x, n_s, max_n, tau, mshift, am1, beta, am1_lo, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, ORDER, FUSED, FORM)
    return r0, r1, r2, r3, r4


@triton.jit
def _log_newton(s0, s1, beta):
    """The Newton step on log S0 (FORM 1): log(S0) S0 / (beta S1), S0, S1 > 0."""
    ok = (s0 > 0) & (s1 > 0)
    s0s = tl.where(ok, s0, 1.0)
    return tl.log(s0s) * s0s / (beta * tl.where(ok, s1, 1.0))


@triton.jit
def _solve_tau(p_x, n_s, max_n, b_xr, lb, m, total, t_init, alpha, beta, am1, am1_lo, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
               HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr,
               IN_REGS: tl.constexpr, FUSED: tl.constexpr, FORM: tl.constexpr):
    """Exact threshold of one query head over its ``total`` candidates (score
    lists in memory, or b_xr in registers: see _sums), every other kept score
    being <= lb; m: their largest score; t_init: the warm start (HAS_INIT, in
    tau's units). Returns (m, thr, tau): the row max (0 for an empty row),
    the shifted threshold shifted_prob takes (entmax_form), and tau =
    (alpha-1) m + t in float32, the unshifted threshold callers get (+inf
    when there is no candidate)."""
    empty = total == 0
    m = tl.where(empty, 0.0, m)
    c = tl.maximum(total, 1).to(tl.float32)
    # lb - m, less the split's rounding: lb is a float32 score (m - beta
    # rounds to m once |m| >> beta) and a float32 Newton step, so it can sit
    # an ulp or so above the true bound; the solve starts from the left of
    # the root only with this margin
    lbm = tl.where(empty, 0.0, (lb - m) - (tl.abs(lb) + beta) * 4.76837158203125e-07)

    if BETA_KIND != 0:
        # In score units relative to m: T in [max(lb - m, -beta), -beta c^(1-alpha)]
        # (f(T) = sum ((alpha-1)[y - T]_+)^beta - 1; T = t beta).
        # beta is 1 or 2 here: literals, not the runtime argument, so that
        # f's constant is not one more register live through the loop
        if BETA_KIND == 2:
            bb = 2.0
            one = 4.0  # f = 0 <=> sum [y - T]_+^beta = beta^beta
        else:
            bb = 1.0
            one = 1.0
        lo = tl.maximum(lbm, -bb)
        hi = -bb * tl.exp2((1.0 - alpha) * tl.log2(c))
        lo = tl.minimum(lo, hi)
        # Newton from the left (monotone for convex f); on each support try the
        # closed form, which is exact once the support is the final one.
        tau = lo
        it = tl.full([], 0, tl.int32)
        go = tl.full([], 1, tl.int32)
        while (go != 0) & (it < NEWTON_CAP):
            k, s1, s2, mn, mx_off = _sums(p_x, n_s, max_n, b_xr, tau, m, am1, beta, am1_lo, CAP, NS_P2, BLOCK_K,
                                          BETA_KIND, 0, IN_REGS, FUSED, FORM)
            kk = tl.maximum(k, 1.0)
            dt = tau
            # (tau >= lo, so a closed form rounding below lo is taken as lo)
            if BETA_KIND == 1:
                tc = tl.maximum((s1 - one) / kk, lo)
                t_next = tc
            else:
                disc = s1 * s1 - kk * (s2 - one)
                tc = (s1 - tl.sqrt(tl.maximum(disc, 0.0))) / kk
                tc = tl.where(disc >= 0, tl.maximum(tc, lo), float("-inf"))
                # f = sum (y - T)^2 - beta^2, f' = -2 sum (y - T) on the support
                f = s2 - 2.0 * dt * s1 + kk * dt * dt - one
                fp = 2.0 * (s1 - kk * dt)
                t_next = tau + f / tl.where(fp > 0, fp, 1.0)
            # exact iff the support of tc is the support it was computed on:
            # every counted y above tc, every other y at or below it (also
            # when rounding puts tc a hair below tau)
            exact = (mn > tc) & (mx_off <= tc) & (k > 0) & (tc > float("-inf"))
            tau = tl.where(exact, tc, tl.maximum(t_next, tau))
            go = tl.where(exact | (k == 0), 0, 1)
            it += 1
        thr = tau
        t_out = am1 * tau
    else:
        if FORM == 2:  # t in float64: [max((alpha-1)(lb - m), -1), -c^(1-alpha)]
            a64 = to_f64(am1) + to_f64(am1_lo)
            b64 = 1.0 / a64
            lo = tl.maximum(a64 * lbm, -1.0)
            hi = -tl.exp(-a64 * tl.log(c.to(tl.float64)))
            lo = tl.minimum(lo, hi)
            start = lo
            if HAS_INIT:
                t0 = (t_init - am1 * m).to(tl.float64)
                start = tl.where(t0 == t0, tl.minimum(tl.maximum(t0, lo), hi), lo)  # NaN -> lo
        elif FORM == 1:  # r = t + 1 in [0, 1 - c^(1-alpha)] <= [0, min(1, (alpha-1) log c)]
            b64 = beta
            lo = tl.zeros([], tl.float32)
            hi = tl.minimum(am1 * tl.log(c), 1.0)
            start = lo
        else:  # t in [max((alpha-1)(lb - m), -1), -c^(1-alpha)]
            b64 = beta
            lo = tl.maximum(am1 * lbm, -1.0)
            hi = -tl.exp2((1.0 - alpha) * tl.log2(c))
            lo = tl.minimum(lo, hi)
            start = lo
            if HAS_INIT:
                t0 = t_init - am1 * m
                start = tl.where(t0 == t0, tl.minimum(tl.maximum(t0, lo), hi), lo)  # NaN -> lo
        tau = start
        # the last two steps' sizes: a step that does not shrink below half the
        # one before the last becomes a bisection (Numerical Recipes' rtsafe
        # rule). Near a token that barely enters the support f has an infinite
        # slope for alpha > 2, and Halley can cycle between the two sides of
        # the root inside the bracket without narrowing it.
        dx = hi - lo
        dx_old = dx
        for _ in range(HALLEY):
            s0, s1, s2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, am1, beta, am1_lo, CAP, NS_P2, BLOCK_K,
                                         BETA_KIND, 2, IN_REGS, FUSED, FORM)
            f = s0 - 1.0
            above = f > 0
            lo = tl.where(above, tau, lo)
            hi = tl.where(above, hi, tau)
            if FORM == 1:
                # Newton on log S0, which is nearly linear in r near alpha = 1
                # (exactly, for softmax), where f is exponential and Halley
                # from the left crawls
                cand = tau + _log_newton(s0, s1, b64)
                ok = (s0 > 0) & (s1 > 0)
            else:
                d1 = -b64 * s1
                d2 = b64 * (b64 - 1.0) * s2
                d1s = tl.where(d1 != 0, d1, -1.0)
                newton = -f / d1s
                L = f * d2 / (d1s * d1s)
                L = tl.where(L == L, L, 0.0)
                L = tl.minimum(tl.maximum(L, -1.0), 1.0)
                cand = tau + newton / (1.0 - 0.5 * L)
                ok = d1 != 0
            ok = ok & (cand >= lo) & (cand <= hi) & (tl.abs(cand - tau) <= 0.5 * dx_old)
            nxt = tl.where(ok, cand, 0.5 * (lo + hi))
            dx_old = dx
            dx = tl.abs(nxt - tau)
            tau = nxt
        for _ in range(POLISH):
            s0, s1, s2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, am1, beta, am1_lo, CAP, NS_P2, BLOCK_K,
                                         BETA_KIND, 2, IN_REGS, FUSED, FORM)
            if FORM == 1:
                step = tl.where((s0 > 0) & (s1 > 0), _log_newton(s0, s1, b64), 0.0)
            else:
                step = tl.where(s1 != 0, (s0 - 1.0) / (b64 * tl.where(s1 != 0, s1, 1.0)), 0.0)
            tau = tl.minimum(tl.maximum(tau + step, lo), hi)
        thr = tau
        if FORM == 1:
            t_out = (tau - 1.0).to(tl.float32)
        else:
            t_out = tau.to(tl.float32)
    tau_out = tl.where(empty, float("inf"), am1 * m + t_out)
    return m, thr, tau_out


@triton.jit
def _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s, NSPLIT: tl.constexpr, HAS_INIT: tl.constexpr):
    """What the splits of query-head row i_r left for the solve: (lb, m, the
    list lengths n_s [NS_P2], their max and sum, the warm start or 0)."""
    m_s = o_s < NSPLIT
    lb = tl.max(tl.load(clb_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf")), axis=0)
    m = tl.max(tl.load(cm_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf")), axis=0)
    n_s = tl.load(cn_ptr + i_r * NSPLIT + o_s, mask=m_s, other=0)
    if HAS_INIT:
        t_init = tl.load(tinit_ptr + i_r)
    else:
        t_init = 0.0
    return lb, m, n_s, tl.max(n_s, axis=0), tl.sum(n_s, axis=0), t_init


@triton.jit
def _attn_solve_kernel(
    cx_ptr, cn_ptr, clb_ptr, cm_ptr, tinit_ptr, tau_ptr, th_ptr,
    alpha, beta, am1, am1_lo, CAP,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
    BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
    HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr, IN_REGS: tl.constexpr,
    FUSED: tl.constexpr, FORM: tl.constexpr, PDL: tl.constexpr,
):
    """Exact tau of one query head over the candidate lists of its splits
    (from registers when they fit one tile, else from memory); also (m, the
    shifted threshold) at th[row] (float64 for FORM 2) for _attn_vacc_kernel."""
    pdl_start(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, NS_P2)
    lb, m, n_s, max_n, total, t_init = _row_lists(cn_ptr, clb_ptr, cm_ptr, tinit_ptr, i_r, o_s,
                                                  NSPLIT, HAS_INIT)
    p_x = cx_ptr + i_r * NSPLIT * CAP
    if IN_REGS and max_n <= BLOCK_K:
        # every list fits one [NS_P2, BLOCK_K] tile (short selections): load it
        # once and iterate in registers, not one round trip to L2 per step
        o_k = tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + (o_s.to(tl.int64) * CAP)[:, None] + o_k[None, :],
                      mask=o_k[None, :] < n_s[:, None], other=float("-inf"))
        m, thr, tau = _solve_tau(p_x, n_s, max_n, tl.reshape(b_x, [NS_P2 * BLOCK_K]), lb, m, total,
                                 t_init, alpha, beta, am1, am1_lo, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                                 HALLEY, POLISH, NEWTON_CAP, True, FUSED, FORM)
    else:
        m, thr, tau = _solve_tau(p_x, n_s, max_n, lb, lb, m, total,
                                 t_init, alpha, beta, am1, am1_lo, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                                 HALLEY, POLISH, NEWTON_CAP, False, FUSED, FORM)
    tl.store(tau_ptr + i_r, tau)
    tl.store(th_ptr + 2 * i_r, m.to(th_ptr.dtype.element_ty))
    tl.store(th_ptr + 2 * i_r + 1, thr.to(th_ptr.dtype.element_ty))
