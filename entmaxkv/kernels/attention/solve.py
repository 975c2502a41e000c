"""Pass 2 of entmax attention: the exact tau of each query head over its
candidate lists (``_attn_solve_kernel``), and the solver it shares with the
one-launch finish (finish.py).

alpha = 2 / 1.5: Newton from the left of the bracket [max(lb, m - 1),
m - c^(1-alpha)] until the support is stable, with the closed form tried on
each support; other alpha: safeguarded Halley, as the reference. The sums of
a step come from registers when a head's lists fit one tile, else from
memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import entmax_pows, pdl_start


@triton.jit
def _terms(b_x, tau, mshift, beta, BETA_KIND: tl.constexpr, ORDER: tl.constexpr):
    """Per-candidate terms of the solver's sums (x = -inf: padding, adds nothing).

    ORDER 0: (1, x - mshift, (x - mshift)^2, x, -inf) for x > tau and
    (0, 0, 0, +inf, x) otherwise: summed / min / max they give the count, the
    shifted moments, the smallest x above tau and the largest x at or below
    it, for the closed forms. ORDER 2: (u^beta, u^(beta-1), u^(beta-2)) with
    u = [x - tau]_+, for f, f', f'' (the last two entries unused)."""
    on = b_x > tau
    if ORDER == 0:
        d = tl.where(on, b_x - mshift, 0.0)
        t0 = on.to(tl.float32)
        t1 = d
        t2 = d * d
        t3 = tl.where(on, b_x, float("inf"))
        t4 = tl.where(on, float("-inf"), b_x)
    else:
        b_u = tl.where(on, b_x - tau, 0.0)
        t0, t1 = entmax_pows(b_u, beta, BETA_KIND)
        t2 = tl.where(on, t1 / tl.where(on, b_u, 1.0), 0.0)
        t3 = b_x
        t4 = b_x
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
def _cand_sums(p_x, n_s, max_n, tau, mshift, beta, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, ORDER: tl.constexpr, FUSED: tl.constexpr):
    """Sums of _terms over the candidates of one head in memory: NSPLIT lists
    of CAP entries at p_x, n_s [NS_P2] entries in use (max_n = their max)."""
    o_s = tl.arange(0, NS_P2)
    a0 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a1 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a2 = tl.zeros([NS_P2, BLOCK_K], tl.float32)
    a3 = tl.full([NS_P2, BLOCK_K], float("inf"), tl.float32)
    a4 = tl.full([NS_P2, BLOCK_K], float("-inf"), tl.float32)
    for k0 in range(0, max_n, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k[None, :] < n_s[:, None]
        b_x = tl.load(p_x + (o_s.to(tl.int64) * CAP)[:, None] + o_k[None, :], mask=m_k, other=float("-inf"))
        t0, t1, t2, t3, t4 = _terms(b_x, tau, mshift, beta, BETA_KIND, ORDER)
        a0 += t0
        a1 += t1
        a2 += t2
        if ORDER == 0:  # (the extrema are unused for ORDER 2)
            a3 = tl.minimum(a3, t3)
            a4 = tl.maximum(a4, t4)
    r0, r1, r2, r3, r4 = _reduce_terms(a0, a1, a2, a3, a4, 1, ORDER, FUSED)
    return _reduce_terms(r0, r1, r2, r3, r4, 0, ORDER, FUSED)


@triton.jit
def _sums(p_x, n_s, max_n, b_xr, tau, mshift, beta, CAP,
          NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
          BETA_KIND: tl.constexpr, ORDER: tl.constexpr, IN_REGS: tl.constexpr, FUSED: tl.constexpr):
    """The solver's sums over a head's candidates: from memory (_cand_sums) or,
    IN_REGS, over b_xr (1-D, padding -inf) held in registers.

    ORDER 0: (count, sum(x - mshift), sum((x - mshift)^2), min x, max x <= tau)
    over x > tau; ORDER 2: (f, f', f'', -, -) of f = sum [x - tau]_+^beta - 1."""
    if IN_REGS:
        t0, t1, t2, t3, t4 = _terms(b_xr, tau, mshift, beta, BETA_KIND, ORDER)
        r0, r1, r2, r3, r4 = _reduce_terms(t0, t1, t2, t3, t4, 0, ORDER, FUSED)
    else:
        r0, r1, r2, r3, r4 = _cand_sums(p_x, n_s, max_n, tau, mshift, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, ORDER, FUSED)
    if ORDER == 2:
        r0 = r0 - 1.0  # f
        r1 = -beta * r1  # f'
        r2 = beta * (beta - 1.0) * r2  # f''
    return r0, r1, r2, r3, r4


@triton.jit
def _solve_tau(p_x, n_s, max_n, b_xr, lb, m, total, t_init, alpha, beta, CAP,
               NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
               BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
               HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr,
               IN_REGS: tl.constexpr, FUSED: tl.constexpr):
    """Exact tau of one query head over its ``total`` candidates (lists in
    memory, or b_xr in registers: see _sums), every other kept x being
    <= lb <= tau; m: their largest x; t_init: the warm start (HAS_INIT).
    +inf when there is no candidate."""
    empty = total == 0
    m = tl.where(empty, 0.0, m)

    # Bracket [lo, hi]: f(m - 1) >= 0 and, over c candidates, f(m - c^(1-alpha)) <= 0.
    c = tl.maximum(total, 1).to(tl.float32)
    lo = tl.maximum(tl.where(empty, -1.0, lb), m - 1.0)
    hi = m - tl.exp2((1.0 - alpha) * tl.log2(c))
    lo = tl.minimum(lo, hi)

    if BETA_KIND != 0:
        # Newton from the left (monotone for convex f); on each support try the
        # closed form, which is exact once the support is the final one.
        tau = lo
        it = tl.full([], 0, tl.int32)
        go = tl.full([], 1, tl.int32)
        while (go != 0) & (it < NEWTON_CAP):
            k, s1, s2, mn, mx_off = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                          BETA_KIND, 0, IN_REGS, FUSED)
            kk = tl.maximum(k, 1.0)
            dt = tau - m
            # (tau >= lo, so a closed form rounding below lo is taken as lo)
            if BETA_KIND == 1:
                tc = tl.maximum(m + (s1 - 1.0) / kk, lo)
                t_next = tc
            else:
                disc = s1 * s1 - kk * (s2 - 1.0)
                tc = m + (s1 - tl.sqrt(tl.maximum(disc, 0.0))) / kk
                tc = tl.where(disc >= 0, tl.maximum(tc, lo), float("-inf"))
                # f = sum (d - dt)^2 - 1, f' = -2 sum (d - dt), d = x - m on the support
                f = s2 - 2.0 * dt * s1 + kk * dt * dt - 1.0
                fp = 2.0 * (s1 - kk * dt)
                t_next = tau + f / tl.where(fp > 0, fp, 1.0)
            # exact iff the support of tc is the support it was computed on:
            # every counted x above tc, every other x at or below it (also
            # when rounding puts tc a hair below tau)
            exact = (mn > tc) & (mx_off <= tc) & (k > 0) & (tc > float("-inf"))
            tau = tl.where(exact, tc, tl.maximum(t_next, tau))
            go = tl.where(exact | (k == 0), 0, 1)
            it += 1
    else:
        if HAS_INIT:
            t0 = tl.where(t_init == t_init, t_init, lo)  # NaN -> lo
            tau = tl.minimum(tl.maximum(t0, lo), hi)
        else:
            tau = lo
        for _ in range(HALLEY):
            f, d1, d2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, 2, IN_REGS, FUSED)
            above = f > 0
            lo = tl.where(above, tau, lo)
            hi = tl.where(above, hi, tau)
            d1s = tl.where(d1 != 0, d1, -1.0)
            newton = -f / d1s
            L = f * d2 / (d1s * d1s)
            L = tl.where(L == L, L, 0.0)
            L = tl.minimum(tl.maximum(L, -1.0), 1.0)
            cand = tau + newton / (1.0 - 0.5 * L)
            ok = (cand >= lo) & (cand <= hi) & (d1 != 0)
            tau = tl.where(ok, cand, 0.5 * (lo + hi))
        for _ in range(POLISH):
            f, d1, d2, _mn, _mx = _sums(p_x, n_s, max_n, b_xr, tau, m, beta, CAP, NS_P2, BLOCK_K,
                                        BETA_KIND, 2, IN_REGS, FUSED)
            step = tl.where(d1 != 0, -f / tl.where(d1 != 0, d1, 1.0), 0.0)
            tau = tl.minimum(tl.maximum(tau + step, lo), hi)
    return tl.where(empty, float("inf"), tau)


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
    cx_ptr, cn_ptr, clb_ptr, cm_ptr, tinit_ptr, tau_ptr,
    alpha, beta, CAP,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
    BETA_KIND: tl.constexpr, HAS_INIT: tl.constexpr,
    HALLEY: tl.constexpr, POLISH: tl.constexpr, NEWTON_CAP: tl.constexpr, IN_REGS: tl.constexpr,
    FUSED: tl.constexpr, PDL: tl.constexpr,
):
    """Exact tau of one query head over the candidate lists of its splits
    (from registers when they fit one tile, else from memory)."""
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
        tau = _solve_tau(p_x, n_s, max_n, tl.reshape(b_x, [NS_P2 * BLOCK_K]), lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, True, FUSED)
    else:
        tau = _solve_tau(p_x, n_s, max_n, lb, lb, m, total,
                         t_init, alpha, beta, CAP, NS_P2, BLOCK_K, BETA_KIND, HAS_INIT,
                         HALLEY, POLISH, NEWTON_CAP, False, FUSED)
    tl.store(tau_ptr + i_r, tau)
