"""Helpers shared by the kernel files: launch heuristics and small jit functions.

Nothing here reads a GPU value on the host; every heuristic looks only at
shapes, dtypes and the device's multiprocessor count.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

from ..limits import FLOAT64_ABOVE, SOFTMAX_BELOW
from ..workspace import TORCH_ALLOC


try:  # grid dependency control (programmatic dependent launch), Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

# Module constants below are read by jit functions as globals: fixed at
# compile time, so they are not KernelConfig fields.

# Memory order of the selections' atomics (a row's page-count reservation,
# the certificate's violation flag). Nothing in the same launch reads what
# they order; later launches see every write at the kernel boundary. Triton's
# default (acq_rel) put a MEMBAR.GPU before each of them.
ATOMIC_SEM = tl.constexpr("relaxed")


# (Process state, not a setting.) Calls of launch_opts so far in this process: every function that launches
# step kernels takes its options there before launching. A Selection's
# pending counters are polled only by an attention with no such call since
# the selection's own (launch_count, types.Pending).
_LAUNCHES = 0


def launch_count() -> int:
    """Calls of launch_opts so far (see _LAUNCHES)."""
    return _LAUNCHES


def launch_opts(device: torch.device, pdl: bool) -> dict:
    """Launch keywords of a step kernel: its PDL constexpr and, when on,
    Triton's ``launch_pdl`` option (the two must agree: a PDL launch whose
    kernel does not wait could read its predecessor's output early).

    ``pdl`` (KernelConfig.pdl) asks for programmatic dependent launch: a
    kernel's programs may be scheduled while its predecessor drains, then
    wait (gdc_wait) for it before touching memory. It stays off on the
    interpreter, before Hopper and when Triton lacks it."""
    global _LAUNCHES
    _LAUNCHES += 1
    on = (pdl and gdc_wait is not None and not interpreting() and device.type == "cuda"
          and _capability(device)[0] >= 9)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@functools.lru_cache(maxsize=None)
def _cap(index: int):
    return torch.cuda.get_device_capability(index)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(device: torch.device):
    return _cap(_device_index(device))


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a step kernel: with PDL, wait for the previous
    kernel (and so, transitively, every earlier one) to complete, then let
    the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def grid_ids(SWAP: tl.constexpr):
    """(program_id(0), program_id(1)) of a 2-D grid, or with SWAP those of
    the same grid launched transposed: programs start in program_id(0)
    order first, so a transposed launch starts the second index's items
    one after another (batch rows of the keys pass, rows of the split pass,
    in the order they become ready)."""
    a = tl.program_id(0)
    b = tl.program_id(1)
    if SWAP:
        a, b = b, a
    return a, b


@triton.jit
def wait_count(cnt_ptr, target, POLLS: tl.constexpr, PDL: tl.constexpr):
    """Wait until the int32 counter at cnt_ptr reaches target: volatile
    loads (no read-modify-write traffic while the producers run), then one
    acquire, after which what they stored before raising it is visible.
    After POLLS loads short of it, wait for the whole previous grid instead
    (with PDL; without, that grid had ended before this one began), so the
    result is never read early."""
    c = tl.load(cnt_ptr, volatile=True)
    k = 0
    while (c < target) & (k < POLLS):
        c = tl.load(cnt_ptr, volatile=True)
        k += 1
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if PDL:
        if c < target:
            gdc_wait()


@triton.jit
def poll_start(cnt_ptr, target, POLLS: tl.constexpr, PDL: tl.constexpr):
    """First statement of a kernel that waits for its own row's producers
    instead of the whole previous grid (pdl_start's other form): let the
    next launch be scheduled, then wait_count. Sound only where the
    producers are programs of earlier launches that have all begun before
    this one was scheduled (a PDL launch is scheduled once every program of
    the launch before has let it), so the polls always end."""
    if PDL:
        gdc_launch_dependents()
    wait_count(cnt_ptr, target, POLLS, PDL)


@triton.jit
def publish(cnt_ptr):
    """Raise the int32 counter at cnt_ptr by one once every thread of this
    program has stored its results (a barrier, then one release atomic)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Inline PTX is available (CUDA, not the interpreter nor ROCm); fixed at compile time.
INLINE_PTX = tl.constexpr(not interpreting() and torch.version.hip is None)


@triton.jit
def store_b32(ptr, val, mask, AS_IS: tl.constexpr):
    """tl.store of 32-bit values; with AS_IS (and inline PTX) one st.global
    per element in the layout ``val`` already has: Triton re-lays a store's
    value out through shared memory (two barriers) when its layout does not
    vectorise along the pointer's contiguous axis."""
    if AS_IS and INLINE_PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a small fixed number on the CPU interpreter)."""
    if device.type == "cuda":
        return _sm_count(_device_index(device))
    return 4


def dot_flags(dtype: torch.dtype):
    """(DOT_F32, PRECISION) for tl.dot on operands stored as ``dtype``.

    float32 operands use full-precision ("ieee") products; float16/bfloat16
    use the tensor cores with float32 accumulation (products of two 11-/8-bit
    mantissas are exact in float32). Triton's CPU interpreter mishandles
    bfloat16 dots, so there every dot is done in float32.
    """
    if dtype == torch.float32 or interpreting():
        return True, "ieee"
    return False, "tf32"


def kv_strides(cache):
    """Element strides (page, head, row) of k_pages and v_pages; the last dim must be contiguous."""
    for name in ("k_pages", "v_pages"):
        t = getattr(cache, name)
        if t.stride(-1) != 1:
            raise ValueError(f"cache.{name}: the head_dim axis must be contiguous")
    k, v = cache.k_pages, cache.v_pages
    return (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))


def as_slopes(slopes, HQ: int, device, ws=None) -> torch.Tensor:
    """float32 [HQ] slopes (an unread 1-element dummy when there are none,
    from ``ws``: no fill is launched for it)."""
    if slopes is None:
        return alloc(ws).empty(1, torch.float32, device)
    return slopes.to(device=device, dtype=torch.float32).contiguous()


def alloc(ws):
    """Where a launcher takes its scratch tensors: the workspace ``ws``
    (``entmaxkv.workspace.Workspace``) or, without one, ``torch.empty``."""
    return TORCH_ALLOC if ws is None else ws


def kernel_alpha(alpha) -> float:
    """alpha as the attention kernels run it: a Python float >= 1, with
    alpha - 1 < limits.SOFTMAX_BELOW taken as softmax (1.0), as decode does,
    so direct callers of the kernels get the same numbers. Raises ValueError
    (naming alpha) for alpha < 1, NaN or infinite."""
    a = float(alpha)
    if not (1.0 <= a < float("inf")):
        raise ValueError(f"alpha: expected a finite number >= 1, got {alpha!r}")
    return 1.0 if a - 1.0 < SOFTMAX_BELOW else a


def entmax_form(alpha: float) -> int:
    """How the entmax kernels build the threshold and the probabilities
    (alpha > 1; the FORM constexpr of the attention passes):

    0: float32, p = [(alpha-1)(s - m) - t]_+^beta (m the row max of the kept
       scores s, t in [-1, -n^(1-alpha)]);
    1: near alpha = 1 (alpha < 1.5), float32 in r = t + 1 (small, so not
       lost next to the 1): p = exp(beta log1p((alpha-1)(s - m) - r));
    2: alpha > limits.FLOAT64_ABOVE: as 0, in float64 (the support clusters
       within ~n^(1-alpha) of the max, finer than float32 resolves).
    """
    if alpha > FLOAT64_ABOVE:
        return 2
    if alpha < 1.5:
        return 1
    return 0


def split_f32(x: float):
    """(hi, lo): float32 values with hi + lo = x to ~48 bits (a float64
    scalar for a kernel, whose Python float arguments are float32)."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def beta_kind(alpha: float) -> int:
    """0: general alpha; 1: sparsemax (beta = 1); 2: 1.5-entmax (beta = 2)."""
    if alpha == 2.0:
        return 1
    if alpha == 1.5:
        return 2
    return 0


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


@triton.jit
def query_offset(n, pos_ptr, seq, HAS_POS: tl.constexpr):
    """(qoff, qpos) of cache row ``seq`` of length n: the query's position
    relative to the row's first stored token, and its global position
    (the largest |relative position|). Without a position table (HAS_POS
    False) the row holds positions 0 .. n-1: both are n - 1. With one
    (int32 [rows, 2]: query position, position of the first stored token),
    the row is a shard of a longer sequence (``layout.PagedKV.positions``)."""
    if HAS_POS:
        qpos = tl.load(pos_ptr + seq * 2)
        base = tl.load(pos_ptr + seq * 2 + 1)
        return qpos - base, qpos
    else:
        return n - 1, n - 1


@triton.jit
def rel_pos(local, qoff, P: tl.constexpr, PSTRIDE: tl.constexpr):
    """Position relative to the query (int) of stored token ``local`` (a
    row's token index, page-major): consecutive pages of the row lie
    PSTRIDE positions apart (P, or P x ranks for an interleaved shard)."""
    if PSTRIDE != P:
        local = local + (local // P) * (PSTRIDE - P)
    return local - qoff


def pos_args(cache) -> dict:
    """The position table of ``cache`` as launch arguments: pos_ptr (int32
    [rows, 2], or an unread stand-in), HAS_POS and PSTRIDE."""
    pos = getattr(cache, "positions", None)
    if pos is None:
        return dict(pos_ptr=cache.seq_lens, HAS_POS=False, PSTRIDE=cache.page_size)
    stride = getattr(cache, "pos_stride", None) or cache.page_size
    return dict(pos_ptr=pos, HAS_POS=True, PSTRIDE=int(stride))


def no_positions(cache, what: str) -> None:
    """Refuse a shard with a position table in a launcher whose kernels read
    local positions (only the scoring and attention kernels take one)."""
    if getattr(cache, "positions", None) is not None:
        raise ValueError(f"cache: {what} does not take a position table (a context-parallel shard); "
                         "entmaxkv.distributed selects pages itself")


@triton.jit
def entmax_pows(u, beta, BETA_KIND: tl.constexpr):
    """(u^beta, u^(beta-1)) for u >= 0, exact zeros where u == 0."""
    on = u > 0
    if BETA_KIND == 1:
        p0 = u
        p1 = on.to(tl.float32)
    elif BETA_KIND == 2:
        p0 = u * u
        p1 = u
    else:
        us = tl.where(on, u, 1.0)
        p0 = tl.where(on, tl.exp2(beta * tl.log2(us)), 0.0)
        p1 = tl.where(on, p0 / us, 0.0)
    return p0, p1


@triton.jit
def entmax_prob(u, beta, BETA_KIND: tl.constexpr):
    """p = u^beta for u >= 0 (u = [(alpha-1) s - tau]_+)."""
    if BETA_KIND == 1:
        p = u
    elif BETA_KIND == 2:
        p = u * u
    else:
        on = u > 0
        us = tl.where(on, u, 1.0)
        p = tl.where(on, tl.exp2(beta * tl.log2(us)), 0.0)
    return p


@triton.jit
def to_f64(x):
    """A float32 scalar argument as float64 (Python floats on the interpreter too)."""
    return x + tl.zeros([], tl.float64)


@triton.jit
def log1p_f32(w):
    """log(1 + w) for float32 w > -1, accurate near 0 where log(1 + w) is
    not: the rounding of 1 + w is divided out (u - 1 is exact)."""
    u = 1.0 + w
    um1 = u - 1.0
    return tl.where(um1 == 0.0, w, tl.log(u) * (w / tl.where(um1 == 0.0, 1.0, um1)))


@triton.jit
def shifted_prob(b_s, m, thr, am1, beta, am1_lo, BETA_KIND: tl.constexpr, FORM: tl.constexpr):
    """Entmax probabilities (float32) of scores b_s (-inf: none) of a row
    whose kept maximum is m, from its shifted threshold thr (entmax_form):

    FORM 0, BETA_KIND 1/2: thr = T in score units, p = [s - m - T]_+^beta,
      which for 1.5-entmax is p / (alpha-1)^2 (the caller scales the sum);
    FORM 0, BETA_KIND 0: thr = t, p = [(alpha-1)(s - m) - t]_+^beta;
    FORM 1: thr = r = t + 1, p = exp(beta log1p((alpha-1)(s - m) - r));
    FORM 2: thr = t in float64, (alpha-1) = am1 + am1_lo, in float64.
    s - m is taken before any scaling: it is exact near the max (the only
    place p > 0) and cannot overflow where (alpha-1) s would."""
    if FORM == 2:
        a64 = to_f64(am1) + to_f64(am1_lo)
        u = a64 * (b_s.to(tl.float64) - m.to(tl.float64)) - thr
        on = u > 0
        p = tl.where(on, tl.exp(tl.log(tl.where(on, u, 1.0)) / a64), 0.0).to(tl.float32)
    elif FORM == 1:
        w = am1 * (b_s - m) - thr
        on = w > -1.0
        p = tl.where(on, tl.exp(beta * log1p_f32(tl.where(on, w, 0.0))), 0.0)
    elif BETA_KIND == 0:
        p = entmax_prob(tl.maximum(am1 * (b_s - m) - thr, 0.0), beta, 0)
    else:
        p = entmax_prob(tl.maximum((b_s - m) - thr, 0.0), beta, BETA_KIND)
    return p
