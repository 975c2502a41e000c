"""The slot-mapping cache write (Triton twin of ``entmaxkv.write``).

One launch, grid (tokens, kv_heads). The program of a page's first token in
the mapping (a *run*: consecutive tokens of one page) writes the whole run's
K/V rows of its head, then that page-head's statistics: the incremental step
for a run of one token (``stats.welford_step``: same operations, same order,
IEEE division and square root, no fused multiply-add, NaN-propagating
min/max, so the bits equal the reference's), else, or when the running
state stops being finite, the statistics recomputed from the page's rows.
Every other program returns at once. The mapping is read on the device
only: the write can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from .sketch import write_sketch

_NAN_ALL = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _stored(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to the storage dtype, to nearest even. bfloat16
    by integer arithmetic: the interpreter's cast truncates, and the
    result must be torch's bits on every backend."""
    if DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        r = tl.where(x != x, (u >> 16) | 0x40, r)  # NaN stays NaN (quiet)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, kp_ptr, vp_ptr, bounds_ptr, mom_ptr, welf_ptr,
    T, NSLOT, stride_kt, stride_kh, stride_vt, stride_vh,
    skp, skh, skr, svp, svh, svr, sbp, sbh, swp, swh,
    P: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    prev = tl.load(slot_ptr + tl.maximum(i_t - 1, 0)).to(tl.int64)
    page = slot // P
    # (a slot past the pool is never written: memory safety, not a feature)
    starts = (slot >= 0) & (slot < NSLOT) & ((i_t == 0) | (prev < 0) | (prev >= NSLOT) | (prev // P != page))
    if starts:
        # the run: the tokens after this one in the same page (at most P)
        o_r = tl.arange(0, BLOCK_P)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        s = tl.load(slot_ptr + i_t + o_r, mask=(i_t + o_r) < T, other=-1).to(tl.int64)
        same = (s >= 0) & (s < NSLOT) & (s // P == page)
        n = tl.min(tl.where(same, BLOCK_P, o_r), axis=0)  # the first token past the run
        m_r = o_r < n
        rows = tl.where(m_r, s % P, 0)
        m_rd = m_r[:, None] & m_d[None, :]
        o_tok = (i_t + o_r).to(tl.int64)
        kx = tl.load(k_ptr + o_tok[:, None] * stride_kt + i_h * stride_kh + o_d[None, :], mask=m_rd, other=0.0)
        vx = tl.load(v_ptr + o_tok[:, None] * stride_vt + i_h * stride_vh + o_d[None, :], mask=m_rd, other=0.0)
        kc = _stored(kx.to(tl.float32), kp_ptr.dtype.element_ty)  # the stored (rounded) keys
        tl.store(kp_ptr + page * skp + i_h * skh + rows[:, None] * skr + o_d[None, :], kc, mask=m_rd)
        tl.store(vp_ptr + page * svp + i_h * svh + rows[:, None] * svr + o_d[None, :],
                 _stored(vx.to(tl.float32), kp_ptr.dtype.element_ty), mask=m_rd)
        tl.debug_barrier()  # the rows just stored are read back below

        row0 = tl.sum(tl.where(o_r == 0, rows, 0), axis=0)
        count_i = tl.max(tl.where(m_r, rows, 0), axis=0) + 1  # valid rows after the write
        count = count_i.to(tl.float32)
        o_b = page * sbp + i_h * sbh  # (min, max) / (mean, std) of this page-head
        o_w = page * swp + i_h * swh  # its running (mean, M2)
        # from scratch: the page's first count rows
        m_p = (o_r < count_i)[:, None] & m_d[None, :]
        # (every comparison in float32: exact for stored values, and the
        # interpreter compares bfloat16 as raw bits)
        x = tl.load(kp_ptr + page * skp + i_h * skh + o_r[:, None] * skr + o_d[None, :], mask=m_p,
                    other=0.0).to(tl.float32)
        re_min = tl.min(tl.where(m_p, x, float("inf")), axis=0)
        re_max = tl.max(tl.where(m_p, x, float("-inf")), axis=0)
        re_mean = tl.div_rn(tl.sum(tl.where(m_p, x, 0.0), axis=0), count)
        dev = tl.where(m_p, x - re_mean[None, :], 0.0)
        re_m2 = tl.sum(dev * dev, axis=0)

        # one token: the incremental step (row 0 starts afresh)
        x1 = _stored(tl.load(k_ptr + i_t.to(tl.int64) * stride_kt + i_h * stride_kh + o_d, mask=m_d,
                             other=0.0).to(tl.float32), kp_ptr.dtype.element_ty).to(tl.float32)  # the run's first key, stored
        fresh = row0 == 0
        old_min = tl.load(bounds_ptr + o_b + o_d, mask=m_d, other=0.0).to(tl.float32)
        old_max = tl.load(bounds_ptr + o_b + D + o_d, mask=m_d, other=0.0).to(tl.float32)
        st_min = tl.where(fresh, x1, tl.minimum(old_min, x1, propagate_nan=_NAN_ALL))
        st_max = tl.where(fresh, x1, tl.maximum(old_max, x1, propagate_nan=_NAN_ALL))
        mean = tl.where(fresh, 0.0, tl.load(welf_ptr + o_w + o_d, mask=m_d, other=0.0))
        m2 = tl.where(fresh, 0.0, tl.load(welf_ptr + o_w + D + o_d, mask=m_d, other=0.0))
        delta = x1 - mean
        mean = mean + tl.div_rn(delta, count)
        m2 = m2 + delta * (x1 - mean)

        single = n == 1
        fin = ((tl.abs(mean) < float("inf")) & (tl.abs(m2) < float("inf"))) | (o_d >= D)
        ok = tl.min(fin.to(tl.int32), axis=0) == 1
        new_min = _stored(tl.where(single, st_min, re_min), kp_ptr.dtype.element_ty)
        new_max = _stored(tl.where(single, st_max, re_max), kp_ptr.dtype.element_ty)
        new_mean = tl.where(single & ok, mean, re_mean)
        new_m2 = tl.where(single & ok, m2, re_m2)
        std = tl.sqrt_rn(tl.div_rn(tl.maximum(new_m2, 0.0, propagate_nan=_NAN_ALL), count))
        tl.store(bounds_ptr + o_b + o_d, new_min, mask=m_d)
        tl.store(bounds_ptr + o_b + D + o_d, new_max, mask=m_d)
        tl.store(welf_ptr + o_w + o_d, new_mean, mask=m_d)
        tl.store(welf_ptr + o_w + D + o_d, new_m2, mask=m_d)
        tl.store(mom_ptr + o_b + o_d, _stored(new_mean, kp_ptr.dtype.element_ty), mask=m_d)
        tl.store(mom_ptr + o_b + D + o_d, _stored(std, kp_ptr.dtype.element_ty), mask=m_d)


def write_kv(kv, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton twin of ``entmaxkv.write.write_kv``: store ``k``, ``v``
    ([T, kv_heads, head_dim], head_dim contiguous) at ``slot_mapping``
    (int32/int64 [T] on the device; < 0 skips) and update the touched pages'
    statistics. One launch; no host synchronisation, no allocation.

    ``kv.k_bounds`` and ``kv.k_moments`` must share their strides; each of
    them and ``kv.welford`` must have contiguous (pair, head_dim) axes (the
    cache's and ``PagedKV.from_buffers``' buffers do; so do the views an
    engine carves out of its pages)."""
    T = slot_mapping.shape[0]
    if T == 0:
        return
    H, P, D = kv.kv_heads, kv.page_size, kv.head_dim
    (skp, skh, skr), (svp, svh, svr) = kv.k_pages.stride()[:3], kv.v_pages.stride()[:3]
    sb, sw = kv.k_bounds.stride(), kv.welford.stride()
    if kv.k_moments.stride() != sb:
        raise ValueError(f"kv.k_moments: expected the strides of kv.k_bounds {sb}, got {kv.k_moments.stride()}")
    for name, st in (("k_bounds", sb), ("welford", sw)):
        if st[2] != D or st[3] != 1:
            raise ValueError(f"kv.{name}: expected contiguous (pair, head_dim) axes, got strides {st}")
    _write_kv_kernel[(T, H)](
        k, v, slot_mapping, kv.k_pages, kv.v_pages, kv.k_bounds, kv.k_moments, kv.welford,
        T, kv.num_pages * P, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        skp, skh, skr, svp, svh, svr, sb[0], sb[1], sw[0], sw[1],
        P=P, D=D, BLOCK_P=next_pow2(P), BLOCK_D=next_pow2(D),
        num_warps=4 if P * D >= 2048 else 2, enable_fp_fusion=False,
    )
    if getattr(kv, "sketch", None) is not None:  # encode the keys just stored (same mapping)
        write_sketch(kv, slot_mapping)
