"""Page scoring from key metadata: Quest bounds and Gaussian page statistics.

Reference: ``entmaxkv.scoring.quest_bounds`` / ``gaussian_stats``. Shapes:
B batch, HQ query heads, H KV heads, G = HQ // H, NG query heads per program
(G, or 1 per query head), M logical pages (``cache.max_pages_per_seq``),
P page size, D head dim.

One program scores BLOCK_M logical pages of one (batch row, KV head) for all
its query heads, reading each page's metadata once through the block table:

    u_p   = scale * (relu(q).kmax_p + min(q, 0).kmin_p) + max_j slope (j - pos_q)
    mu_p  = scale * q.kmean_p + slope (mean position - pos_q)
    var_p = scale^2 * (q^2).(kstd_p^2) + slope^2 (n_p^2 - 1) / 12

The jit helpers ``page_bounds`` and ``page_gauss`` are reused by the fused
selection kernels (topk/chain.py, gaussian/stats.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .config import resolve
from ._common import alloc, as_slopes, dot_flags, interpreting, next_pow2, pos_args, query_offset, rel_pos

# ---------------------------------------------------------------------------
# heuristics
# ---------------------------------------------------------------------------


def score_plan(NG: int, D: int, q_dtype, cache_dtype) -> dict:
    """Block sizes for page scoring (tl.dot once 3+ heads share a page)."""
    use_dot = NG >= 3
    block_d = next_pow2(D)
    if use_dot:
        block_g = max(16, next_pow2(NG))
        block_d = max(16, block_d)
        block_m = max(16, min(128, 8192 // block_d))
    else:
        block_g = next_pow2(NG)
        block_m = max(16, min(256, 8192 // (block_g * block_d)))
    if interpreting():
        block_m = min(block_m, 64)
    dot_f32, prec = dot_flags(cache_dtype)
    if q_dtype != cache_dtype:
        dot_f32, prec = True, "ieee"
    return dict(USE_DOT=use_dot, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_M=block_m,
                DOT_F32=dot_f32, PREC=prec)


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


@triton.jit
def _gdot(b_a, b_b, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """[BLOCK_G, BLOCK_D] x [BLOCK_M, BLOCK_D] -> [BLOCK_G, BLOCK_M] (float32).

    b_a and b_b are exact in b_b's storage dtype (or DOT_F32 is set)."""
    if USE_DOT:
        if DOT_F32:
            b_o = tl.dot(b_a.to(tl.float32), tl.trans(b_b.to(tl.float32)), input_precision=PREC)
        else:
            b_o = tl.dot(b_a.to(b_b.dtype), tl.trans(b_b))
    elif b_a.shape[0] == 1:
        # one head: a 2-D product reduced along d keeps d within a thread's
        # registers; the 3-D broadcast below spreads d over the lanes (layout
        # conversions through shared memory and ~14x the shuffles)
        b_o = tl.sum(b_b.to(tl.float32) * b_a.to(tl.float32), axis=1)[None, :]
    else:
        b_o = tl.sum(b_a.to(tl.float32)[:, None, :] * b_b.to(tl.float32)[None, :, :], axis=2)
    return b_o


@triton.jit
def _gdot_f32(b_a, b_b, LOW: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
              PREC: tl.constexpr):
    """Like _gdot for float32 operands that are *not* exact in the storage
    dtype: three low-precision dots on hi/lo splits (~2^-16 relative error)."""
    if USE_DOT:
        if DOT_F32:
            b_o = tl.dot(b_a, tl.trans(b_b), input_precision=PREC)
        else:
            a_hi = b_a.to(LOW)
            a_lo = (b_a - a_hi.to(tl.float32)).to(LOW)
            b_hi = b_b.to(LOW)
            b_lo = (b_b - b_hi.to(tl.float32)).to(LOW)
            b_o = tl.dot(a_hi, tl.trans(b_hi)) + tl.dot(a_hi, tl.trans(b_lo)) + tl.dot(a_lo, tl.trans(b_hi))
    elif b_a.shape[0] == 1:  # one head: see _gdot
        b_o = tl.sum(b_b * b_a, axis=1)[None, :]
    else:
        b_o = tl.sum(b_a[:, None, :] * b_b[None, :, :], axis=2)
    return b_o


@triton.jit
def page_rows(bt_ptr, seq, n, o_m, M, P: tl.constexpr):
    """Physical page (int64), valid mask and valid-token count of logical pages o_m."""
    m_m = o_m < M
    first = o_m * P
    n_tok = tl.minimum(tl.maximum(n - first, 0), P)
    m_v = m_m & (n_tok > 0)
    phys = tl.load(bt_ptr + seq * M + o_m, mask=m_v, other=0).to(tl.int64)
    return phys, m_v, n_tok


@triton.jit
def page_bounds(b_q, b_sl, kmin_ptr, kmax_ptr, phys, m_v, n_tok, rel0, qpos, kvh, scale,
                stride_mp, stride_mh,
                P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ALIBI: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                WITH_SLACK: tl.constexpr = False):
    """Quest bounds u [BLOCK_G, BLOCK_M] (float32, -inf on invalid pages) and,
    with WITH_SLACK, the reference's rounding allowance (``bound_slack``;
    zeros otherwise): 4 (D + 4) eps (scale |q|.max(|kmin|, |kmax|) + |slope| (qpos + 2)).
    rel0 [BLOCK_M]: each page's first token's position relative to the query
    (``rel_pos``); qpos: the query's position."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_p = phys * stride_mp + kvh * stride_mh
    m_k = m_v[:, None] & m_d[None, :]
    b_kmax = tl.load(kmax_ptr + o_p[:, None] + o_d[None, :], mask=m_k, other=0.0)
    b_kmin = tl.load(kmin_ptr + o_p[:, None] + o_d[None, :], mask=m_k, other=0.0)
    # the positive / negative parts by tl.where, not tl.maximum / tl.minimum,
    # which may drop a NaN: a NaN query keeps NaN bounds, as torch.clamp in
    # the reference (scoring.quest_bounds) gives, so top-k ranks them last
    b_qp = tl.where(b_q < 0.0, 0.0, b_q)
    b_qn = tl.where(b_q > 0.0, 0.0, b_q)
    b_u = _gdot(b_qp, b_kmax, USE_DOT, DOT_F32, PREC) + _gdot(b_qn, b_kmin, USE_DOT, DOT_F32, PREC)
    b_u = b_u * scale
    if HAS_ALIBI:
        rel_first = rel0.to(tl.float32)
        rel_last = (rel0 + n_tok - 1).to(tl.float32)
        b_u += tl.maximum(b_sl[:, None] * rel_first[None, :], b_sl[:, None] * rel_last[None, :])
    b_u = tl.where(m_v[None, :], b_u, float("-inf"))
    if WITH_SLACK:
        b_kabs = tl.maximum(tl.abs(b_kmax.to(tl.float32)), tl.abs(b_kmin.to(tl.float32))).to(b_kmax.dtype)
        b_mag = _gdot(tl.abs(b_q), b_kabs, USE_DOT, DOT_F32, PREC) * scale
        if HAS_ALIBI:
            b_mag += tl.abs(b_sl)[:, None] * (qpos + 2).to(tl.float32)
        b_slack = (4.0 * (D + 4) * 1.1920928955078125e-07) * b_mag
    else:
        b_slack = tl.zeros_like(b_u)
    return b_u, b_slack


@triton.jit
def load_moments(kmean_ptr, kstd_ptr, phys, m_v, kvh, stride_mp, stride_mh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, STD_F32: tl.constexpr = False):
    """k_mean, k_std [BLOCK_M, BLOCK_D] (storage dtype, k_std float32 with
    STD_F32; 0 on invalid pages) of physical pages phys."""
    o_d = tl.arange(0, BLOCK_D)
    o_p = phys * stride_mp + kvh * stride_mh
    m_k = m_v[:, None] & (o_d < D)[None, :]
    b_mean = tl.load(kmean_ptr + o_p[:, None] + o_d[None, :], mask=m_k, other=0.0)
    b_std = tl.load(kstd_ptr + o_p[:, None] + o_d[None, :], mask=m_k, other=0.0)
    if STD_F32:
        b_std = b_std.to(tl.float32)
    return b_mean, b_std


@triton.jit
def gauss_of(b_q, b_sl, b_mean, b_std, m_v, n_tok, rel0, scale,
             HAS_ALIBI: tl.constexpr,
             USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """(mu, sigma) [BLOCK_G, BLOCK_M] float32 of the page score model from
    loaded moments (``load_moments``; 0 on invalid pages); rel0 as for
    ``page_bounds``."""
    b_mu = _gdot(b_q, b_mean, USE_DOT, DOT_F32, PREC) * scale
    b_qf = b_q.to(tl.float32)
    b_sf = b_std.to(tl.float32)
    b_var = _gdot_f32(b_qf * b_qf, b_sf * b_sf, b_mean.dtype, USE_DOT, DOT_F32, PREC) * (scale * scale)
    if HAS_ALIBI:
        nf = n_tok.to(tl.float32)
        mean_pos = rel0.to(tl.float32) + (nf - 1.0) * 0.5
        b_mu += b_sl[:, None] * mean_pos[None, :]
        b_var += (b_sl * b_sl)[:, None] * (tl.maximum(nf * nf - 1.0, 0.0) / 12.0)[None, :]
    b_mu = tl.where(m_v[None, :], b_mu, 0.0)
    b_sig = tl.where(m_v[None, :], tl.sqrt(tl.maximum(b_var, 0.0)), 0.0)
    return b_mu, b_sig


@triton.jit
def page_gauss(b_q, b_sl, kmean_ptr, kstd_ptr, phys, m_v, n_tok, rel0, kvh, scale,
               stride_mp, stride_mh,
               D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ALIBI: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """(mu, sigma) [BLOCK_G, BLOCK_M] float32 of the page score model (0 on invalid pages)."""
    # k_std converted where it is loaded, as before the load / math split:
    # the plain stats loop measured 142 us before the split and 200 us after
    # it at 1x2M, and where k_std is converted was the only difference in its
    # PTX (experiments/logs/experiments.log); the prefetching stats loop keeps the
    # storage dtype in flight instead
    b_mean, b_std = load_moments(kmean_ptr, kstd_ptr, phys, m_v, kvh, stride_mp, stride_mh, D, BLOCK_D, True)
    return gauss_of(b_q, b_sl, b_mean, b_std, m_v, n_tok, rel0, scale,
                    HAS_ALIBI, USE_DOT, DOT_F32, PREC)


@triton.jit
def kv_row(q_ptr, slopes_ptr, ids_ptr, lens_ptr, i_r, stride_qb, stride_qh, G,
           H: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
           HAS_ALIBI: tl.constexpr):
    """Program row i_r = b * H + kv head -> (b, kv head, first query head,
    cache slot, length, queries [BLOCK_G, BLOCK_D], slopes [BLOCK_G])."""
    i_b = i_r // H
    kvh = i_r % H
    h0 = kvh * G
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    b_q, b_sl = load_queries(q_ptr, slopes_ptr, i_b, h0, stride_qb, stride_qh,
                             G, D, BLOCK_G, BLOCK_D, HAS_ALIBI)
    return i_b, kvh, h0, seq, n, b_q, b_sl


@triton.jit
def load_queries(q_ptr, slopes_ptr, i_b, h0, stride_qb, stride_qh,
                 NG: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_ALIBI: tl.constexpr):
    """Queries [BLOCK_G, BLOCK_D] float32 (zero rows past NG) and slopes [BLOCK_G]."""
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (h0 + o_g)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if HAS_ALIBI:
        b_sl = tl.load(slopes_ptr + h0 + o_g, mask=m_g, other=0.0)
    else:
        b_sl = tl.zeros([BLOCK_G], tl.float32)
    return b_q, b_sl


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _score_pages_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, ka_ptr, kb_ptr, pos_ptr,
    o1_ptr, o2_ptr, on_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh,
    HQ, G, M,
    H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    GAUSS: tl.constexpr, HAS_ALIBI: tl.constexpr, SLACK: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    HAS_POS: tl.constexpr, PSTRIDE: tl.constexpr,
):
    i_m = tl.program_id(1)
    i_b, kvh, h0, seq, n, b_q, b_sl = kv_row(q_ptr, slopes_ptr, ids_ptr, lens_ptr, tl.program_id(0),
                                             stride_qb, stride_qh, G, H, D, BLOCK_G, BLOCK_D, HAS_ALIBI)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
    qoff, qpos = query_offset(n, pos_ptr, seq, HAS_POS)
    rel0 = rel_pos(o_m * P, qoff, P, PSTRIDE)
    o_g = tl.arange(0, BLOCK_G)
    o_out = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
    m_out = (o_g < G)[:, None] & (o_m < M)[None, :]
    if GAUSS:
        b_mu, b_sig = page_gauss(b_q, b_sl, ka_ptr, kb_ptr, phys, m_v, n_tok, rel0, kvh, scale,
                                 stride_mp, stride_mh, D, BLOCK_D, HAS_ALIBI, USE_DOT, DOT_F32, PREC)
        tl.store(o1_ptr + o_out, b_mu, mask=m_out)
        tl.store(o2_ptr + o_out, b_sig, mask=m_out)
        if kvh == 0:
            tl.store(on_ptr + i_b.to(tl.int64) * M + o_m, n_tok.to(tl.float32), mask=o_m < M)
    else:
        b_u, b_slack = page_bounds(b_q, b_sl, ka_ptr, kb_ptr, phys, m_v, n_tok, rel0, qpos, kvh, scale,
                                   stride_mp, stride_mh, P, D, BLOCK_D, HAS_ALIBI, USE_DOT, DOT_F32, PREC,
                                   SLACK)
        tl.store(o1_ptr + o_out, b_u + b_slack, mask=m_out)


# ---------------------------------------------------------------------------
# launchers / public functions
# ---------------------------------------------------------------------------


def meta_strides(cache, pair=("k_min", "k_max")) -> Tuple[int, int]:
    """Element strides (page, head) shared by the two statistics a kernel reads
    (``pair``: k_min/k_max or k_mean/k_std), whose last dim must be contiguous."""
    ref = getattr(cache, pair[0])
    for name in pair:
        t = getattr(cache, name)
        if t.stride() != ref.stride():
            raise ValueError(f"cache.{name}: expected the strides of cache.{pair[0]}, "
                             f"got {t.stride()} and {ref.stride()}")
        if t.stride(-1) != 1:
            raise ValueError(f"cache.{name}: the head_dim axis must be contiguous")
    if cache.block_table.stride(1) != 1 or cache.block_table.stride(0) != cache.block_table.shape[1]:
        raise ValueError("cache.block_table: expected a contiguous int32 table")
    return ref.stride(0), ref.stride(1)


def prep_query(q: torch.Tensor) -> torch.Tensor:
    """q with a contiguous head_dim (float64, the oracle dtype, runs as float32)."""
    if q.dtype == torch.float64:
        q = q.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q


def _score(q, cache, seq_ids, scale, slopes, gauss: bool, slack: bool = False, ws=None):
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    M = cache.block_table.shape[1]
    cfg = score_plan(G, D, q.dtype, cache.dtype)
    smp, smh = meta_strides(cache, ("k_mean", "k_std") if gauss else ("k_min", "k_max"))
    dev = q.device
    mem = alloc(ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    o1 = mem.empty((B, HQ, M), torch.float32, dev)
    o2 = mem.empty((B, HQ, M), torch.float32, dev) if gauss else o1
    on = mem.empty((B, M), torch.float32, dev) if gauss else o1
    ka, kb = (cache.k_mean, cache.k_std) if gauss else (cache.k_min, cache.k_max)
    grid = (B * H, triton.cdiv(M, cfg["BLOCK_M"]))
    pos = pos_args(cache)
    _score_pages_kernel[grid](
        q, sl, ids, cache.seq_lens, cache.block_table, ka, kb, pos["pos_ptr"],
        o1, o2, on,
        float(scale), q.stride(0), q.stride(1), smp, smh,
        HQ, G, M,
        H=H, P=P, D=D, BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"],
        GAUSS=gauss, HAS_ALIBI=slopes is not None, SLACK=slack,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"],
        HAS_POS=pos["HAS_POS"], PSTRIDE=pos["PSTRIDE"], num_warps=4,
    )
    return o1, o2, on


def quest_bounds(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
) -> torch.Tensor:
    """Quest upper bound of every logical page's scores, per query head.

    Triton twin of ``entmaxkv.scoring.quest_bounds``.

    Args:
        q: [batch, q_heads, head_dim] float16/bfloat16/float32.
        cache: PagedKVCache (k_min/k_max [num_pages, kv_heads, D], block_table
            int32 [max_seqs, M]).
        seq_ids: int32/int64 [batch] slots on the cache device.
        scale: score scale; slopes: optional float [q_heads] ALiBi slopes.
        ws: a Workspace for the output (None: a new tensor).
    Returns:
        float32 [batch, q_heads, M]; -inf for pages past the sequence end.
    """
    resolve(config)  # (the scoring kernel has no launch choices; checked for a uniform signature)
    u, _, _ = _score(q, cache, seq_ids, scale, slopes, gauss=False, ws=ws)
    return u


def bounds_with_slack(q, cache, seq_ids, *, scale, slopes=None, ws=None) -> torch.Tensor:
    """Quest bounds plus the reference's rounding slack (``scoring.bound_slack``),
    float32 [batch, q_heads, M]: the safe bound the certificate compares."""
    u, _, _ = _score(q, cache, seq_ids, scale, slopes, gauss=False, slack=True, ws=ws)
    return u


def gaussian_stats(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
):
    """Per-page Gaussian model of a token's score (Triton twin of the reference).

    Args: as :func:`quest_bounds` (reads k_mean / k_std instead).
    Returns:
        mu, sigma: float32 [batch, q_heads, M] (0 past the end);
        n_tok: float32 [batch, M], valid tokens per page.
    """
    resolve(config)  # (no launch choices, as in quest_bounds)
    return _score(q, cache, seq_ids, scale, slopes, gauss=True, ws=ws)
