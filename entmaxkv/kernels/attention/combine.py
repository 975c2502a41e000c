"""Pass 4 of the attention: the split partials merged into the output."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import pdl_start, poll_start


@triton.jit
def _attn_combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, tau_ptr, out_ptr, done_ptr,
    pscale, stride_ob, stride_oh, HQ,
    NSPLIT: tl.constexpr, NS_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTMAX: tl.constexpr, SCALED: tl.constexpr, POLL: tl.constexpr, POLLS: tl.constexpr, PDL: tl.constexpr,
):
    """Merge a row's NSPLIT partials into its output (softmax: by their
    maxima and sums; entmax: a sum, times pscale when SCALED: 1.5-entmax's
    partials are of p / (alpha-1)^2, shifted_prob). POLL as _attn_finish_kernel's."""
    i_r = tl.program_id(0).to(tl.int64)
    if POLL:
        poll_start(done_ptr + i_r, NSPLIT, POLLS, PDL)
    else:
        pdl_start(PDL)
    o_s = tl.arange(0, NS_P2)
    m_s = o_s < NSPLIT
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_acc = tl.load(pacc_ptr + (i_r * NSPLIT + o_s)[:, None] * D + o_d[None, :],
                    mask=m_s[:, None] & m_d[None, :], other=0.0)
    if SOFTMAX:
        b_m = tl.load(pm_ptr + i_r * NSPLIT + o_s, mask=m_s, other=float("-inf"))
        b_l = tl.load(pl_ptr + i_r * NSPLIT + o_s, mask=m_s, other=0.0)
        m = tl.max(b_m, axis=0)
        empty = m == float("-inf")
        m_use = tl.where(empty, 0.0, m)
        w = tl.exp(b_m - m_use)
        l = tl.sum(w * b_l, axis=0)
        l_use = tl.where(empty, 1.0, l)
        b_o = tl.sum(w[:, None] * b_acc, axis=0) / l_use
        b_o = tl.where(empty, 0.0, b_o)
        tau = tl.where(empty, float("inf"), m_use + tl.log(l_use))
        tl.store(tau_ptr + i_r, tau)
    else:
        b_o = tl.sum(b_acc, axis=0)
        if SCALED:
            b_o = b_o * pscale
    i_b = i_r // HQ
    i_h = i_r % HQ
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_d, b_o.to(out_ptr.dtype.element_ty), mask=m_d)
