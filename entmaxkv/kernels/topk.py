"""Quest top-k page selection fused with the bound computation.

Reference: ``entmaxkv.policies.select`` with ``TopK``. Shapes: B batch,
S selection heads (H, or HQ per query head), NG = HQ // S query heads per
selection row, M logical pages, K = pages kept per row, W = selection width.

A page's rank is its largest Quest bound over the NG heads of its selection
row; forced pages (the last page, ``sinks`` first and ``window`` last pages)
rank +inf, pages past the end are never kept. Each row keeps its
max(budget // P, forced) best pages. No sort and no torch.topk:

1. ``_chunk_kernel`` (grid B*S x NCH): scores CH pages (CH = NSUB * BLOCK_M)
   from k_min/k_max, maps each rank to an int32 key with the same order,
   finds the chunk's K-th largest key by bisection on the key bits (32
   counting passes over registers) and writes at most K candidates
   (key, page). With a single chunk it writes the Selection directly.
2. ``_merge_kernel`` (grid B*S): the same bisection over the NCH * K
   candidates of a row, then the kept pages in any order (the Selection
   contract allows unsorted pages).

Both write fixed-shape buffers; nothing synchronises with the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..types import Selection
from ._common import as_slopes, cdiv, interpreting, next_pow2
from .scoring import load_queries, meta_strides, page_bounds, page_rows, prep_query, score_plan

INT32_MIN = tl.constexpr(-2147483648)

# ---------------------------------------------------------------------------
# heuristics
# ---------------------------------------------------------------------------


def topk_plan(M: int, K: int, NG: int, D: int, q_dtype, cache_dtype) -> dict:
    cfg = score_plan(NG, D, q_dtype, cache_dtype)
    block_m = cfg["BLOCK_M"]
    cap = 256 if interpreting() else 4096
    ch = max(block_m, min(cap, max(1024, next_pow2(8 * K)), next_pow2(M)))
    ch = max(ch, block_m)
    cfg.update(CH=ch, NSUB=ch // block_m, NCH=cdiv(M, ch))
    return cfg


# ---------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------


@triton.jit
def sortable_key(x):
    """float32 -> int32 whose signed order is the float order."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def kth_largest(keys, K):
    """Largest T with count(keys >= T) >= K (int64 scalar), by bisection on 32 bits."""
    lo = tl.full([], INT32_MIN, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        c = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32))
        ge = c >= K
        lo = tl.where(ge, mid, lo)
        hi = tl.where(ge, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def row_budget(n, sinks, window, k_pages, P: tl.constexpr):
    """(pages in use, pages forced, pages to keep) for a row of length n."""
    npages = (n + P - 1) // P
    wnd = tl.minimum(tl.maximum(window, 1), npages)
    sa = tl.minimum(sinks, npages)
    n_forced = sa + wnd - tl.maximum(sa - (npages - wnd), 0)
    k_row = tl.minimum(tl.maximum(n_forced, k_pages), npages)
    return npages, wnd, k_row


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _chunk_kernel(
    q_ptr, slopes_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, kmax_ptr,
    key_ptr, ck_ptr, cp_ptr, cn_ptr, ub_ptr, pages_ptr, counts_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh,
    HQ, G, M, W, sinks, window, k_pages,
    S: tl.constexpr, NG: tl.constexpr, NCH: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, WRITE_UB: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = i_r // S
    h0 = (i_r % S) * NG
    kvh = h0 // G
    CH: tl.constexpr = BLOCK_M * NSUB
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    b_q, b_sl = load_queries(q_ptr, slopes_ptr, i_b, h0, stride_qb, stride_qh,
                             NG, D, BLOCK_G, BLOCK_D, HAS_ALIBI)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < NG
    p_key = key_ptr + (i_r.to(tl.int64) * NCH + i_c) * CH

    # -- 1. bounds -> rank keys of the chunk's pages (staged through L2)
    for j in range(NSUB):
        o_m = i_c * CH + j * BLOCK_M + tl.arange(0, BLOCK_M)
        phys, m_v, n_tok = page_rows(bt_ptr, seq, n, o_m, M, P)
        b_u, b_slack = page_bounds(b_q, b_sl, kmin_ptr, kmax_ptr, phys, m_v, n_tok, o_m, n - 1, kvh,
                                   scale, stride_mp, stride_mh, P, D, BLOCK_D, HAS_ALIBI,
                                   USE_DOT, DOT_F32, PREC, WRITE_UB)
        if WRITE_UB:  # the certified policy's safe bound: u + rounding slack
            o_u = ((i_b * HQ + h0 + o_g).to(tl.int64) * M)[:, None] + o_m[None, :]
            tl.store(ub_ptr + o_u, b_u + b_slack, mask=m_g[:, None] & (o_m < M)[None, :])
        b_rank = tl.max(tl.where(m_g[:, None], b_u, float("-inf")), axis=0)
        forced = (o_m < sinks) | (o_m >= npages - wnd)
        b_rank = tl.where(forced, float("inf"), b_rank)
        b_key = tl.where(m_v, sortable_key(b_rank), INT32_MIN)
        tl.store(p_key + j * BLOCK_M + tl.arange(0, BLOCK_M), b_key)
    tl.debug_barrier()

    # -- 2. the chunk's k_row best pages, by bisection on the key bits
    o_k = tl.arange(0, CH)
    b_key = tl.load(p_key + o_k, cache_modifier=".cg")
    T = kth_largest(b_key, k_row)
    m_ok = b_key > INT32_MIN
    m_gt = m_ok & (b_key > T)
    m_eq = m_ok & (b_key == T)
    n_gt = tl.sum(m_gt.to(tl.int32))
    rank_eq = tl.cumsum(m_eq.to(tl.int32), axis=0) - 1
    m_sel = m_gt | (m_eq & (rank_eq < k_row - n_gt))
    i_out = tl.cumsum(m_sel.to(tl.int32), axis=0) - 1
    n_sel = tl.sum(m_sel.to(tl.int32))
    o_page = i_c * CH + o_k
    if NCH == 1:
        i_b64 = i_b.to(tl.int64)
        tl.store(pages_ptr + (i_b64 * S + i_r % S) * W + i_out, o_page, mask=m_sel)
        tl.store(counts_ptr + i_r, n_sel)
    else:
        o_c = (i_r.to(tl.int64) * NCH + i_c) * W
        tl.store(ck_ptr + o_c + i_out, b_key, mask=m_sel)
        tl.store(cp_ptr + o_c + i_out, o_page, mask=m_sel)
        tl.store(cn_ptr + i_r * NCH + i_c, n_sel)


@triton.jit
def _merge_kernel(
    ids_ptr, lens_ptr, ck_ptr, cp_ptr, cn_ptr, pages_ptr, counts_ptr,
    W, sinks, window, k_pages,
    NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK_W: tl.constexpr, S: tl.constexpr,
    P: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_b = i_r // S
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
    o_c = tl.arange(0, NCH_P2)
    n_c = tl.load(cn_ptr + i_r * NCH + o_c, mask=o_c < NCH, other=0)
    max_n = tl.max(n_c, axis=0)
    p_row = (i_r.to(tl.int64) * NCH + o_c) * W  # [NCH_P2]

    # -- bisection on the key bits over every candidate of the row
    lo = tl.full([], INT32_MIN, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        c = tl.zeros([], tl.int32)
        for off in range(0, max_n, BLOCK_W):
            o_w = off + tl.arange(0, BLOCK_W)
            m_w = o_w[None, :] < n_c[:, None]
            b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
            c += tl.sum(tl.sum((m_w & (b_key >= mid.to(tl.int32))).to(tl.int32), axis=1), axis=0)
        ge = c >= k_row
        lo = tl.where(ge, mid, lo)
        hi = tl.where(ge, hi, mid - 1)
    T = lo.to(tl.int32)

    # -- emit: every key > T, then ties at T until k_row pages are kept
    n_gt = tl.zeros([], tl.int32)
    for off in range(0, max_n, BLOCK_W):
        o_w = off + tl.arange(0, BLOCK_W)
        m_w = o_w[None, :] < n_c[:, None]
        b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
        n_gt += tl.sum(tl.sum((m_w & (b_key > T)).to(tl.int32), axis=1), axis=0)
    p_out = pages_ptr + i_r.to(tl.int64) * W
    n_out = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for off in range(0, max_n, BLOCK_W):
        o_w = off + tl.arange(0, BLOCK_W)
        m_w = o_w[None, :] < n_c[:, None]
        b_key = tl.load(ck_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=INT32_MIN)
        b_page = tl.load(cp_ptr + p_row[:, None] + o_w[None, :], mask=m_w, other=0)
        m_gt = m_w & (b_key > T)
        m_eq = m_w & (b_key == T) & (b_key > INT32_MIN)
        f_eq = tl.reshape(m_eq.to(tl.int32), [NCH_P2 * BLOCK_W])
        r_eq = tl.reshape(tl.cumsum(f_eq, axis=0), [NCH_P2, BLOCK_W]) - 1 + n_eq
        m_sel = m_gt | (m_eq & (r_eq < k_row - n_gt))
        f_sel = tl.reshape(m_sel.to(tl.int32), [NCH_P2 * BLOCK_W])
        i_out = tl.reshape(tl.cumsum(f_sel, axis=0), [NCH_P2, BLOCK_W]) - 1 + n_out
        tl.store(p_out + i_out, b_page, mask=m_sel)
        n_out += tl.sum(f_sel, axis=0)
        n_eq += tl.sum(f_eq, axis=0)
    tl.store(counts_ptr + i_r, n_out)


# ---------------------------------------------------------------------------
# launcher / public function
# ---------------------------------------------------------------------------


def topk_width(M: int, page_size: int, budget: int, sinks: int, window: int) -> Tuple[int, int]:
    """(k_pages, width) exactly as the reference sizes them."""
    k_pages = max(budget // page_size, 1)
    return k_pages, min(M, max(k_pages, 1 + sinks + window))


def select_topk(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    budget: int,
    sinks: int = 0,
    window: int = 0,
    per_query_head: bool = False,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    ub: Optional[torch.Tensor] = None,
) -> Selection:
    """Quest top-k selection (Triton), fused with the bound computation.

    Args:
        q: [batch, q_heads, head_dim]; cache: PagedKVCache; seq_ids: int [batch].
        budget: token budget; pages kept per row = max(budget // P, forced),
            forced = last page + ``sinks`` first + ``window`` last pages.
        per_query_head: one selection per query head instead of per KV head.
        scale, slopes: as in scoring.
        ub: optional float32 [batch, q_heads, M] output buffer; when given, the
            Quest bounds plus the reference's rounding slack (``bound_slack``)
            are written there too (the certified policy's safe bound).
    Returns:
        Selection(pages int32 [batch, S, W], counts int32 [batch, S]) with
        W = min(M, max(budget // P, 1 + sinks + window)); pages unsorted.
    """
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    S = HQ if per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    k_pages, W = topk_width(M, P, budget, sinks, window)
    cfg = topk_plan(M, W, NG, D, q.dtype, cache.dtype)
    NCH, CH = cfg["NCH"], cfg["CH"]
    smp, smh = meta_strides(cache)
    dev = q.device
    sl = as_slopes(slopes, HQ, dev)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    pages = torch.zeros(B, S, W, dtype=torch.int32, device=dev)
    counts = torch.empty(B, S, dtype=torch.int32, device=dev)
    keys = torch.empty(B * S * NCH * CH, dtype=torch.int32, device=dev)
    if NCH > 1:
        ck = torch.empty(B * S * NCH * W, dtype=torch.int32, device=dev)
        cp = torch.empty_like(ck)
        cn = torch.empty(B * S * NCH, dtype=torch.int32, device=dev)
    else:
        ck = cp = cn = keys
    write_ub = ub is not None
    _chunk_kernel[(B * S, NCH)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_min, cache.k_max,
        keys, ck, cp, cn, ub if write_ub else keys, pages, counts,
        float(scale), q.stride(0), q.stride(1), smp, smh,
        HQ, G, M, W, int(sinks), int(window), k_pages,
        S=S, NG=NG, NCH=NCH, P=P, D=D,
        BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], NSUB=cfg["NSUB"],
        HAS_ALIBI=slopes is not None, WRITE_UB=write_ub,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"],
        num_warps=4,
    )
    if NCH > 1:
        nch_p2 = next_pow2(NCH)
        block_w = max(1, min(next_pow2(W), 8192 // nch_p2))
        _merge_kernel[(B * S,)](
            ids, cache.seq_lens, ck, cp, cn, pages, counts,
            W, int(sinks), int(window), k_pages,
            NCH=NCH, NCH_P2=nch_p2, BLOCK_W=block_w, S=S, P=P,
            num_warps=8,
        )
    return Selection(pages, counts)
