"""The decode step's elementwise work outside attention, fused (Triton twins
of ``entmaxkv.model.lm``'s PyTorch code).

A decode step moves a few rows through every layer, so its norms, rotary
embedding, SwiGLU product and residual adds are a few kilobytes each, and
their cost is the launches: the PyTorch forms take one kernel per operator
(bfloat16: RMSNorm 9, rotary 17 per tensor, SwiGLU 2, each residual add 1),
each with its fixed launch cost even replayed from a CUDA graph. Here each is one launch
(docs/prefill.md counts a bfloat16 RoPE layer: 56 launches in PyTorch, 4 here):

    add_rms_norm(x, delta, weight, eps)   r = x + delta, y = RMSNorm(r)     (y, r)
    rms_norm(x, weight, eps)              y = RMSNorm(x)                    y
    rope_qk(q, k, positions, inv_freq)    rotate-half RoPE of q and k       (q', k')
    silu_mul(gate, up)                    F.silu(gate) * up                 out

Every result is computed in float32 and rounded to the input's dtype (to
nearest even) where the PyTorch form rounds: the residual sum, SiLU before
its product, each output. So float32 results equal the PyTorch form's
up to the summation order of the norm's mean and the last ulp of exp, cos
and sin; bfloat16 / float16 ones up to the rounding those differences can
flip. No kernel reads a GPU value on the host (graph capture is safe), and
none takes the programmatic-dependent-launch switch: their neighbours in
the step are cuBLAS GEMMs, which do not take part in it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._checks import as_bool, as_float, describe
from ._common import cdiv, next_pow2
from .write import _stored  # float32 to a storage dtype, to nearest even on the interpreter too

__all__ = ["add_rms_norm", "rms_norm", "rope_qk", "silu_mul"]

_floats = (torch.float32, torch.float16, torch.bfloat16)
# A norm row is held in registers up to this many elements (one pass over
# memory); wider rows are read in chunks of it, twice.
_norm_block_max = 8192
# silu_mul's programs each take this many elements of a row.
_silu_block_max = 1024


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _residual(x_row, d_row, o, m, HAS_DELTA: tl.constexpr):
    """Elements o (mask m) of the residual row: x + delta rounded to x's
    dtype as torch's ``x + delta`` rounds it (float32 sum, one rounding),
    or x itself without delta; in x's dtype."""
    x = tl.load(x_row + o, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_row + o, mask=m, other=0.0)
        x = _stored(x.to(tl.float32) + d.to(tl.float32), x_row.dtype.element_ty)
    return x


@triton.jit
def _model_add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, y_ptr, r_ptr, N, n_f, sx, sd, sy, sr, eps,
    HAS_DELTA: tl.constexpr, STORE_R: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    """One program per row of N elements: r = x + delta (HAS_DELTA; else r =
    x), stored when STORE_R; y = r * rsqrt(mean(r^2) + eps) * weight, in
    float32, stored in y's dtype. n_f: N as a float (an int argument of 1
    is compiled in as a constant); sx, sd, sy, sr: the row strides."""
    i_r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + i_r * sx
    d_row = d_ptr + i_r * sd
    y_row = y_ptr + i_r * sy
    r_row = r_ptr + i_r * sr
    o = tl.arange(0, BLOCK)
    if CHUNKS == 1:  # the row stays in registers: one read of x and delta, one write of y and r
        m = o < N
        r = _residual(x_row, d_row, o, m, HAS_DELTA)
        if STORE_R:
            tl.store(r_row + o, r, mask=m)
        rf = r.to(tl.float32)
        ms = tl.div_rn(tl.sum(rf * rf, axis=0), n_f)
        # IEEE square root and division: torch's rsqrt is correctly rounded to ~1 ulp on the CPU,
        # the approximate forms are not
        rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + o, _stored((rf * rstd) * w, y_ptr.dtype.element_ty), mask=m)
    else:  # a wide row: sum of squares chunk by chunk, then the chunks again (r read back when stored)
        acc = tl.zeros([BLOCK], tl.float32)
        for c in range(CHUNKS):
            oc = c * BLOCK + o
            m = oc < N
            r = _residual(x_row, d_row, oc, m, HAS_DELTA)
            if STORE_R:
                tl.store(r_row + oc, r, mask=m)
            rf = r.to(tl.float32)
            acc += rf * rf
        ms = tl.div_rn(tl.sum(acc, axis=0), n_f)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        for c in range(CHUNKS):
            oc = c * BLOCK + o
            m = oc < N
            # (each thread reads back the elements it stored itself: same offsets, same layout)
            if STORE_R:
                r = tl.load(r_row + oc, mask=m, other=0.0)
            else:
                r = _residual(x_row, d_row, oc, m, HAS_DELTA)
            w = tl.load(w_ptr + oc, mask=m, other=0.0).to(tl.float32)
            tl.store(y_row + oc, _stored((r.to(tl.float32) * rstd) * w, y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_heads(src, dst, h0, NH, s_h, cos, sin, o_d, m_d, HALF: tl.constexpr, HB: tl.constexpr):
    """Rotate heads h0 .. h0 + HB - 1 (those < NH) of one token: src rows
    s_h apart, dst rows 2 * HALF apart (contiguous). cos, sin [BLOCK_HALF]."""
    o_h = h0 + tl.arange(0, HB)
    m = (o_h < NH)[:, None] & m_d[None, :]
    p = src + o_h[:, None].to(tl.int64) * s_h + o_d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # each product rounded before the sum, as torch's separate operators do (the launch turns off
    # fused multiply-add)
    out1 = x1 * c - x2 * s
    out2 = x1 * s + x2 * c
    q = dst + o_h[:, None].to(tl.int64) * (2 * HALF) + o_d[None, :]
    tl.store(q, _stored(out1, dst.dtype.element_ty), mask=m)
    tl.store(q + HALF, _stored(out2, dst.dtype.element_ty), mask=m)


@triton.jit
def _model_rope_qk_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, T, H, KV, NQB,
    sqb, sqt, sqh, skb, skt, skh, spb, spt,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr,
):
    """Grid (B * T tokens, NQB + ceil(KV / HB) head blocks): program (i, j)
    rotates query heads j * HB .. of token i (j < NQB = ceil(H / HB)), else
    key heads (j - NQB) * HB ..; outputs contiguous [B, T, H|KV, 2 * HALF].
    ang = position * inv_freq in float32, as ``rope_rotate``."""
    i_tok = tl.program_id(0).to(tl.int64)
    i_blk = tl.program_id(1)
    b = i_tok // T
    t = i_tok % T
    pos = tl.load(pos_ptr + b * spb + t * spt).to(tl.float32)
    o_d = tl.arange(0, BLOCK_HALF)
    m_d = o_d < HALF
    ang = pos * tl.load(inv_ptr + o_d, mask=m_d, other=0.0)
    # (cos and sin of a token once per program, shared by its HB heads)
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    if i_blk < NQB:
        _rope_heads(q_ptr + b * sqb + t * sqt, qo_ptr + i_tok * H * (2 * HALF), i_blk * HB, H, sqh,
                    cos, sin, o_d, m_d, HALF, HB)
    else:
        _rope_heads(k_ptr + b * skb + t * skt, ko_ptr + i_tok * KV * (2 * HALF), (i_blk - NQB) * HB, KV, skh,
                    cos, sin, o_d, m_d, HALF, HB)


@triton.jit
def _model_silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, sg, su, so, BLOCK: tl.constexpr):
    """Grid (rows, ceil(N / BLOCK)): out = silu(gate) * up over BLOCK
    elements of a row; sg, su, so: the row strides."""
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    g = tl.load(g_ptr + i_r * sg + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i_r * su + o, mask=m, other=0.0).to(tl.float32)
    # F.silu's form, x / (1 + exp(-x)), in float32 (torch's math type for the half types too);
    # exp(-x) = inf gives -0 as there
    s = tl.div_rn(g, 1.0 + tl.exp(-g))
    # F.silu returns the input's dtype and the product multiplies that rounded value
    s = _stored(s, o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + i_r * so + o, _stored(s * u, o_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------


def _check_float(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _floats:
        raise ValueError(f"{name}: expected a float32 / float16 / bfloat16 tensor, got {describe(t)}")
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty last axis, got {describe(t)}")


def _check_like(t, ref: torch.Tensor, name: str, ref_name: str) -> None:
    """t: a tensor of ref's shape, dtype and device."""
    if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor of {ref_name}'s shape {tuple(ref.shape)}, dtype {ref.dtype} "
                         f"and device {ref.device}, got {describe(t)}"
                         + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as [rows, N] with a contiguous last axis, a view when its strides allow."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last axis must be contiguous, got strides {t.stride()}")
    return t.reshape(-1, t.shape[-1])


def _vector(t, name: str, n: int, dtypes, device, what: str) -> None:
    """t: a contiguous 1-d tensor of n elements, one of ``dtypes`` (``what``
    names them), on ``device``."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != (n,) or t.device != device:
        raise ValueError(f"{name}: expected a {what} tensor of shape ({n},) on {device}, got {describe(t)}"
                         + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
    if t.stride(0) != 1 and n > 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _out_rows(t: Optional[torch.Tensor], ref: torch.Tensor, name: str, ref_name: str = "x") -> torch.Tensor:
    """A given output as [rows, N] (it must be contiguous: written through that view), else a new one."""
    if t is None:
        return torch.empty(ref.shape, dtype=ref.dtype, device=ref.device).view(-1, ref.shape[-1])
    _check_like(t, ref, name, ref_name)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    return t.view(-1, ref.shape[-1])


def _norm_warps(block: int) -> int:
    # about 16 float32 elements per thread, 1 to 16 warps
    return max(1, min(16, block // 512))


def add_rms_norm(
    x: torch.Tensor,
    delta: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    keep_residual: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Residual add and RMSNorm in one launch (the pre-norm block's seam).

    Args:
        x: [..., N] float32 / float16 / bfloat16, contiguous last axis (the
            residual stream).
        delta: x's shape and dtype (a block's output), or None: plain
            RMSNorm of x (``rms_norm``).
        weight: [N], any of the three float dtypes (the norm's gain).
        eps: a Python float >= 0, added to the mean square.
        out: optional contiguous tensor of x's shape and dtype for y.
        residual_out: optional contiguous tensor of x's shape and dtype for
            r (x itself may be passed: each row is read before it is written).
        keep_residual: False skips storing r (the last norm of a step).

    Returns:
        (y, r), both x's shape and dtype: r = x + delta rounded as torch's
        ``x + delta`` (x itself without delta, None with keep_residual
        False); y = (r.float() * rsqrt(mean(r.float() ** 2) + eps) *
        weight.float()).to(x.dtype), ``RMSNorm.forward`` of r.

    Raises:
        ValueError naming the argument for a wrong type, shape, dtype,
        device or layout.
    """
    _check_float(x, "x")
    N = x.shape[-1]
    if delta is not None:
        _check_like(delta, x, "delta", "x")
    _vector(weight, "weight", N, _floats, x.device, "float")
    eps = as_float(eps, "eps", lo=0.0)
    keep_residual = as_bool(keep_residual, "keep_residual")
    if residual_out is not None and not keep_residual:
        raise ValueError("residual_out: given with keep_residual=False")
    x2 = _rows(x, "x")
    d2 = _rows(delta, "delta") if delta is not None else x2
    y2 = _out_rows(out, x, "out")
    # without delta r is x, stored only where residual_out asks for a copy
    store_r = (delta is not None and keep_residual) or residual_out is not None
    r2 = _out_rows(residual_out, x, "residual_out") if store_r else y2  # (y2: never written)
    rows = x2.shape[0]
    if rows and N:
        block = min(next_pow2(N), _norm_block_max)
        _model_add_rms_norm_kernel[(rows,)](
            x2, d2, weight, y2, r2, N, float(N), x2.stride(0), d2.stride(0), y2.stride(0), r2.stride(0), eps,
            HAS_DELTA=delta is not None, STORE_R=store_r, BLOCK=block, CHUNKS=cdiv(N, block),
            num_warps=_norm_warps(block),
        )
    y = y2.view(x.shape)
    if not keep_residual:
        return y, None
    return y, (r2.view(x.shape) if store_r else x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``RMSNorm.forward`` in one launch: x [..., N] (float32 / float16 /
    bfloat16, contiguous last axis), weight [N] -> y in x's shape and dtype
    (``add_rms_norm`` without delta)."""
    return add_rms_norm(x, None, weight, eps, out=out, keep_residual=False)[0]


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            inv_freq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of queries and keys in one launch
    (``rope_rotate`` of both).

    Args:
        q: [B, T, H, D] float32 / float16 / bfloat16, D even, any strides
            with a contiguous last axis.
        k: [B, T, KV, D], same device and D (any of the three dtypes).
        positions: integer (int32 / int64) [B, T] or [T], on the device.
        inv_freq: float32 [D / 2] on the device: ``rope_inv_freq(D, base)``
            (entmaxkv.model.lm), the frequencies ``rope_rotate`` uses.

    Returns:
        (q', k'): new contiguous tensors of q's and k's shapes and dtypes,
        x' = [x1 cos - x2 sin, x1 sin + x2 cos] (x1, x2 the halves of the
        last axis, angle = float32(position) * inv_freq), in float32,
        rounded once. Equal to ``rope_rotate`` up to the last ulp of cos and
        sin (Triton's, not torch's), and what that can flip in the rounding.

    Raises:
        ValueError naming the argument for a wrong type, shape, dtype,
        device or layout.
    """
    for t, name in ((q, "q"), (k, "k")):
        _check_float(t, name)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a [B, T, heads, D] tensor, got {describe(t)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name}: the last axis must be contiguous, got strides {t.stride()}")
    B, T, H, D = q.shape
    if D % 2:
        raise ValueError(f"q: expected an even head dim, got {D}")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D or k.device != q.device:
        raise ValueError(f"k: expected a tensor of shape ({B}, {T}, KV, {D}) on {q.device} (q's batch, tokens and "
                         f"head dim), got {describe(k)} on {k.device}")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) \
            or tuple(positions.shape) not in ((B, T), (T,)) or positions.device != q.device:
        raise ValueError(f"positions: expected an int32 / int64 tensor of shape ({B}, {T}) or ({T},) on "
                         f"{q.device}, got {describe(positions)}"
                         + (f" on {positions.device}" if isinstance(positions, torch.Tensor) else ""))
    half = D // 2
    _vector(inv_freq, "inv_freq", half, (torch.float32,), q.device, "float32")
    KV = k.shape[2]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T == 0 or D == 0 or H + KV == 0:
        return q_out, k_out
    block_half = next_pow2(half)
    # about 1024 elements a program: a few programs per token, so one decode token still fills a few SMs
    hb = min(next_pow2(max(H, KV)), max(1, 1024 // (2 * block_half)))
    nqb = cdiv(H, hb)
    spb, spt = (positions.stride(0), positions.stride(1)) if positions.dim() == 2 else (0, positions.stride(0))
    _model_rope_qk_kernel[(B * T, nqb + cdiv(KV, hb))](
        q, k, q_out, k_out, positions, inv_freq, T, H, KV, nqb,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), spb, spt,
        HALF=half, BLOCK_HALF=block_half, HB=hb, num_warps=4, enable_fp_fusion=False,
    )
    return q_out, k_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU's product ``F.silu(gate) * up`` in one launch.

    Args:
        gate: [..., N] float32 / float16 / bfloat16, contiguous last axis.
        up: gate's shape and dtype, contiguous last axis.
        out: optional contiguous tensor of gate's shape and dtype.

    Returns:
        gate's shape and dtype: silu computed in float32 as gate / (1 +
        exp(-gate)) and rounded to the dtype, times up in float32, rounded,
        as torch does on the CPU and CUDA (for float16 / bfloat16 too: its
        silu runs in float32 and returns the input dtype). Equal to torch up
        to the last ulp of exp.

    Raises:
        ValueError naming the argument for a wrong type, shape, dtype,
        device or layout.
    """
    _check_float(gate, "gate")
    _check_like(up, gate, "up", "gate")
    g2, u2 = _rows(gate, "gate"), _rows(up, "up")
    o2 = _out_rows(out, gate, "out", "gate")
    rows, N = g2.shape
    if rows and N:
        block = min(next_pow2(N), _silu_block_max)
        _model_silu_mul_kernel[(rows, cdiv(N, block))](
            g2, u2, o2, N, g2.stride(0), u2.stride(0), o2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 2,
        )
    return o2.view(gate.shape)
