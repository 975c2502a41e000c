"""Approximation-quality metrics against full-cache attention (docs/spec.md §2).

coverage = |I_keep| / n, dropped mass delta = sum of full-cache
probability outside I_keep, support recall rho = |S & I_keep| / |S|,
relative error R = ||o - o_sparse|| / ||o||. Each is per (batch, q_head),
softmax compared with softmax and entmax with entmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .attention import selection_mask
from .cache import PagedKVCache
from .entmax import entmax
from .types import Selection


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    length: Optional[int] = None,
):
    """Attention of one decode query over a contiguous cache (the ground truth).

    Args:
        q: [HQ, D]; k, v: [n, H, D] with HQ a multiple of H.
        length: tokens to use (default n); the query sits at position length-1.
    Returns:
        out float [HQ, D] and probabilities float [HQ, length], computed in
        float64 when q is float64, float32 otherwise.
    """
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = k.shape[0] if length is None else length
    HQ, D = q.shape
    G = HQ // k.shape[1]
    kk = k[:n].to(dt).repeat_interleave(G, dim=1)  # [n, HQ, D]
    vv = v[:n].to(dt).repeat_interleave(G, dim=1)
    s = torch.einsum("hd,nhd->hn", q.to(dt), kk) * scale
    if slopes is not None:
        rel = torch.arange(n, device=q.device, dtype=dt) - (n - 1)
        s = s + slopes.to(dt)[:, None] * rel[None, :]
    p = entmax(s, alpha, dim=-1)
    return torch.einsum("hn,nhd->hd", p, vv), p


def kept_tokens(
    sel: Selection, q_heads: int, page_size: int, length: int, b: int, max_pages: int
) -> torch.Tensor:
    """bool [HQ, length]: tokens of batch row ``b`` inside the selection
    (``max_pages``: the cache's max_pages_per_seq)."""
    M = -(-length // page_size)
    keep = selection_mask(sel, max_pages)[b, :, :M]  # [S, M]
    keep = keep.repeat_interleave(q_heads // sel.sel_heads, dim=0)
    return keep.repeat_interleave(page_size, dim=1)[:, :length]


@dataclass
class Quality:
    """Per-head metrics for one batch row; every field float [HQ]."""

    coverage: torch.Tensor
    delta: torch.Tensor
    rho: torch.Tensor
    R: torch.Tensor


def quality(p_full: torch.Tensor, out_full: torch.Tensor, kept: torch.Tensor, out_sparse: torch.Tensor) -> Quality:
    """Metrics of a sparse output against full-cache attention.

    Args:
        p_full: [HQ, n] full-cache probabilities; out_full: [HQ, D].
        kept: bool [HQ, n] tokens attended by the sparse decode.
        out_sparse: [HQ, D] the sparse output.
    """
    dt = p_full.dtype
    support = p_full > 0
    n_support = support.sum(-1).clamp(min=1).to(dt)
    delta = (p_full * ~kept).sum(-1)
    rho = (support & kept).sum(-1).to(dt) / n_support
    diff = (out_full - out_sparse.to(dt)).norm(dim=-1)
    R = diff / out_full.norm(dim=-1).clamp(min=torch.finfo(dt).tiny)
    coverage = kept.sum(-1).to(dt) / kept.shape[-1]
    return Quality(coverage, delta, rho, R)


def evaluate_selection(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: Sequence[int],
    sel: Selection,
    out_sparse: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
) -> Quality:
    """Metrics for a whole batch (heads of every row concatenated: [B * HQ])."""
    B, HQ, _ = q.shape
    rows = []
    for b, s in enumerate(seq_ids):
        k, v = cache.gather(int(s))
        out_f, p_f = dense_attention(q[b], k, v, alpha=alpha, scale=scale, slopes=slopes)
        kept = kept_tokens(sel, HQ, cache.page_size, k.shape[0], b, cache.max_pages_per_seq)
        rows.append(quality(p_f, out_f, kept, out_sparse[b]))
    return Quality(*(torch.cat([getattr(r, f) for r in rows]) for f in ("coverage", "delta", "rho", "R")))
