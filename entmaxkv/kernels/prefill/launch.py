"""``causal_attention``: argument checks, tile choice and the launch of the
fused causal prefill kernels (flash.py), plus their ``PrefillConfig``.

Nothing here reads a tensor value on the host: every choice is made from
shapes, dtypes, the device and Python numbers, so a call can be captured in
a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..._checks import as_bool, as_float, as_int, describe
from ...layout import STORAGE_DTYPES
from ...limits import POSITION_MAX, check_alpha, effective_alpha
from .._common import as_slopes, beta_kind, cdiv, dot_flags, interpreting, next_pow2
from .flash import _prefill_key_norm_kernel, _prefill_entmax_kernel, _prefill_softmax_kernel

__all__ = ["PrefillConfig", "causal_attention", "causal_attention_passes", "head_dim_supported"]


def head_dim_supported(D: int) -> bool:
    """Head dims: multiples of 8 in [16, 256]; those that are not a power of
    two (24, 40, 48, 80, 96, 112, 192, ...) are padded to the next one in
    registers."""
    return 16 <= D <= 256 and D % 8 == 0


def _pow2_or_auto(value, name: str, lo: int, hi: int) -> None:
    v = as_int(value, name, lo=0, hi=hi)
    if v and (v < lo or v & (v - 1)):
        raise ValueError(f"{name}: expected 0 (automatic) or a power of two in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class PrefillConfig:
    """Launch choices and solver settings of ``causal_attention``.

    Attributes:
        block_m: query rows per program (0: chosen from the head dim and the
            kind of attention); a power of two in [16, 256].
        block_n: keys per tile (0: automatic); a power of two in [16, 256].
            It is also the number of "slot tops" whose threshold seeds the
            entmax solve: more slots, a better seed.
        num_warps: warps per program (0: automatic); 1, 2, 4, 8 or 16.
        num_stages: software-pipeline stages of the key loops (0: automatic).
        max_passes: the most solve passes (each one read of the row's keys)
            an entmax program makes after its max pass; the rows still
            unfinished then take the corrected output of the last pass.
        tol: a row of general alpha finishes once |sum_j p_j(t) - 1| <= tol
            at its current threshold t (its output error is then a few tol,
            relative); alpha = 1.5 and 2 finish earlier, as soon as the
            support is exact.
        seed_iters: in-register Newton steps on the slot tops (the seed).
        fuse_output: entmax accumulates the output during the solve passes
            (two or three sum_j w_j v_j per pass, so the pass that finds a
            row's threshold also gives its output) instead of in one output
            pass after them: one key pass fewer, heavier passes (registers).
        alibi_skip: with positive ALiBi slopes, skip key blocks whose bound
            (scale |q| max|k| + slope (j - p)) proves they carry no weight.
        softmax_drop: for softmax, the skip's cut-off below the row max in
            natural-log units: every skipped key has weight below
            exp(-softmax_drop) times the largest (far below float32 rounding
            of the sum at the default).
    """

    block_m: int = 0
    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0
    max_passes: int = 32
    tol: float = 1e-6
    seed_iters: int = 8
    fuse_output: bool = False
    alibi_skip: bool = True
    softmax_drop: float = 40.0

    def __post_init__(self) -> None:
        _pow2_or_auto(self.block_m, "block_m", 16, 256)
        _pow2_or_auto(self.block_n, "block_n", 16, 256)
        if as_int(self.num_warps, "num_warps", lo=0, hi=16) not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 0 (automatic) or 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        as_int(self.num_stages, "num_stages", lo=0, hi=8)
        as_int(self.max_passes, "max_passes", lo=1, hi=1000)
        as_float(self.tol, "tol", lo=0.0, hi=1e-2, lo_open=True)
        as_int(self.seed_iters, "seed_iters", lo=0, hi=64)
        as_bool(self.fuse_output, "fuse_output")
        as_bool(self.alibi_skip, "alibi_skip")
        as_float(self.softmax_drop, "softmax_drop", lo=20.0, hi=1e4)


DEFAULT = PrefillConfig()


def _tiles(cfg: PrefillConfig, block_d: int, dtype: torch.dtype, alpha: float) -> Tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages): the config's, or by head dim,
    dtype and kind of attention. The automatic choices are the largest tiles
    that ptxas compiles for sm_90 without register spills (float32, whose
    dots take three tf32 products, spills a little at head dims >= 128)."""
    f32 = dtype == torch.float32
    if interpreting():
        auto = (16, 16, 1, 1)
    elif alpha == 1.0:
        if block_d > 128:
            auto = (64, 32, 8, 1)
        elif f32:
            auto = (64, 64, 4, 2) if block_d <= 64 else (64, 32, 8, 2)
        else:
            auto = (128, 64, 8, 2)
    else:
        if block_d > 128:
            auto = (64, 32, 8, 1)
        elif f32 and block_d > 64:
            auto = (64, 32, 4, 1)
        elif block_d <= 64 and not f32 and beta_kind(alpha) and not cfg.fuse_output:
            auto = (64, 128, 8, 2)  # 128 slot tops: a closer seed
        else:
            auto = (64, 64, 8, 2)
    return tuple(c or a for c, a in zip((cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), auto))


def _check_tensor(x, name: str, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in STORAGE_DTYPES:
        raise ValueError(f"{name}: expected a float16/bfloat16/float32 tensor {what}, got {describe(x)}")
    if x.shape[3] and x.stride(3) != 1:
        raise ValueError(f"{name}: expected a contiguous head-dim axis (stride 1), got strides {tuple(x.stride())}")
    return x


def _check(q, k, v, alpha, scale, slopes, config, out):
    """Every argument checked (ValueError naming it); returns (alpha, scale, config)."""
    _check_tensor(q, "q", "[B, H, Tq, D]")
    B, H, Tq, D = q.shape
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        raise ValueError(f"q: expected a CUDA tensor (CPU tensors run only under Triton's interpreter, "
                         f"TRITON_INTERPRET=1), got one on {q.device}")
    if not head_dim_supported(D):
        raise ValueError(f"q: expected a head dim D that is a multiple of 8 in [16, 256] (those between powers "
                         f"of two are padded to the next), got D = {D}")
    _check_tensor(k, "k", f"[B={B}, KV, Tk, D={D}]")
    if k.dtype != q.dtype or k.device != q.device or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected a {q.dtype} tensor [B={B}, KV, Tk, D={D}] on {q.device}, "
                         f"got {describe(k)} on {k.device}")
    KV, Tk = k.shape[1], k.shape[2]
    if KV < 1 or H % KV:
        raise ValueError(f"k: expected a number of KV heads that divides H = {H} (GQA), got KV = {KV}")
    if Tq > Tk:
        raise ValueError(f"q: expected at most Tk = {Tk} queries (they are the last Tq of the keys), got Tq = {Tq}")
    if Tk > POSITION_MAX:
        raise ValueError(f"k: expected at most {POSITION_MAX} keys (positions are exact in float32), got Tk = {Tk}")
    _check_tensor(v, "v", f"of k's shape {tuple(k.shape)}")
    if v.shape != k.shape or v.dtype != q.dtype or v.device != q.device:
        raise ValueError(f"v: expected a {q.dtype} tensor of k's shape {tuple(k.shape)} on {q.device}, "
                         f"got {describe(v)} on {v.device}")
    alpha = effective_alpha(check_alpha(alpha))
    scale = as_float(scale, "scale", lo=0.0, lo_open=True)
    if slopes is not None and (not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point()
                               or tuple(slopes.shape) != (H,) or slopes.device != q.device):
        raise ValueError(f"slopes: expected None or a float tensor of shape ({H},) on {q.device}, got "
                         f"{describe(slopes)}" + (f" on {slopes.device}" if isinstance(slopes, torch.Tensor) else ""))
    if config is None:
        config = DEFAULT
    elif not isinstance(config, PrefillConfig):
        raise ValueError(f"config: expected a PrefillConfig or None, got {describe(config)}")
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                or out.device != q.device or (D and out.stride(3) != 1)):
            raise ValueError(f"out: expected a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device} with a "
                             f"contiguous head-dim axis, got {describe(out)}")
    return alpha, scale, config


def _key_norms(k: torch.Tensor) -> torch.Tensor:
    """max_j ||k_j|| per (batch, KV head): float32 [B * KV]."""
    B, KV, Tk, D = k.shape
    block_t = 64
    nblk = cdiv(Tk, block_t)
    part = torch.empty((B * KV, nblk), dtype=torch.float32, device=k.device)
    _prefill_key_norm_kernel[(B * KV, nblk)](
        k, part, Tk, nblk, KV, k.stride(0), k.stride(1), k.stride(2),
        D=D, BLOCK_D=next_pow2(D), BLOCK_T=block_t, num_warps=4)
    return part.amax(dim=1)


def _run(q, k, v, alpha, scale, slopes, config, out, record: bool):
    alpha, scale, cfg = _check(q, k, v, alpha, scale, slopes, config, out)
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax = alpha == 1.0
    log2e = math.log2(math.e)  # softmax works in base-2 exponents (exp2)
    block_d = max(16, next_pow2(D))
    bm, bn, warps, stages = _tiles(cfg, block_d, q.dtype, alpha)
    nm = cdiv(Tq, bm)
    passes = torch.ones((B * H, nm), dtype=torch.int32, device=q.device) if record else None
    if B * H * Tq == 0:
        return out, passes
    dev = q.device
    sl = as_slopes(slopes, H, dev)
    skip = slopes is not None and cfg.alibi_skip
    kmax = _key_norms(k) if skip else sl
    dot_f32, prec = dot_flags(q.dtype)
    if dot_f32 and not interpreting():
        prec = "tf32x3"  # float32 scores to ~1e-6 on the tensor cores ("ieee" dots spill at these tiles)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    common = dict(D=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, HAS_ALIBI=slopes is not None, SKIP=skip,
                  DOT_F32=dot_f32, PREC=prec, num_warps=warps, num_stages=stages)
    grid = (B * H * nm,)
    if softmax:
        _prefill_softmax_kernel[grid](
            q, k, v, out, sl, kmax, scale * log2e, log2e, cfg.softmax_drop * log2e, Tq, Tk, H, H // KV,
            *strides, **common)
    else:
        am1 = alpha - 1.0
        _prefill_entmax_kernel[grid](
            q, k, v, out, sl, kmax, passes if record else sl, scale * am1, am1, 1.0 / am1, cfg.tol,
            Tq, Tk, H, H // KV, *strides,
            BETA_KIND=beta_kind(alpha), FORM=1 if alpha < 1.5 else 0, SEED_ITERS=cfg.seed_iters,
            MAX_ITERS=cfg.max_passes, FUSED=cfg.fuse_output, RECORD=record, **common)
    return out, passes


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config: Optional[PrefillConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal softmax or alpha-entmax attention of the last Tq of Tk positions.

    Query i sits at position p = Tk - Tq + i (a whole prompt when Tq == Tk,
    or a chunk after Tk - Tq cached tokens) and attends to keys 0..p with
    scores s_j = scale * q.k_j + slope_h * (j - p) (docs/spec.md §2);
    ``alpha == 1``: p = softmax(s), else alpha-entmax (docs/spec.md §1),
    exact: the threshold is solved to float32 precision (PrefillConfig.tol
    for alpha other than 1.5 and 2). No Tq x Tk tensor is formed.

    Args:
        q: [B, H, Tq, D] float16 / bfloat16 / float32, on CUDA (or the CPU
            under Triton's interpreter). D: a multiple of 8 in [16, 256].
        k, v: [B, KV, Tk, D], q's dtype and device, Tk >= Tq, KV dividing H
            (query head h reads KV head h // (H // KV)). Any strides with a
            contiguous head-dim axis.
        alpha: in [1, 4] (1: softmax; 1.5: entmax-1.5; 2: sparsemax).
        scale: score scale > 0 (1 / sqrt(D) usually).
        slopes: optional float [H] ALiBi slopes (0: no positional bias for
            that head); None: no bias.
        config: a PrefillConfig (None: the defaults).
        out: optional [B, H, Tq, D] in q's dtype to write into.

    Returns:
        [B, H, Tq, D] in q's dtype (``out`` when given); computed in float32.

    Raises:
        ValueError naming the argument for any shape, dtype, device or range
        outside the above.
    """
    return _run(q, k, v, alpha, scale, slopes, config, out, False)[0]


def causal_attention_passes(q, k, v, *, alpha, scale, slopes=None, config=None, out=None):
    """``causal_attention`` that also returns how many times each program
    read its keys: (out, passes int32 [B * H, ceil(Tq / block_m)]), 1 for
    softmax; for entmax the max pass, the solve passes and the output pass
    (none with PrefillConfig.fuse_output). Benchmarks and tests report it."""
    return _run(q, k, v, alpha, scale, slopes, config, out, True)
