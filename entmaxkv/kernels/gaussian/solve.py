"""Passes 3-4 of the Gaussian selection: the Halley launches of the page-mixture
solve (``_gauss_iter_kernel``) and the threshold test that keeps the pages
(``_gauss_select_kernel``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import ATOMIC_SEM, pdl_start
from .moments import _gauss_terms, _halley_update


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
def _gauss_iter_kernel(
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
    if FIRST:  # state 0 (_gauss_start_kernel): F at tau_0 (and, with TWO, at the pooled start)
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
def _gauss_select_kernel(
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
        if NIT == 0:  # pooled: _gauss_start_kernel solved it
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
