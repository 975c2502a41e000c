"""Per-token key sketches on the device (Triton twins of ``entmaxkv.sketch``).

Shapes: T tokens of a write, N physical pages, H KV heads, P page size,
D head dim, m sketch dims, B batch rows, HQ query heads, G = HQ // H,
M logical pages per block-table row.

* ``_sketch_write_kernel``, grid (T, H): one stored key row -> its m int8
  codes and two float16 radii, computed in float32 with the reference's
  rounding allowance (``sketch._encode_slack``) and rounded up when stored,
  so the radii are never below the exact ones.
* ``_sketch_page_kernel``, grid (T, H), launched after the token kernel:
  the last token of each run of a page (the write contract: a page's
  tokens come consecutively, in row order, the last one its last valid
  row) recomputes the page's summary over rows 0 .. row: int8 (min, max)
  codes and the float16 largest radii (NaN if any of them is NaN).
* ``_sketch_bounds_kernel``, grid (B * H, blocks of pages): one program
  bounds BLOCK_M logical pages of one (batch row, KV head) for all G query
  heads of the group, reading each token's codes and radii once; with a
  page mask, only the marked pages' tokens are read and the rest keep a
  given bound.
  The certified policy's mode computes that mask itself: the valid pages
  outside its seed whose summary bound clears tau over the seed.
* ``_sketch_box_kernel``, grid (B * H, blocks of pages): the same from the
  page summaries (2 m + 4 bytes per page and KV head), looser; it can also
  write one or two top-k key tables ranked by these bounds (the certified
  policy's seeds, selected by ``topk.select_keys``).
* ``_sketch_terms_kernel``, grid (B * H): a query's terms of the bounds
  (``sketch.query_terms``) in float64, one launch.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from .._checks import as_float, describe
from ..sketch import CODE_MAX, _encode_slack
from ._common import alloc, as_slopes, interpreting, next_pow2, no_positions
from .topk.search import INT32_MIN, page_rank, sortable_key

__all__ = ["write_sketch", "sketch_bounds", "page_box_bounds", "need_bounds", "sketch_terms", "box_launch"]

# x + 1.5 * 2^23 - 1.5 * 2^23 rounds float32 |x| <= 2^22 to an integer, half to even (torch.round's rule)
_ROUND_MAGIC = tl.constexpr(12582912.0)


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


@triton.jit
def _up_f16(x):
    """float32 x >= 0 -> float16 rounded toward +inf: +inf beyond float16's
    range, NaN stays NaN. The cast may round either way (to nearest on the
    GPU); a result below x is bumped up by one float16 ulp."""
    y = x.to(tl.float16)
    below = y.to(tl.float32) < x  # false for NaN
    bumped = (y.to(tl.uint16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(below, bumped, y)


@triton.jit
def _codes_of(b_z, b_step, CMAX: tl.constexpr):
    """round(z / step) clamped to [-CMAX, CMAX] (float32; NaN -> 0, +-inf -> +-CMAX)."""
    b_u = tl.div_rn(b_z, b_step)
    b_u = tl.where(b_u != b_u, 0.0, b_u)
    # clamped before rounding (same result: the ends are integers) so the
    # rounding trick sees |u| <= 2^22; by tl.where, whose NaN behaviour does
    # not depend on the backend (no NaN is left anyway)
    b_u = tl.where(b_u > CMAX, CMAX, tl.where(b_u < -CMAX, -CMAX, b_u))
    return (b_u + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _group_terms(terms_ptr, slopes_ptr, i_b, h0, G, HQ, MD: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_MD: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """The query terms of the G heads h0 .. h0 + G - 1 of batch row i_b
    (``sketch.query_terms``, float32 [B, HQ, MD + 4]): w [BLOCK_G, BLOCK_MD],
    then qmu, na, nperp, qn and the ALiBi slope, each [BLOCK_G] (0 on
    masked lanes; slopes 0 without ALiBi)."""
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    o_c = tl.arange(0, BLOCK_MD)
    m_c = o_c < MD
    p_t = terms_ptr + (i_b * HQ + h0 + o_g).to(tl.int64) * (MD + 4)
    b_w = tl.load(p_t[:, None] + o_c[None, :], mask=m_g[:, None] & m_c[None, :], other=0.0)
    b_qmu = tl.load(p_t + MD, mask=m_g, other=0.0)
    b_na = tl.load(p_t + MD + 1, mask=m_g, other=0.0)
    b_np = tl.load(p_t + MD + 2, mask=m_g, other=0.0)
    b_qn = tl.load(p_t + MD + 3, mask=m_g, other=0.0)
    if HAS_ALIBI:
        b_sl = tl.load(slopes_ptr + h0 + o_g, mask=m_g, other=0.0)
    else:
        b_sl = tl.zeros([BLOCK_G], tl.float32)
    return b_w, b_qmu, b_na, b_np, b_qn, b_sl


@triton.jit
def _basis_terms(mean_ptr, step_ptr, defect_ptr, kvh, D: tl.constexpr, MD: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_MD: tl.constexpr):
    """KV head kvh's step [BLOCK_MD] (0 on masked lanes), |mu| and defect."""
    o_c = tl.arange(0, BLOCK_MD)
    b_st = tl.load(step_ptr + kvh * MD + o_c, mask=o_c < MD, other=0.0)
    o_d = tl.arange(0, BLOCK_D)
    b_mu = tl.load(mean_ptr + kvh * D + o_d, mask=o_d < D, other=0.0)
    mu_n = tl.sqrt_rn(tl.sum(b_mu * b_mu, axis=0))
    defect = tl.load(defect_ptr + kvh)
    return b_st, mu_n, defect


@triton.jit
def _store_keys(key_ptr, b_u, m_g, o_g, o_m, m_v, i_b, h0, kvh, npages, MK, sinks, window, HQ,
                H: tl.constexpr, PER_HEAD: tl.constexpr):
    """The top-k rank keys (``topk.search``) of BLOCK_M pages from their
    bounds b_u [BLOCK_G, BLOCK_M]: per query head (PER_HEAD, row b * HQ + h)
    or the largest over the KV head's group (row b * H + kvh); forced pages
    (``sinks`` first, ``window`` last, the last page) INF_KEY, pages past the
    row INT32_MIN. Slots o_m < MK are written."""
    wnd = tl.minimum(tl.maximum(window, 1), npages)
    forced = (o_m < sinks) | (o_m >= npages - wnd)
    b_rank = tl.where(m_g[:, None], page_rank(b_u), float("-inf"))
    m_k = o_m < MK
    if PER_HEAD:
        b_rank = tl.where(forced[None, :], float("inf"), b_rank)
        b_key = tl.where(m_v[None, :], sortable_key(b_rank), INT32_MIN)
        o_row = (i_b * HQ + h0 + o_g).to(tl.int64)
        tl.store(key_ptr + o_row[:, None] * MK + o_m[None, :], b_key, mask=m_g[:, None] & m_k[None, :])
    else:
        b_top = tl.where(forced, float("inf"), tl.max(b_rank, axis=0))
        b_key = tl.where(m_v, sortable_key(b_top), INT32_MIN)
        tl.store(key_ptr + (i_b * H + kvh).to(tl.int64) * MK + o_m, b_key, mask=m_k)


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _up_f32(x):
    """float64 x >= 0 -> float32 rounded toward +inf (NaN stays NaN, +inf
    beyond float32's range): a cast below x is bumped up by one ulp."""
    y = x.to(tl.float32)
    below = y.to(tl.float64) < x  # false for NaN
    bumped = (y.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    return tl.where(below, bumped, y)


@triton.jit
def _sketch_terms_kernel(q_ptr, mean_ptr, basis_ptr, step_ptr, out_ptr, HQ, G, sqb, sqh,
                         H: tl.constexpr, D: tl.constexpr, MD: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (batch row, KV head): the query terms of its G heads in float64
    (``sketch.query_terms``), one basis column at a time."""
    i_r = tl.program_id(0)
    i_b = i_r // H
    kvh = i_r % H
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q_ptr + i_b.to(tl.int64) * sqb + (kvh * G + o_g).to(tl.int64)[:, None] * sqh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float64)  # [BLOCK_G, BLOCK_D]
    b_mu = tl.load(mean_ptr + kvh * D + o_d, mask=m_d, other=0.0).to(tl.float64)
    p_out = out_ptr + (i_b * HQ + kvh * G + o_g).to(tl.int64) * (MD + 4)
    b_perp = b_q
    b_na = tl.zeros([BLOCK_G], tl.float64)
    for c in range(MD):
        b_col = tl.load(basis_ptr + kvh * (D * MD) + o_d * MD + c, mask=m_d, other=0.0).to(tl.float64)
        b_qa = tl.sum(b_q * b_col[None, :], axis=1)  # [BLOCK_G]
        st = tl.load(step_ptr + kvh * MD + c).to(tl.float64)
        tl.store(p_out + c, (b_qa * st).to(tl.float32), mask=m_g)
        b_na += b_qa * b_qa
        b_perp -= b_qa[:, None] * b_col[None, :]
    b_qmu = tl.sum(b_q * b_mu[None, :], axis=1)
    grow = 1.0 + 1e-12  # the reference's margin before rounding up
    tl.store(p_out + MD, b_qmu.to(tl.float32), mask=m_g)
    tl.store(p_out + MD + 1, _up_f32(tl.sqrt(b_na) * grow), mask=m_g)
    tl.store(p_out + MD + 2, _up_f32(tl.sqrt(tl.sum(b_perp * b_perp, axis=1)) * grow), mask=m_g)
    tl.store(p_out + MD + 3, _up_f32(tl.sqrt(tl.sum(b_q * b_q, axis=1)) * grow), mask=m_g)


@triton.jit
def _sketch_write_kernel(
    slot_ptr, kp_ptr, mean_ptr, basis_ptr, step_ptr, defect_ptr, codes_ptr, radii_ptr,
    NSLOT, skp, skh, skr, scp, sch, scr, srp, srh, srr, slack,
    P: tl.constexpr, D: tl.constexpr, MD: tl.constexpr, CMAX: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_MD: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # padding (< 0) is skipped; a slot past the pool is never touched (memory safety)
    if (slot >= 0) & (slot < NSLOT):
        page = slot // P
        row = slot % P
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        o_c = tl.arange(0, BLOCK_MD)
        m_c = o_c < MD
        b_k = tl.load(kp_ptr + page * skp + i_h * skh + row * skr + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_mu = tl.load(mean_ptr + i_h * D + o_d, mask=m_d, other=0.0)
        p_q = basis_ptr + i_h * (D * MD) + o_d[:, None] * MD + o_c[None, :]
        b_q = tl.load(p_q, mask=m_d[:, None] & m_c[None, :], other=0.0)  # [BLOCK_D, BLOCK_MD]
        b_st = tl.load(step_ptr + i_h * MD + o_c, mask=m_c, other=1.0)
        defect = tl.load(defect_ptr + i_h)

        b_x = b_k - b_mu  # k - mu (0 on masked lanes)
        b_z = tl.sum(b_x[:, None] * b_q, axis=0)  # Q^T (k - mu)  [BLOCK_MD]
        b_c = tl.where(m_c, _codes_of(b_z, b_st, CMAX), 0.0)
        b_da = tl.where(m_c, b_z - b_c * b_st, 0.0)
        e_a = tl.sqrt_rn(tl.sum(b_da * b_da, axis=0))
        b_r = b_x - tl.sum(b_q * b_z[None, :], axis=1)  # off-basis residual  [BLOCK_D]
        b_r = tl.where(m_d, b_r, 0.0)
        e_b = tl.sqrt_rn(tl.sum(b_r * b_r, axis=0))
        z_n = tl.sqrt_rn(tl.sum(tl.where(m_c, b_z * b_z, 0.0), axis=0))
        k_n = tl.sqrt_rn(tl.sum(b_k * b_k, axis=0))
        mu_n = tl.sqrt_rn(tl.sum(b_mu * b_mu, axis=0))
        # the float32 rounding of everything above is what the slack covers
        sl = slack * (k_n + mu_n)
        eps_a = e_a + defect * z_n + sl
        eps_b = e_b + sl

        tl.store(codes_ptr + page * scp + i_h * sch + row * scr + o_c, b_c.to(tl.int8), mask=m_c)
        p_r = radii_ptr + page * srp + i_h * srh + row * srr
        tl.store(p_r, _up_f16(eps_a))
        tl.store(p_r + 1, _up_f16(eps_b))


@triton.jit
def _sketch_page_kernel(
    slot_ptr, codes_ptr, radii_ptr, pcodes_ptr, pradii_ptr,
    T, NSLOT, scp, sch, scr, srp, srh, srr, sbp, sbh, sbs, sqp, sqh,
    P: tl.constexpr, MD: tl.constexpr, CMAX: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_MD: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    nxt = tl.load(slot_ptr + i_t + 1, mask=i_t + 1 < T, other=-1).to(tl.int64)
    if (slot >= 0) & (slot < NSLOT):
        page = slot // P
        row = slot % P
        # Only the last token of a run writes the summary: one writer per page
        # (no race), and it sees every row of the run (the token kernel, an
        # earlier launch, has stored them all). Rows 0 .. row are the page's
        # valid rows by the write contract.
        last = (nxt < 0) | (nxt >= NSLOT) | (nxt // P != page)
        if last:
            o_p = tl.arange(0, BLOCK_P)
            m_p = o_p <= row
            o_c = tl.arange(0, BLOCK_MD)
            m_c = o_c < MD
            p_c = codes_ptr + page * scp + i_h * sch + o_p[:, None] * scr + o_c[None, :]
            b_c = tl.load(p_c, mask=m_p[:, None] & m_c[None, :], other=0).to(tl.int32)
            lo = tl.min(tl.where(m_p[:, None], b_c, CMAX), axis=0)
            hi = tl.max(tl.where(m_p[:, None], b_c, -CMAX), axis=0)
            p_b = pcodes_ptr + page * sbp + i_h * sbh + o_c
            tl.store(p_b, lo.to(tl.int8), mask=m_c)
            tl.store(p_b + sbs, hi.to(tl.int8), mask=m_c)
            # radii are >= 0 (0 on the rows past the valid ones, as in the
            # reference); a NaN is carried by a flag, since the max of a
            # NaN depends on the backend (the GPU's max drops it)
            p_r = radii_ptr + page * srp + i_h * srh + o_p * srr
            b_ea = tl.load(p_r, mask=m_p, other=0.0).to(tl.float32)
            b_eb = tl.load(p_r + 1, mask=m_p, other=0.0).to(tl.float32)
            n_a = tl.max((b_ea != b_ea).to(tl.int32), axis=0)
            n_b = tl.max((b_eb != b_eb).to(tl.int32), axis=0)
            r_a = tl.where(n_a > 0, float("nan"), tl.max(tl.where(b_ea != b_ea, 0.0, b_ea), axis=0))
            r_b = tl.where(n_b > 0, float("nan"), tl.max(tl.where(b_eb != b_eb, 0.0, b_eb), axis=0))
            p_q = pradii_ptr + page * sqp + i_h * sqh
            # float16 -> float32 -> float16 is exact: the stored bits are the row's
            tl.store(p_q, r_a.to(tl.float16))
            tl.store(p_q + 1, r_b.to(tl.float16))


@triton.jit
def _sketch_bounds_kernel(
    terms_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, codes_ptr, radii_ptr,
    mean_ptr, step_ptr, defect_ptr, sel_ptr, base_ptr, tau_ptr, out_ptr,
    scale, c_val, c_score, am1, HQ, G, M, R,
    scp, sch, scr, srp, srh, srr, ssb, sss, ssm, sbb, sbh, sbm,
    H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, MD: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SEL: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_m = tl.program_id(1)
    i_b = i_r // H
    kvh = i_r % H
    h0 = kvh * G
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)

    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    o_c = tl.arange(0, BLOCK_MD)
    m_c = o_c < MD
    b_w, b_qmu, b_na, b_np, b_qn, b_sl = _group_terms(terms_ptr, slopes_ptr, i_b, h0, G, HQ, MD, BLOCK_G,
                                                      BLOCK_MD, HAS_ALIBI)
    b_st, mu_n, defect = _basis_terms(mean_ptr, step_ptr, defect_ptr, kvh, D, MD, BLOCK_D, BLOCK_MD)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_out = m_g[:, None] & (o_m < M)[None, :]
    # BLOCK_M pages x BLOCK_P rows, flattened page-major
    o_t = tl.arange(0, BLOCK_M * BLOCK_P)
    t_row = o_t % BLOCK_P
    t_lp = i_m * BLOCK_M + o_t // BLOCK_P  # logical page
    t_pos = t_lp * P + t_row
    m_t = (t_row < P) & (t_lp < M) & (t_pos < n)
    if SEL >= 1:
        # the mask rows of the group's heads (head h reads row h // R); a
        # page's tokens are read only if one of them marks it: the bytes an
        # unmarked page would cost are the point of the mask
        p_s = sel_ptr + i_b * ssb + ((h0 + o_g) // R).to(tl.int64) * sss
        p_base = base_ptr + i_b * sbb + (h0 + o_g).to(tl.int64)[:, None] * sbh + o_m[None, :] * sbm
        b_base = tl.load(p_base, mask=m_out, other=0.0)
        if SEL == 1:  # the marked pages
            b_sel = tl.load(p_s[:, None] + o_m[None, :] * ssm, mask=m_out, other=0) != 0  # [BLOCK_G, BLOCK_M]
        else:
            # the certified policy's: valid pages outside the seed (sel) whose
            # base bound clears tau over the seed for some head of the row
            # (R == G: one row for the group; else R == 1, a row per head)
            b_tau = tl.load(tau_ptr + i_b * HQ + h0 + o_g, mask=m_g, other=float("inf"))
            b_clr = (am1 * b_base > b_tau[:, None]) & m_out
            if R != 1:
                b_clr = (tl.max(b_clr.to(tl.int32), axis=0) > 0)[None, :] & m_g[:, None]
            b_seed = tl.load(p_s[:, None] + o_m[None, :] * ssm, mask=m_out, other=1) != 0
            b_sel = b_clr & (b_seed == 0) & ((o_m * P) < n)[None, :]
        b_any = tl.max(b_sel.to(tl.int32), axis=0)  # [BLOCK_M], > 0: some head marks the page
        t_any = tl.reshape(tl.broadcast_to(b_any[:, None], (BLOCK_M, BLOCK_P)), (BLOCK_M * BLOCK_P,))
        m_t = m_t & (t_any > 0)
    t_phys = tl.load(bt_ptr + seq * M + t_lp, mask=m_t, other=0).to(tl.int64)
    p_c = codes_ptr + t_phys * scp + kvh * sch + t_row * scr
    b_c = tl.load(p_c[:, None] + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0).to(tl.float32)
    p_r = radii_ptr + t_phys * srp + kvh * srh + t_row * srr
    b_ea = tl.load(p_r, mask=m_t, other=0.0).to(tl.float32)
    b_eb = tl.load(p_r + 1, mask=m_t, other=0.0).to(tl.float32)

    # b_j = scale (qmu + w.c + na eps_a + nperp eps_b) (+ allowances) + slope (p_j - pos_q)
    b_dot = tl.sum(b_w[:, None, :] * b_c[None, :, :], axis=2)  # [BLOCK_G, BLOCK_T]
    b_mag = tl.sum(tl.abs(b_w)[:, None, :] * tl.abs(b_c)[None, :, :], axis=2)
    b_rad = b_na[:, None] * b_ea[None, :] + b_np[:, None] * b_eb[None, :]
    b_val = b_qmu[:, None] + b_dot + b_rad
    b_mag = b_mag + tl.abs(b_qmu)[:, None] + b_rad
    b_cs = b_c * b_st[None, :]
    b_zq = tl.sqrt_rn(tl.sum(b_cs * b_cs, axis=1))  # |c * step|  [BLOCK_T]
    b_kn = mu_n + (1.0 + defect) * (b_zq + b_ea) + b_eb  # >= |k_j|
    b_tok = scale * (b_val + c_val * b_mag)
    b_mag_s = scale * b_qn[:, None] * b_kn[None, :]
    if HAS_ALIBI:
        rel = (t_pos - (n - 1)).to(tl.float32)
        b_tok += b_sl[:, None] * rel[None, :]
        b_mag_s += tl.abs(b_sl)[:, None] * (n + 1).to(tl.float32)
    b_tok += c_score * b_mag_s
    b_tok = tl.where(m_t[None, :], b_tok, float("-inf"))

    # a page's bound: the max over its valid tokens, NaN if any of them is NaN
    b_tok3 = tl.reshape(b_tok, (BLOCK_G, BLOCK_M, BLOCK_P))
    b_nan = tl.reshape((b_tok != b_tok).to(tl.int32), (BLOCK_G, BLOCK_M, BLOCK_P))
    b_u = tl.max(b_tok3, axis=2)
    b_u = tl.where(tl.max(b_nan, axis=2) > 0, float("nan"), b_u)

    if SEL >= 1:
        # marked: min(base, bound) with NaN from either side (torch.minimum); else base
        b_lo = tl.where(b_u < b_base, b_u, b_base)
        b_lo = tl.where((b_u != b_u) | (b_base != b_base), float("nan"), b_lo)
        b_u = tl.where(b_sel, b_lo, b_base)

    o_out = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
    tl.store(out_ptr + o_out, b_u, mask=m_out)


@triton.jit
def _sketch_box_kernel(
    terms_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, pcodes_ptr, pradii_ptr,
    mean_ptr, step_ptr, defect_ptr, out_ptr, key_ptr, key2_ptr,
    scale, c_val, c_score, HQ, G, M,
    sbp, sbh, sbs, sqp, sqh, MK, sinks, window, MK2, sinks2, window2,
    H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, MD: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MD: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_ALIBI: tl.constexpr, KEYS: tl.constexpr, PER_HEAD: tl.constexpr, PER_HEAD2: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_m = tl.program_id(1)
    i_b = i_r // H
    kvh = i_r % H
    h0 = kvh * G
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)

    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    o_c = tl.arange(0, BLOCK_MD)
    m_c = o_c < MD
    b_w, b_qmu, b_na, b_np, b_qn, b_sl = _group_terms(terms_ptr, slopes_ptr, i_b, h0, G, HQ, MD, BLOCK_G,
                                                      BLOCK_MD, HAS_ALIBI)
    b_st, mu_n, defect = _basis_terms(mean_ptr, step_ptr, defect_ptr, kvh, D, MD, BLOCK_D, BLOCK_MD)

    # BLOCK_M logical pages: the valid ones hold >= 1 token
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    first = o_m * P
    m_m = (o_m < M) & (first < n)
    phys = tl.load(bt_ptr + seq * M + o_m, mask=m_m, other=0).to(tl.int64)
    p_b = pcodes_ptr + phys * sbp + kvh * sbh
    m_b = m_m[:, None] & m_c[None, :]
    b_lo = tl.load(p_b[:, None] + o_c[None, :], mask=m_b, other=0).to(tl.float32)  # [BLOCK_M, BLOCK_MD]
    b_hi = tl.load(p_b[:, None] + sbs + o_c[None, :], mask=m_b, other=0).to(tl.float32)
    p_q = pradii_ptr + phys * sqp + kvh * sqh
    b_ea = tl.load(p_q, mask=m_m, other=0.0).to(tl.float32)
    b_eb = tl.load(p_q + 1, mask=m_m, other=0.0).to(tl.float32)

    # the token bound maximised over the box: each w_i c_i at the end of
    # [lo_i, hi_i] it favours, the largest radii, |c_i| <= max(|lo_i|, |hi_i|)
    b_wq = b_w[:, None, :]  # [BLOCK_G, 1, BLOCK_MD]
    b_best = tl.sum(tl.maximum(b_wq * b_lo[None, :, :], b_wq * b_hi[None, :, :]), axis=2)  # [BLOCK_G, BLOCK_M]
    b_top = tl.maximum(tl.abs(b_lo), tl.abs(b_hi))
    b_mag = tl.sum(tl.abs(b_wq) * b_top[None, :, :], axis=2)
    b_rad = b_na[:, None] * b_ea[None, :] + b_np[:, None] * b_eb[None, :]
    b_val = b_qmu[:, None] + b_best + b_rad
    b_mag = b_mag + tl.abs(b_qmu)[:, None] + b_rad
    b_ts = b_top * b_st[None, :]
    b_zq = tl.sqrt_rn(tl.sum(b_ts * b_ts, axis=1))  # [BLOCK_M]
    b_kn = mu_n + (1.0 + defect) * (b_zq + b_ea) + b_eb  # >= |k| of every token of the page
    b_u = scale * (b_val + c_val * b_mag)
    b_mag_s = scale * b_qn[:, None] * b_kn[None, :]
    if HAS_ALIBI:
        # the page's largest bias: at its first or its last valid token
        n_tok = tl.minimum(n - first, P)
        last = first + tl.maximum(n_tok - 1, 0)
        r_f = (first - (n - 1)).to(tl.float32)
        r_l = (last - (n - 1)).to(tl.float32)
        b_u += tl.maximum(b_sl[:, None] * r_f[None, :], b_sl[:, None] * r_l[None, :])
        b_mag_s += tl.abs(b_sl)[:, None] * (n + 1).to(tl.float32)
    b_u += c_score * b_mag_s
    b_u = tl.where(m_m[None, :], b_u, float("-inf"))

    o_out = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
    tl.store(out_ptr + o_out, b_u, mask=m_g[:, None] & (o_m < M)[None, :])
    # the seeds' top-k rank keys from the same bounds (the grid covers MK >= M slots)
    npages = (n + P - 1) // P
    if KEYS >= 1:
        _store_keys(key_ptr, b_u, m_g, o_g, o_m, m_m, i_b, h0, kvh, npages, MK, sinks, window, HQ, H, PER_HEAD)
    if KEYS >= 2:
        _store_keys(key2_ptr, b_u, m_g, o_g, o_m, m_m, i_b, h0, kvh, npages, MK2, sinks2, window2, HQ, H, PER_HEAD2)


# ---------------------------------------------------------------------------
# launchers / public functions
# ---------------------------------------------------------------------------


def _f32_up(x: float) -> float:
    """x as a float32 value rounded up (a kernel's Python float is float32)."""
    y = np.float32(x)
    if float(y) < x:
        y = np.nextafter(y, np.float32(np.inf))
    return float(y)


def _sketch_strides(sk, cache, name: str):
    """Element strides (page, head, row) of the sketch's codes and radii and
    (page, head, min/max) of its page_codes, (page, head) of its page_radii,
    after checking the sketch matches the pages of ``cache`` (the argument
    ``name``, for the errors); the last axis of each must be contiguous."""
    N, H, P, D = cache.num_pages, cache.kv_heads, cache.page_size, cache.head_dim
    m = sk.basis.shape[2] if sk.basis.dim() == 3 else -1
    want = {"mean": (H, D), "basis": (H, D, m), "step": (H, m), "defect": (H,),
            "codes": (N, H, P, m), "radii": (N, H, P, 2), "page_codes": (N, H, 2, m), "page_radii": (N, H, 2)}
    for field, shape in want.items():
        t = getattr(sk, field)
        if tuple(t.shape) != shape or t.device != cache.k_pages.device:
            raise ValueError(f"{name}.sketch.{field}: expected shape {shape} on {cache.k_pages.device} "
                             f"(the pages' heads, page size and head dim), got {describe(t)} on {t.device}")
    for field in ("mean", "basis", "step", "defect"):
        t = getattr(sk, field)
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}.sketch.{field}: expected a contiguous float32 tensor, got {describe(t)}")
    for field, dtype in (("codes", torch.int8), ("radii", torch.float16), ("page_codes", torch.int8),
                         ("page_radii", torch.float16)):
        t = getattr(sk, field)
        if t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name}.sketch.{field}: expected {dtype} with a contiguous last axis, got {describe(t)}")
    return sk.codes.stride()[:3], sk.radii.stride()[:3], sk.page_codes.stride()[:3], sk.page_radii.stride()[:2]


def write_sketch(kv, slot_mapping: torch.Tensor, ws=None) -> None:
    """Encode the stored keys at ``slot_mapping`` into ``kv.sketch`` and
    refresh the summaries of the pages written (Triton twin of
    ``entmaxkv.sketch.write_sketch``; the write paths call it after storing K).

    For every token t with ``slot_mapping[t] >= 0`` (page = slot // P,
    row = slot % P) and every KV head h, reads the stored key
    ``kv.k_pages[page, h, row]`` (float16/bfloat16/float32) and writes
    ``kv.sketch.codes[page, h, row]`` (int8 [m]) and ``kv.sketch.radii[page,
    h, row]`` (float16 [2], rounded up; +inf past float16's range, NaN for a
    non-finite key). Then the last token of each run of one page (the next
    slot is on another page, padding or past the mapping's end) sets
    ``kv.sketch.page_codes[page, h]`` (int8 [2, m]: min, max) and
    ``kv.sketch.page_radii[page, h]`` (float16 [2]: the largest eps_a,
    eps_b, NaN if one is NaN) over rows 0 .. row, as ``sketch.page_boxes``
    does (equal bit for bit on the same token sketches). Write contract
    (``entmaxkv.write``): a page's tokens come consecutively in row order,
    with no padding between them, and the last one is its last valid row.

    Two launches, grids (T, kv_heads); the mapping is read on the device
    only (no host synchronisation: graph-capturable).

    Args:
        kv: a layout.PagedKV (or PagedKVCache) whose ``sketch`` is set.
        slot_mapping: int32/int64 [T] on the pages' device (< 0: padding).
        ws: unused (no scratch); taken for a uniform launcher signature.
    """
    sk = getattr(kv, "sketch", None)
    if sk is None:
        raise ValueError("kv: expected pages with a key sketch (kv.sketch), got none")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or slot_mapping.dtype not in (
            torch.int32, torch.int64) or slot_mapping.device != kv.k_pages.device:
        raise ValueError(f"slot_mapping: expected an int32/int64 tensor [T] on {kv.k_pages.device}, "
                         f"got {describe(slot_mapping)}")
    T = slot_mapping.shape[0]
    if T == 0:
        return
    H, P, D, m = kv.kv_heads, kv.page_size, kv.head_dim, sk.dims
    if kv.k_pages.stride(-1) != 1:
        raise ValueError("kv.k_pages: the head_dim axis must be contiguous")
    (scp, sch, scr), (srp, srh, srr), (sbp, sbh, sbs), (sqp, sqh) = _sketch_strides(sk, kv, "kv")
    skp, skh, skr = kv.k_pages.stride()[:3]
    bd, bm = next_pow2(D), next_pow2(m)
    nslot = kv.num_pages * P
    _sketch_write_kernel[(T, H)](
        slot_mapping, kv.k_pages, sk.mean, sk.basis, sk.step, sk.defect, sk.codes, sk.radii,
        nslot, skp, skh, skr, scp, sch, scr, srp, srh, srr, _f32_up(_encode_slack(D, m)),
        P=P, D=D, MD=m, CMAX=CODE_MAX, BLOCK_D=bd, BLOCK_MD=bm,
        num_warps=8 if bd * bm >= 8192 else 4 if bd * bm >= 2048 else 1,
    )
    # a second launch: a page's summary needs every row of its run written
    _sketch_page_kernel[(T, H)](
        slot_mapping, sk.codes, sk.radii, sk.page_codes, sk.page_radii,
        T, nslot, scp, sch, scr, srp, srh, srr, sbp, sbh, sbs, sqp, sqh,
        P=P, MD=m, CMAX=CODE_MAX, BLOCK_P=next_pow2(P), BLOCK_MD=bm,
        num_warps=4 if next_pow2(P) * bm >= 4096 else 1,
    )


def _bounds_plan(G: int, P: int, m: int) -> dict:
    """Block sizes: BLOCK_M pages of BLOCK_P rows, so the [G, tokens, m]
    products of one program stay within a register budget (larger on the
    interpreter, where fewer, wider programs run faster)."""
    bg, bp, bm = next_pow2(G), next_pow2(P), next_pow2(m)
    budget = 1 << 16 if interpreting() else 8192
    limit = max(1, min(64, budget // (bg * bp * bm)))
    return dict(BLOCK_G=bg, BLOCK_P=bp, BLOCK_MD=bm, BLOCK_M=1 << (limit.bit_length() - 1))


def _box_plan(G: int, m: int) -> dict:
    """Block sizes of the box kernel: BLOCK_M pages per program, its
    [G, pages, m] products within the same budget as ``_bounds_plan``."""
    bg, bm = next_pow2(G), next_pow2(m)
    budget = 1 << 16 if interpreting() else 8192
    limit = max(1, min(128, budget // (bg * bm)))
    return dict(BLOCK_G=bg, BLOCK_MD=bm, BLOCK_M=1 << (limit.bit_length() - 1))


def _bound_args(q, cache, seq_ids, scale, slopes, what: str):
    """Check the arguments shared by the bound launchers (``what`` names the
    caller in the position-table error): returns (sketch, scale as a float,
    the block table, the sketch strides)."""
    sk = getattr(cache, "sketch", None)
    if sk is None:
        raise ValueError("cache: expected a cache with per-token key sketches (cache.sketch), got none")
    no_positions(cache, what)
    dev = cache.k_pages.device
    H, D = cache.kv_heads, cache.head_dim
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (
            torch.float16, torch.bfloat16, torch.float32, torch.float64) or q.device != dev \
            or q.shape[2] != D or q.shape[1] % H != 0 or q.shape[1] == 0:
        raise ValueError(f"q: expected a float tensor [batch, q_heads (a multiple of {H}), {D}] on {dev}, "
                         f"got {describe(q)}" + (f" on {q.device}" if isinstance(q, torch.Tensor) else ""))
    B, HQ, _ = q.shape
    if not isinstance(seq_ids, torch.Tensor) or seq_ids.dim() != 1 or seq_ids.shape[0] != B \
            or seq_ids.dtype not in (torch.int32, torch.int64) or seq_ids.device != dev:
        raise ValueError(f"seq_ids: expected an int32/int64 tensor [{B}] on {dev}, got {describe(seq_ids)}"
                         + (f" on {seq_ids.device}" if isinstance(seq_ids, torch.Tensor) else ""))
    scale = as_float(scale, "scale", lo=0.0, lo_open=True)
    if slopes is not None and (not isinstance(slopes, torch.Tensor) or tuple(slopes.shape) != (HQ,)
                               or not slopes.is_floating_point()):
        raise ValueError(f"slopes: expected a float tensor [{HQ}] or None, got {describe(slopes)}")
    bt = cache.block_table
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.stride(1) != 1 or bt.stride(0) != bt.shape[1]:
        raise ValueError("cache.block_table: expected a contiguous int32 table")
    return sk, scale, bt, _sketch_strides(sk, cache, "cache")


def _page_mask_args(pages, base, B: int, H: int, HQ: int, M: int, dev):
    """Check ``sketch_bounds``' optional page mask and base bound: returns
    (mask as uint8 [B, S, M] (a view), heads per mask row R = HQ // S)."""
    if pages is None:
        if base is not None:
            raise ValueError("base: only taken with pages (the pages to bound from token sketches), got no pages")
        return None, 1
    if not isinstance(pages, torch.Tensor) or pages.dim() != 3 or pages.dtype not in (torch.bool, torch.uint8) \
            or pages.device != dev or pages.shape[0] != B or pages.shape[1] not in (H, HQ) or pages.shape[2] != M:
        raise ValueError(f"pages: expected a bool/uint8 tensor [{B}, S, {M}] with S = kv_heads ({H}) or q_heads "
                         f"({HQ}) on {dev}, got {describe(pages)}"
                         + (f" on {pages.device}" if isinstance(pages, torch.Tensor) else ""))
    if not isinstance(base, torch.Tensor) or tuple(base.shape) != (B, HQ, M) or base.dtype != torch.float32 \
            or base.device != dev:
        raise ValueError(f"base: expected a float32 tensor [{B}, {HQ}, {M}] on {dev} (the bound of the pages "
                         f"not marked), got {describe(base)}"
                         + (f" on {base.device}" if isinstance(base, torch.Tensor) else ""))
    return pages.view(torch.uint8), HQ // pages.shape[1]


def sketch_bounds(q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                  slopes: Optional[torch.Tensor] = None, pages: Optional[torch.Tensor] = None,
                  base: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
    """Safe upper bound of every logical page's computed scores from its
    tokens' sketches (Triton twin of ``entmaxkv.sketch.sketch_bounds``: the
    same formula and allowances, in float32).

    With ``pages`` only the marked pages are bounded from token sketches:
    the result is ``torch.where(mark, torch.minimum(base, bound), base)``
    (query head h reads mask row h // (q_heads // S)), and a page that no
    head of a KV head's group marks has none of that KV head's codes and
    radii read (the certified policy reads token sketches only where the
    page summaries do not rule a page out).

    Args:
        q: [B, q_heads, head_dim] float16/bfloat16/float32/float64 on the
            cache device (q_heads a multiple of kv_heads).
        cache: a PagedKVCache or layout.PagedKV whose ``sketch`` is set
            (no position table).
        seq_ids: int32/int64 [B] block-table rows, on the cache device.
        scale: score scale > 0; slopes: optional float [q_heads] ALiBi slopes.
        pages: optional bool/uint8 [B, S, M], S = kv_heads or q_heads
            (nonzero: bound from token sketches).
        base: float32 [B, q_heads, M], required with ``pages`` (and only
            then): the bound kept where a page is not marked.
        ws: a Workspace for the output (None: a new tensor).
    Returns:
        float32 [B, q_heads, M] (M = cache.block_table.shape[1]): -inf for
        pages past a row's length, NaN for a page with a NaN token bound (a
        non-finite key), +inf where a radius overflowed float16.
    """
    sk, scale, bt, strides = _bound_args(q, cache, seq_ids, scale, slopes, "sketch_bounds")
    B, HQ, _ = q.shape
    sel, R = _page_mask_args(pages, base, B, cache.kv_heads, HQ, bt.shape[1], cache.k_pages.device)
    return _bounds_launch(q, cache, sk, bt, strides, seq_ids, scale, slopes, sel, R, base, None, 1.0, None, ws)


def need_bounds(q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float, slopes, base: torch.Tensor,
                seed: torch.Tensor, tau: torch.Tensor, alpha: float, terms: torch.Tensor, ws=None) -> torch.Tensor:
    """The certified policy's bound (one launch): ``sketch_bounds`` with
    ``pages`` = the valid pages outside ``seed`` whose ``base`` bound clears
    ``tau`` ((alpha - 1) * base > tau) for some query head of their mask
    row, as ``policies.certified_parts`` marks them; the arguments are the
    selection's own (checked there), ``terms`` = ``sketch_terms(q, ...)``.

    Args:
        base: float32 [B, q_heads, M] page-summary bounds; seed: uint8
            [B, S, M] seed pages (S = kv_heads or q_heads); tau: float32
            [B, q_heads] tau over the seed; alpha > 1.
    Returns:
        float32 [B, q_heads, M].
    """
    sk, scale, bt, strides = _bound_args(q, cache, seq_ids, scale, slopes, "need_bounds")
    HQ = q.shape[1]
    return _bounds_launch(q, cache, sk, bt, strides, seq_ids, scale, slopes, seed, HQ // seed.shape[1], base,
                          tau.to(torch.float32).contiguous(), float(alpha) - 1.0, terms, ws)


def _bounds_launch(q, cache, sk, bt, strides, seq_ids, scale, slopes, sel, R, base, tau, am1, terms, ws):
    """_sketch_bounds_kernel: no mask (sel None), a given mask (tau None) or
    the certified policy's (tau given, sel the seed)."""
    (scp, sch, scr), (srp, srh, srr) = strides[:2]
    dev = cache.k_pages.device
    H, P, D, m = cache.kv_heads, cache.page_size, cache.head_dim, sk.dims
    B, HQ, _ = q.shape
    G = HQ // H
    M = bt.shape[1]
    mem = alloc(ws)
    out = mem.empty((B, HQ, M), torch.float32, dev)
    if B == 0 or M == 0:
        return out
    if terms is None:
        terms = sketch_terms(q, sk, H, ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    cfg = _bounds_plan(G, P, m)
    eps = torch.finfo(torch.float32).eps  # the reference's allowances at float32
    grid = (B * H, triton.cdiv(M, cfg["BLOCK_M"]))
    # without a mask its pointers are never read (SEL is a constexpr): any tensor will do
    sel_t, base_t = (sel, base) if sel is not None else (out, out)
    ss = sel.stride() if sel is not None else (0, 0, 0)
    sb = base.stride() if sel is not None else (0, 0, 0)
    _sketch_bounds_kernel[grid](
        terms, sl, seq_ids, cache.seq_lens, bt, sk.codes, sk.radii, sk.mean, sk.step, sk.defect,
        sel_t, base_t, tau if tau is not None else out, out,
        scale, 4.0 * (m + 12) * eps, 4.0 * (D + 4) * eps, am1, HQ, G, M, R,
        scp, sch, scr, srp, srh, srr, *ss, *sb,
        H=H, P=P, D=D, MD=m, BLOCK_D=next_pow2(D), num_warps=4,
        HAS_ALIBI=slopes is not None, SEL=0 if sel is None else 1 if tau is None else 2, **cfg,
    )
    return out


def sketch_terms(q: torch.Tensor, sk, kv_heads: int, ws=None) -> torch.Tensor:
    """``sketch.query_terms`` in one launch: float32 [B, q_heads, m + 4]
    (w = qa * step, qmu, then |qa|, |q_perp|, |q| rounded up), computed in
    float64 like the reference (a reduction order apart; the bounds'
    allowance covers that)."""
    B, HQ, D = q.shape
    m = sk.dims
    G = HQ // kv_heads
    out = alloc(ws).empty((B, HQ, m + 4), torch.float32, q.device)
    if B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    _sketch_terms_kernel[(B * kv_heads,)](
        q, sk.mean, sk.basis, sk.step, out, HQ, G, q.stride(0), q.stride(1),
        H=kv_heads, D=D, MD=m, BLOCK_G=next_pow2(G), BLOCK_D=next_pow2(D), num_warps=1,
    )
    return out


def page_box_bounds(q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                    slopes: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
    """Safe upper bound of every logical page's computed scores from its
    summary (Triton twin of ``entmaxkv.sketch.page_box_bounds``: the token
    bound maximised over the box of the page's codes and its largest radii,
    the same allowances, in float32). Reads 2 m + 4 bytes per page and KV
    head; looser than ``sketch_bounds``.

    Args:
        q: [B, q_heads, head_dim] float16/bfloat16/float32/float64 on the
            cache device (q_heads a multiple of kv_heads).
        cache: a PagedKVCache or layout.PagedKV whose ``sketch`` is set
            (no position table), its page summaries current
            (``write_sketch``).
        seq_ids: int32/int64 [B] block-table rows, on the cache device.
        scale: score scale > 0; slopes: optional float [q_heads] ALiBi slopes.
        ws: a Workspace for the output (None: a new tensor).
    Returns:
        float32 [B, q_heads, M]: -inf for pages past a row's length, NaN
        for a page with a NaN radius, +inf where a radius overflowed float16.
    """
    sk, scale, bt, strides = _bound_args(q, cache, seq_ids, scale, slopes, "page_box_bounds")
    return box_launch(q, cache, sk, bt, strides, seq_ids, scale, slopes, None, (), ws)[0]


def box_launch(q, cache, sk, bt, strides, seq_ids, scale: float, slopes, terms, tables, ws=None):
    """_sketch_box_kernel after ``_bound_args``: (bounds float32 [B, q_heads,
    M], [key tables]). ``tables``: up to two (S, plan, sinks, window) seeds,
    each a top-k key table (``topk.table_plan``'s layout: int32 [B * S *
    plan["MK"]], S = kv_heads or q_heads) ranked by these bounds and written
    by the same launch; ``terms``: ``sketch_terms`` of q, or None."""
    (sbp, sbh, sbs), (sqp, sqh) = strides[2:]
    dev = cache.k_pages.device
    H, P, D, m = cache.kv_heads, cache.page_size, cache.head_dim, sk.dims
    B, HQ, _ = q.shape
    G = HQ // H
    M = bt.shape[1]
    mem = alloc(ws)
    out = mem.empty((B, HQ, M), torch.float32, dev)
    keys = [mem.empty(B * S * plan["MK"], torch.int32, dev) for S, plan, _, _ in tables]
    if B == 0 or M == 0:
        return out, keys
    if terms is None:
        terms = sketch_terms(q, sk, H, ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    cfg = _box_plan(G, m)
    eps = torch.finfo(torch.float32).eps
    span = max([M] + [plan["MK"] for _, plan, _, _ in tables])
    grid = (B * H, triton.cdiv(span, cfg["BLOCK_M"]))
    # (S, MK, sinks, window) of each table; an absent one's pointer is never read
    t = [(S, plan["MK"], int(sinks), int(window)) for S, plan, sinks, window in tables] + [(H, 0, 0, 0)] * 2
    _sketch_box_kernel[grid](
        terms, sl, seq_ids, cache.seq_lens, bt, sk.page_codes, sk.page_radii, sk.mean, sk.step, sk.defect, out,
        keys[0] if keys else out, keys[1] if len(keys) > 1 else out,
        scale, 4.0 * (m + 12) * eps, 4.0 * (D + 4) * eps, HQ, G, M,
        sbp, sbh, sbs, sqp, sqh, t[0][1], t[0][2], t[0][3], t[1][1], t[1][2], t[1][3],
        H=H, P=P, D=D, MD=m, BLOCK_D=next_pow2(D), num_warps=4,
        HAS_ALIBI=slopes is not None, KEYS=len(tables), PER_HEAD=t[0][0] != H, PER_HEAD2=t[1][0] != H, **cfg,
    )
    return out, keys
