"""Fused causal attention for prefill, softmax and alpha-entmax, flash style.

Shapes: q [B, H, Tq, D], k and v [B, KV, Tk, D], query i at position
p = Tk - Tq + i (the last Tq of the Tk keys: a prompt, or a chunk of one
after cached context), seeing keys 0..p. Query head h reads KV head
h // (H // KV). Scores s_j = scale * q.k_j + slope_h * (j - p)
(docs/spec.md §2). Nothing of size Tq x Tk is ever stored: each program
holds one [BLOCK_M, BLOCK_N] score tile in registers at a time.

Every kernel works in "z units", the scores times a per-kernel constant
folded into the dot-product scale and the slope: log2(e) for softmax (so
exp2 applies directly), alpha - 1 for entmax (so z - max z is the shifted
x = (alpha-1)(s - m) of docs/spec.md §1, and p = [x - t]_+^beta).

Launch grid (both attention kernels): one program per (batch, head, block
of BLOCK_M queries), in one dimension, the last query blocks (the longest
rows) of every head first so that the heavy programs start first. The key
blocks a program reads are split into the *diagonal* ones (some key is
past some row's position: masked) and the *full* ones before them (no
mask). The diagonal blocks are read first: they hold every row's
own key, so after them each row has a finite running maximum, which the
ALiBi skip below needs.

ALiBi skip (SKIP): with slope > 0 the bias falls by slope per position, and
s_j <= scale |q| max_j |k_j| + slope (j - p). A key block all of whose keys
have that bound below a row's cut-off for every row of the program holds
no weight for any of them, and neither does any block before it, so the
full-block loop starts at the first block that may matter
(``_first_block``): an exact saving for entmax (the cut-off is at or below
the threshold tau, so every skipped key has p = 0) and, for softmax, a
saving whose skipped weights are each below exp(-drop) times the row's
largest one. max_j |k_j| per (batch, KV head) comes from
``_prefill_key_norm_kernel``.

_prefill_softmax_kernel: the online softmax (running max, sum and
accumulator, rescaled by exp2 of the max's change).

_prefill_entmax_kernel: alpha-entmax needs each row's threshold before the
output, so one program makes several passes over its keys:

1. The max pass (QK only) keeps, for each row and each column of the key
   tile, the largest score seen in that column ("slot tops"). Their max is
   the row max m; being BLOCK_N distinct keys, the threshold over them is a
   lower bound on the row's threshold (a subset's threshold is smaller,
   docs/spec.md §1), and when the support is a few dozen keys it is often
   the threshold itself.
2. The seed: that subset threshold, solved in registers (no key pass):
   Newton steps whose every point with subset mass >= 1 is a valid lower
   bound ``lo`` on the row's threshold.
3. Solve passes. Each streams the keys once and sums, at the current
   threshold t, the mass S0 = sum u^beta, S1 = sum u^(beta-1) and
   S2 = sum u^(beta-2) (u = [x - t]_+). A tile with no u > 0 for any
   unfinished row is skipped after its QK. After the pass each row either
   finishes with its final threshold or takes a step:

   * alpha = 1.5 (beta = 2) and alpha = 2 (beta = 1): on a fixed support
     the mass is a polynomial in the threshold, so the closed-form root
     t + d on the support {u > 0} is the exact threshold when no entry
     changes side between t and t + d (checked with the smallest u on the
     support and the largest gap off it): the row finishes there.
     Otherwise the next point is the midpoint of the bracket refined by the
     Newton point (a lower bound, the mass being convex) and, for beta = 2
     from the left, the closed form (an upper bound: entries that left the
     support still count there); for beta = 1 the Newton point itself (it
     is the closed form).
   * other alpha: a row finishes once |S0 - 1| <= tol (or its bracket is
     at float32 resolution), at t plus a Newton step. Steps: Halley,
     safeguarded by the bracket and by the rule that a step must halve
     every two passes (bisection otherwise: near an entry joining the
     support the mass has a vertical tangent for alpha > 2); near softmax
     (alpha < 1.5) Newton on log S0 in r = t + 1, with
     p = exp(beta log1p(x - r)) (FORM 1: t = -1 + O(alpha-1) would keep no
     digit of r in float32).

   A program stops when all its rows have finished, or after MAX_ITERS
   passes (the rows left then take their current point).
4. The output pass: sum_j p_j v_j / sum_j p_j at the final thresholds (the
   division absorbs the rounding of the mass), tiles without support
   skipped. The output error is that of the threshold: none for alpha =
   1.5 and 2 beyond rounding, |p(t)/S0 - p*|_1 <= 2 |S0(t) - 1| otherwise.

FUSED (PrefillConfig.fuse_output) folds the output into the solve passes:
each also accumulates a0 = sum u^beta v, a1 = sum u^(beta-1) v and, for
beta = 2, a2 = sum_{u>0} v, and the pass that finishes a row writes its
output at t + d from them, exactly for beta = 1, 2 ((u - d)^2 =
u^2 - 2du + d^2; u - d) and to first order otherwise (a0 - beta d a1, whose
error is at most the mass error again). One key pass fewer, two or three
PV products per solve pass and more registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import log1p_f32
from ..attention.split import _qk


@triton.jit
def _prefill_key_norm_kernel(k_ptr, out_ptr, Tk, NBLK, KV, stride_kb, stride_kh, stride_kt,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """max_j ||k_j|| (float32) over one block of BLOCK_T keys of one (batch,
    KV head), at out[b * KV + h, block]; the launcher reduces the blocks."""
    i_bh = tl.program_id(0)
    i_t = tl.program_id(1)
    b = i_bh // KV
    h = i_bh % KV
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    p_k = (k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
           + o_t.to(tl.int64)[:, None] * stride_kt + o_d[None, :])
    b_k = tl.load(p_k, mask=(o_t[:, None] < Tk) & (o_d[None, :] < D), other=0.0).to(tl.float32)
    nrm = tl.sqrt(tl.sum(b_k * b_k, axis=1))
    tl.store(out_ptr + i_bh.to(tl.int64) * NBLK + i_t, tl.max(nrm, axis=0))


# ---------------------------------------------------------------------------
# shared pieces: program set-up, tiles, the ALiBi skip
# ---------------------------------------------------------------------------


@triton.jit
def _program(q_ptr, Tq, Tk, H, G, stride_qb, stride_qh, stride_qt,
             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (batch, head, KV head, first query row, row validity
    [BLOCK_M], row positions [BLOCK_M] int32, query tile [BLOCK_M, BLOCK_D],
    first diagonal key block, end of the key blocks, its index
    batch * H + head, its query block). The grid is one-dimensional:
    (query blocks) x (B * H) programs, the last query block of every head
    first.

    Padding rows (past Tq) load zeros and take the last query's position, so
    they see only real keys and stay finite; callers never store them and
    leave them out of every program-wide decision."""
    nm = tl.cdiv(Tq, BLOCK_M)
    pid = tl.program_id(0)
    n_bh = tl.num_programs(0) // nm
    i_bh = pid % n_bh
    i_m = nm - 1 - pid // n_bh  # the longest rows first, for every head
    b = i_bh // H
    h = i_bh % H
    kvh = h // G
    m0 = i_m * BLOCK_M
    o_m = m0 + tl.arange(0, BLOCK_M)
    valid = o_m < Tq
    pos = (Tk - Tq) + tl.minimum(o_m, Tq - 1)
    o_d = tl.arange(0, BLOCK_D)
    p_q = (q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
           + o_m.to(tl.int64)[:, None] * stride_qt + o_d[None, :])
    b_q = tl.load(p_q, mask=valid[:, None] & (o_d[None, :] < D), other=0.0)
    p_first = Tk - Tq + m0
    p_last = Tk - Tq + tl.minimum(m0 + BLOCK_M, Tq) - 1
    return b, h, kvh, m0, valid, pos, b_q, p_first // BLOCK_N, p_last // BLOCK_N + 1, i_bh, i_m


@triton.jit
def _load_rows(base, j0, o_n, o_d, Tk, stride_t, MASKED: tl.constexpr, D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows j0 + o_n of a [Tk, D] matrix at ``base`` ([BLOCK_N, BLOCK_D],
    zeros past Tk or D). Full blocks lie below Tk: no row mask."""
    p = base + tl.cast(j0, tl.int64) * stride_t + o_n[:, None] * stride_t + o_d[None, :]
    if MASKED:
        if BLOCK_D == D:
            x = tl.load(p, mask=(j0 + o_n)[:, None] < Tk, other=0.0)
        else:
            x = tl.load(p, mask=((j0 + o_n)[:, None] < Tk) & (o_d[None, :] < D), other=0.0)
    else:
        if BLOCK_D == D:
            x = tl.load(p)
        else:
            x = tl.load(p, mask=o_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _scores(b_q, k_base, j0, o_n, o_d, pos, cz, slz, colb, shift, Tk, stride_kt,
            MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """Scores in z units less a per-row shift, [BLOCK_M, BLOCK_N] float32, of
    the query tile on keys j0 + o_n: cz q.k + slz (j - pos) - shift, -inf
    past each row's position (MASKED, the diagonal blocks). The bias is
    split into a row part slz (j0 - pos) - shift and a column part
    colb = slz o_n (made once per program): one add and one FMA an entry,
    and no large slz j that would cancel against slz pos."""
    b_k = _load_rows(k_base, j0, o_n, o_d, Tk, stride_kt, MASKED, D, BLOCK_D)
    s = _qk(b_q, b_k, DOT_F32, PREC)
    if HAS_ALIBI:
        rowb = slz * (j0 - pos).to(tl.float32) - shift
        s = s * cz + (rowb[:, None] + colb[None, :])
    else:
        s = s * cz - shift[:, None]
    if MASKED:
        s = tl.where((j0 + o_n)[None, :] <= pos[:, None], s, float("-inf"))
    return s


@triton.jit
def _pv(p, b_v, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """sum_j p[r, j] v[j, :] in float32; p is rounded to V's dtype for the
    tensor cores (the rounding flash attention makes too)."""
    if DOT_F32:
        o = tl.dot(p, b_v.to(tl.float32), input_precision=PREC)
    else:
        o = tl.dot(p.to(b_v.dtype), b_v)
    return o


@triton.jit
def _first_block(cut, pos, valid, qn, kmax, slz, kb_hi, BLOCK_N: tl.constexpr):
    """First full key block that may hold a key above ``cut`` [BLOCK_M] (z
    units) for some valid row, by the ALiBi bound z_j <= qn kmax +
    slz (j - pos) (qn = cz |q_r|); 0 without a positive slope. The margin
    covers the float32 rounding of the scores and of the bound itself."""
    bound = qn * kmax
    marg = 1e-4 * (tl.abs(cut) + 2.0 * bound) + 1e-30
    sl = tl.where(slz > 0, slz, 1.0)
    j_last = pos.to(tl.float32) + (cut - marg - bound) / sl  # keys j <= j_last are below the cut
    j_last = tl.where(valid, j_last, 3.0e38)
    jmin = tl.min(j_last, axis=0)
    jmin = tl.where((jmin == jmin) & (slz > 0), jmin, -1.0)  # NaN (non-finite inputs): no skip
    kb = tl.floor(tl.minimum(jmin, 1.0e9) / BLOCK_N)
    return tl.minimum(tl.maximum(kb, 0.0), kb_hi.to(tl.float32)).to(tl.int32)


# ---------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------


@triton.jit
def _softmax_tile(b_q, k_base, v_base, j0, o_n, o_d, pos, cz, slz, colb, zero, Tk, stride_kt, stride_vt,
                  m_i, l_i, acc, MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One key block of the online softmax (scores in log2 units)."""
    s = _scores(b_q, k_base, j0, o_n, o_d, pos, cz, slz, colb, zero, Tk, stride_kt, MASKED, HAS_ALIBI, D,
                BLOCK_D, DOT_F32, PREC)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no inf - inf
    corr = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * corr + tl.sum(p, axis=1)
    b_v = _load_rows(v_base, j0, o_n, o_d, Tk, stride_vt, MASKED, D, BLOCK_D)
    acc = acc * corr[:, None] + _pv(p, b_v, DOT_F32, PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_softmax_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, slopes_ptr, kmax_ptr,
    cz, sl_unit, drop, Tq, Tk, H, G,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SKIP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    """Causal softmax attention of one (batch, head, query block); writes
    [BLOCK_M, D] of the output in its dtype. cz = scale log2(e), sl_unit =
    log2(e), drop: the ALiBi skip's cut-off below the running max (log2 units)."""
    b, h, kvh, m0, valid, pos, b_q, kb_diag, kb_end, i_bh, i_m = _program(
        q_ptr, Tq, Tk, H, G, stride_qb, stride_qh, stride_qt, D, BLOCK_D, BLOCK_M, BLOCK_N)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    slz = 0.0
    if HAS_ALIBI:
        slz = tl.load(slopes_ptr + h) * sl_unit
    colb = slz * o_n.to(tl.float32)
    zero = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kb in range(kb_diag, kb_end):
        m_i, l_i, acc = _softmax_tile(b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, zero, Tk,
                                      stride_kt, stride_vt, m_i, l_i, acc, True, HAS_ALIBI, D, BLOCK_D,
                                      DOT_F32, PREC)
    kb_lo = 0
    if SKIP:
        bq = b_q.to(tl.float32)
        qn = tl.sqrt(tl.sum(bq * bq, axis=1)) * cz
        kb_lo = _first_block(m_i - drop, pos, valid, qn, tl.load(kmax_ptr + b * (H // G) + kvh), slz, kb_diag,
                             BLOCK_N)
    for kb in range(kb_lo, kb_diag):
        m_i, l_i, acc = _softmax_tile(b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, zero, Tk,
                                      stride_kt, stride_vt, m_i, l_i, acc, False, HAS_ALIBI, D, BLOCK_D,
                                      DOT_F32, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    p_o = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
           + (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * stride_ot + o_d[None, :])
    tl.store(p_o, out.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (o_d[None, :] < D))


# ---------------------------------------------------------------------------
# entmax
# ---------------------------------------------------------------------------


@triton.jit
def _prob(x, t, beta, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """(on, u, p): at threshold t (FORM 0: t; FORM 1: r = t + 1) the support
    on = u > 0, u = [x - t]_+ (FORM 1: 1 + (x - r) on the support) and
    p = u^beta. BETA_KIND 1: beta = 1; 2: beta = 2; 0: any, through
    exp2/log2, or for FORM 1 exp(beta log1p(x - r)), exact near u = 1."""
    if FORM == 1:
        w = x - t
        on = w > -1.0
        ws = tl.where(on, w, 0.0)
        u = 1.0 + ws
        p = tl.where(on, tl.exp(beta * log1p_f32(ws)), 0.0)
    else:
        gap = x - t
        on = gap > 0
        u = tl.where(on, gap, 0.0)
        if BETA_KIND == 2:
            p = u * u
        elif BETA_KIND == 1:
            p = u
        else:
            p = tl.where(on, tl.exp2(beta * tl.log2(tl.where(on, u, 1.0))), 0.0)
    return on, u, p


@triton.jit
def _terms(x, t, beta, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """_prob's (on, p0 = u^beta) with p1 = u^(beta-1), p2 = u^(beta-2) and
    the gap x - t (negative off the support)."""
    on, u, p0 = _prob(x, t, beta, BETA_KIND, FORM)
    if FORM == 1:
        gap = (x - t) + 1.0
    else:
        gap = x - t
    if BETA_KIND == 2:
        p1 = u
        p2 = on.to(tl.float32)
    elif BETA_KIND == 1:
        p1 = on.to(tl.float32)
        p2 = p1
    else:
        ir = 1.0 / tl.where(on, u, 1.0)
        p1 = p0 * ir
        p2 = p1 * ir
    return on, p0, p1, p2, gap


@triton.jit
def _row_sums(x, t, beta, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """Row sums of _terms over a tile [BLOCK_M, BLOCK_N]: (S0, S1, S2, the
    smallest gap on the support, the largest gap off it; the last two for
    BETA_KIND 1/2 only, where the support check uses them)."""
    on, p0, p1, p2, gap = _terms(x, t[:, None], beta, BETA_KIND, FORM)
    c0 = tl.sum(p0, axis=1)
    c1 = tl.sum(p1, axis=1)
    if BETA_KIND == 2:
        c2 = tl.sum(p2, axis=1)
    else:
        c2 = c1
    if BETA_KIND != 0:
        mn = tl.min(tl.where(on, gap, float("inf")), axis=1)
        mxo = tl.max(tl.where(on, float("-inf"), gap), axis=1)
    else:
        mn = c0
        mxo = c0
    return c0, c1, c2, mn, mxo, p0, p1, p2


@triton.jit
def _closed_form(c0, c1, c2, beta, BETA_KIND: tl.constexpr):
    """(d, ok): the step d to the threshold that gives mass 1 on the current
    support {u > 0} (beta = 2: k d^2 - 2 S1 d + S0 - 1 = 0, the smaller root
    written without cancellation; beta = 1: d = (S0 - 1) / k), and whether
    it exists. Unused for BETA_KIND 0."""
    f = c0 - 1.0
    if BETA_KIND == 2:
        disc = c1 * c1 - c2 * f
        ok = (c2 > 0) & (disc >= 0)
        den = c1 + tl.sqrt(tl.maximum(disc, 0.0))
        d = f / tl.where(den > 0, den, 1.0)
    else:
        ok = c1 > 0
        d = f / tl.where(ok, c1, 1.0)
    return d, ok


@triton.jit
def _newton(c0, c1, beta):
    """(d, ok): the Newton step on f = S0 - 1 (f' = -beta S1)."""
    ok = c1 > 0
    return (c0 - 1.0) / (beta * tl.where(ok, c1, 1.0)), ok


@triton.jit
def _seed(xt, lo, hi, beta, ITERS: tl.constexpr, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """(t, lo): a start for the solve passes and a lower bound on the
    threshold, from the slot tops xt [BLOCK_M, BLOCK_N] (x units, -inf
    where empty) in registers.

    Any point where the tops' mass is >= 1 lies left of their threshold,
    which is left of the row's: it raises lo. Steps: the closed form when it
    is exact on the tops (beta = 1, 2), else Newton, kept inside the tops'
    bracket (bisection otherwise; the mass is convex for alpha <= 2, where
    Newton from the left stays left)."""
    t = lo
    hs = hi
    for _ in range(ITERS):
        c0, c1, c2, mn, mxo, _p0, _p1, _p2 = _row_sums(xt, t, beta, BETA_KIND, FORM)
        above = c0 >= 1.0
        lo = tl.where(above, tl.maximum(lo, t), lo)
        hs = tl.where(above, hs, tl.minimum(hs, t))
        dn, okn = _newton(c0, c1, beta)
        cand = t + dn
        if BETA_KIND != 0:
            dc, okc = _closed_form(c0, c1, c2, beta, BETA_KIND)
            exact = okc & (dc < mn) & (mxo <= dc)
            cand = tl.where(exact, t + dc, cand)
            okn = okn | exact
        inside = okn & (cand >= lo) & (cand <= hs)
        t = tl.where(inside, cand, 0.5 * (lo + hs))
    return tl.maximum(t, lo), lo


@triton.jit
def _hit(x, edge, rows):
    """(x's row maxima, whether a row of ``rows`` has an entry above its edge)."""
    xm = tl.max(x, axis=1)
    return xm, tl.max(tl.where(rows & (xm > edge), 1, 0), axis=0) > 0


@triton.jit
def _edge(t, FORM: tl.constexpr):
    """The support's edge in x units: x > t (FORM 1: x > r - 1)."""
    if FORM == 1:
        e = t - 1.0
    else:
        e = t
    return e


@triton.jit
def _solve_tile(b_q, k_base, v_base, j0, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt, stride_vt,
                mz, t, act, beta, c0, c1, c2, mn, mxo, a0, a1, a2,
                MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr, BETA_KIND: tl.constexpr, FORM: tl.constexpr,
                FUSED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
                PREC: tl.constexpr):
    """One key block of a solve pass: the sums at t and, FUSED, the output
    moments. Skipped after the QK when no unfinished row (act) has an entry
    on its support here; the largest gap off the support is still kept."""
    x = _scores(b_q, k_base, j0, o_n, o_d, pos, cz, slz, colb, mz, Tk, stride_kt, MASKED, HAS_ALIBI, D,
                BLOCK_D, DOT_F32, PREC)
    edge = _edge(t, FORM)
    xm, hit = _hit(x, edge, act)
    if hit:
        s0, s1, s2, smn, smx, p0, p1, p2 = _row_sums(x, t, beta, BETA_KIND, FORM)
        c0 += s0
        c1 += s1
        c2 += s2
        mn = tl.minimum(mn, smn)
        mxo = tl.maximum(mxo, smx)
        if FUSED:
            b_v = _load_rows(v_base, j0, o_n, o_d, Tk, stride_vt, MASKED, D, BLOCK_D)
            a0 += _pv(p0, b_v, DOT_F32, PREC)
            a1 += _pv(p1, b_v, DOT_F32, PREC)
            if BETA_KIND == 2:
                a2 += _pv(p2, b_v, DOT_F32, PREC)
    else:
        mxo = tl.maximum(mxo, xm - edge)
    return c0, c1, c2, mn, mxo, a0, a1, a2


@triton.jit
def _out_tile(b_q, k_base, v_base, j0, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt, stride_vt,
              mz, t, rows, beta, mass, acc,
              MASKED: tl.constexpr, HAS_ALIBI: tl.constexpr, BETA_KIND: tl.constexpr, FORM: tl.constexpr,
              D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One key block of the output pass at the final thresholds t: the mass
    and sum_j p_j v_j, skipped when no row has an entry on its support."""
    x = _scores(b_q, k_base, j0, o_n, o_d, pos, cz, slz, colb, mz, Tk, stride_kt, MASKED, HAS_ALIBI, D,
                BLOCK_D, DOT_F32, PREC)
    _xm, hit = _hit(x, _edge(t, FORM), rows)
    if hit:
        _on, _u, p = _prob(x, t[:, None], beta, BETA_KIND, FORM)
        mass += tl.sum(p, axis=1)
        b_v = _load_rows(v_base, j0, o_n, o_d, Tk, stride_vt, MASKED, D, BLOCK_D)
        acc += _pv(p, b_v, DOT_F32, PREC)
    return mass, acc


@triton.jit
def _step(t, lo, hi, st1, st2, c0, c1, c2, mn, mxo, beta, tol,
          BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """After a solve pass at t: (done, d, t_next, lo, hi, st1, st2).
    ``done``: the row's output can be written now, from this pass's moments
    with the step d (see the module docstring); otherwise t_next is the next
    point and [lo, hi] the refined bracket of the threshold. st1, st2: the
    sizes of the last two steps (general alpha: a step not at most half of
    the one two passes back is replaced by bisection, the rule that stops
    Newton and Halley from creeping next to an entry joining the support,
    where alpha > 2 gives the mass a vertical tangent)."""
    f = c0 - 1.0
    left = f > 0
    dn, okn = _newton(c0, c1, beta)
    if BETA_KIND != 0:
        dc, okc = _closed_form(c0, c1, c2, beta, BETA_KIND)
        # t + dc >= lo: the keys the ALiBi skip left out (x <= lo) stay off
        exact = okc & (dc < mn) & (mxo <= dc) & (t + dc >= lo)
    lo = tl.where(left, tl.maximum(lo, t), lo)
    hi = tl.where(left, hi, tl.minimum(hi, t))
    if BETA_KIND != 0:
        # the mass is convex (beta >= 1): the Newton point is left of the root
        lo = tl.where(okn, tl.maximum(lo, t + dn), lo)
        if BETA_KIND == 2:
            # the closed form counts entries that leave the support: right of
            # the root from the left, left of it from the right
            hi = tl.where(okc & left, tl.minimum(hi, t + dc), hi)
            lo = tl.where(okc & ~left, tl.maximum(lo, t + dc), lo)
            t_next = tl.where(left, 0.5 * (lo + hi), lo)
        else:
            t_next = lo
        d = tl.where(exact, dc, tl.where(okn, dn, 0.0))
        done = exact | (tl.abs(f) <= tol)
    else:
        if FORM == 1:
            # Newton on log S0, nearly linear in r near softmax
            ok = (c0 > 0) & okn
            c0s = tl.where(ok, c0, 1.0)
            cand = t + tl.log(c0s) * c0s / (beta * tl.where(ok, c1, 1.0))
        else:
            d1 = -beta * c1
            d1s = tl.where(d1 != 0, d1, -1.0)
            L = f * (beta * (beta - 1.0) * c2) / (d1s * d1s)
            L = tl.minimum(tl.maximum(tl.where(L == L, L, 0.0), -1.0), 1.0)
            cand = t - (f / d1s) / (1.0 - 0.5 * L)
            ok = okn
    if FORM == 1:
        tiny = 1.2e-7 / beta
    else:
        tiny = 1.2e-7 * tl.abs(t)
    if BETA_KIND == 0:
        size = tl.abs(cand - t)
        ok = ok & (cand >= lo) & (cand <= hi) & ((size <= 0.5 * st2) | (size <= tiny))
        t_next = tl.where(ok, cand, 0.5 * (lo + hi))
        st2 = st1
        st1 = tl.abs(t_next - t)
        d = tl.where(okn, dn, 0.0)
        done = tl.abs(f) <= tol
    done = done | (hi - lo <= tiny)
    return done, d, t_next, lo, hi, st1, st2


@triton.jit
def _prefill_entmax_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, slopes_ptr, kmax_ptr, passes_ptr,
    cz, sl_unit, beta, tol, Tq, Tk, H, G,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BETA_KIND: tl.constexpr, FORM: tl.constexpr, HAS_ALIBI: tl.constexpr, SKIP: tl.constexpr,
    SEED_ITERS: tl.constexpr, MAX_ITERS: tl.constexpr, FUSED: tl.constexpr, RECORD: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    """Causal alpha-entmax attention (1 < alpha <= 4) of one (batch, head,
    query block): the max pass, the seed, the solve passes and (unless FUSED)
    the output pass of the module docstring; writes [BLOCK_M, D] of the
    output in its dtype and, with RECORD, the number of key passes made at
    passes[program] (int32). cz = scale (alpha-1), sl_unit = alpha - 1,
    beta = 1 / (alpha - 1)."""
    b, h, kvh, m0, valid, pos, b_q, kb_diag, kb_end, i_bh, i_m = _program(
        q_ptr, Tq, Tk, H, G, stride_qb, stride_qh, stride_qt, D, BLOCK_D, BLOCK_M, BLOCK_N)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    p_o = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
           + (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * stride_ot + o_d[None, :])
    m_o = valid[:, None] & (o_d[None, :] < D)
    slz = 0.0
    if HAS_ALIBI:
        slz = tl.load(slopes_ptr + h) * sl_unit
    colb = slz * o_n.to(tl.float32)
    zero = tl.zeros([BLOCK_M], tl.float32)
    qn = tl.zeros([BLOCK_M], tl.float32)
    kmax = 0.0
    if SKIP:
        bq = b_q.to(tl.float32)
        qn = tl.sqrt(tl.sum(bq * bq, axis=1)) * cz
        kmax = tl.load(kmax_ptr + b * (H // G) + kvh)

    # -- pass 1: the row max and the slot tops (diagonal blocks first)
    tops = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    for kb in range(kb_diag, kb_end):
        tops = tl.maximum(tops, _scores(b_q, k_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, zero, Tk,
                                        stride_kt, True, HAS_ALIBI, D, BLOCK_D, DOT_F32, PREC))
    kb_lo = 0
    if SKIP:  # x > t >= -1 on the support: keys with z <= (running max) - 1 never enter it
        kb_lo = _first_block(tl.max(tops, axis=1) - 1.0, pos, valid, qn, kmax, slz, kb_diag, BLOCK_N)
    for kb in range(kb_lo, kb_diag):
        tops = tl.maximum(tops, _scores(b_q, k_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, zero, Tk,
                                        stride_kt, False, HAS_ALIBI, D, BLOCK_D, DOT_F32, PREC))
    mz = tl.max(tops, axis=1)

    # -- the seed, over the tops (x units: the row max is at x = 0)
    n = (pos + 1).to(tl.float32)
    if FORM == 1:  # r = t + 1 in [0, 1 - n^(1-alpha)], and 1 - n^(-g) <= g ln n
        lo = tl.zeros([BLOCK_M], tl.float32)
        hi = tl.minimum(tl.log(n) / beta, 1.0)
    else:  # t in [-1, -n^(1-alpha)]
        lo = tl.full([BLOCK_M], -1.0, tl.float32)
        hi = -tl.exp2(-tl.log2(n) / beta)
    t, lo = _seed(tops - mz[:, None], lo, hi, beta, SEED_ITERS, BETA_KIND, FORM)

    # -- solve passes, until every row has finished (FUSED: each row's output
    # is stored by the pass that finishes it; else t becomes its final threshold)
    done = valid == 0
    st1 = hi - lo
    st2 = hi - lo
    it = tl.zeros([], tl.int32)
    left = tl.sum(valid.to(tl.int32), axis=0)
    while left > 0:
        act = done == 0
        kb_lo = 0
        if SKIP:  # the row's threshold is >= lo: keys with x <= lo carry no weight
            kb_lo = _first_block(mz + _edge(lo, FORM), pos, act, qn, kmax, slz, kb_diag, BLOCK_N)
        c0 = tl.zeros([BLOCK_M], tl.float32)
        c1 = tl.zeros([BLOCK_M], tl.float32)
        c2 = tl.zeros([BLOCK_M], tl.float32)
        mn = tl.full([BLOCK_M], float("inf"), tl.float32)
        mxo = tl.full([BLOCK_M], float("-inf"), tl.float32)
        a0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        a1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        a2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for kb in range(kb_lo, kb_diag):
            c0, c1, c2, mn, mxo, a0, a1, a2 = _solve_tile(
                b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt, stride_vt,
                mz, t, act, beta, c0, c1, c2, mn, mxo, a0, a1, a2,
                False, HAS_ALIBI, BETA_KIND, FORM, FUSED, D, BLOCK_D, DOT_F32, PREC)
        for kb in range(kb_diag, kb_end):
            c0, c1, c2, mn, mxo, a0, a1, a2 = _solve_tile(
                b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt, stride_vt,
                mz, t, act, beta, c0, c1, c2, mn, mxo, a0, a1, a2,
                True, HAS_ALIBI, BETA_KIND, FORM, FUSED, D, BLOCK_D, DOT_F32, PREC)
        fin, d, t_next, lo, hi, st1, st2 = _step(t, lo, hi, st1, st2, c0, c1, c2, mn, mxo, beta, tol,
                                                 BETA_KIND, FORM)
        it += 1
        fin = act & (fin | (tl.zeros([BLOCK_M], tl.int32) + it >= MAX_ITERS))
        if FUSED:
            # the output at t + d from this pass's moments: exact for beta = 1, 2
            # on an unchanged support, first order otherwise
            g1 = beta * d
            if BETA_KIND == 2:
                g2 = d * d
            else:
                g2 = 0.0 * d
            mass = c0 - g1 * c1 + g2 * c2
            o_new = (a0 - g1[:, None] * a1 + g2[:, None] * a2) / tl.where(mass > 0, mass, 1.0)[:, None]
            tl.store(p_o, o_new.to(o_ptr.dtype.element_ty), mask=m_o & fin[:, None])
            t = tl.where(done | fin, t, t_next)
        else:
            # t + d: the root on the support (beta = 1, 2, when exact), else a Newton step
            t = tl.where(fin, tl.minimum(tl.maximum(t + d, lo), hi), tl.where(done, t, t_next))
        done = done | fin
        left = tl.sum((done == 0).to(tl.int32), axis=0)

    passes = it + 1
    if not FUSED:
        # -- the output pass at the final thresholds (keys with x <= t have p = 0)
        kb_lo = 0
        if SKIP:
            kb_lo = _first_block(mz + _edge(t, FORM), pos, valid, qn, kmax, slz, kb_diag, BLOCK_N)
        mass = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for kb in range(kb_lo, kb_diag):
            mass, acc = _out_tile(b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt,
                                  stride_vt, mz, t, valid, beta, mass, acc,
                                  False, HAS_ALIBI, BETA_KIND, FORM, D, BLOCK_D, DOT_F32, PREC)
        for kb in range(kb_diag, kb_end):
            mass, acc = _out_tile(b_q, k_base, v_base, kb * BLOCK_N, o_n, o_d, pos, cz, slz, colb, Tk, stride_kt,
                                  stride_vt, mz, t, valid, beta, mass, acc,
                                  True, HAS_ALIBI, BETA_KIND, FORM, D, BLOCK_D, DOT_F32, PREC)
        out = acc / tl.where(mass > 0, mass, 1.0)[:, None]
        tl.store(p_o, out.to(o_ptr.dtype.element_ty), mask=m_o)
        passes += 1
    if RECORD:
        tl.store(passes_ptr + i_bh * tl.cdiv(Tq, BLOCK_M) + i_m, passes)
