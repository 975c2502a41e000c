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

from ._checks import as_float, as_int, describe, is_int
from .attention import selection_mask
from .cache import PagedKVCache
from .entmax import entmax
from .limits import check_alpha
from .types import Selection


def _tensor(x, name: str, shape_text: str, ndim: int, *, floating: bool = True) -> torch.Tensor:
    ok = isinstance(x, torch.Tensor) and x.dim() == ndim and (x.is_floating_point() or not floating)
    if not ok:
        kind = "float " if floating else ""
        raise ValueError(f"{name}: expected a {kind}tensor {shape_text}, got {describe(x)}")
    return x


def _check_alpha_scale(alpha, scale):
    return check_alpha(alpha), as_float(scale, "scale", lo=0.0, lo_open=True)


def _check_slopes(slopes, HQ: int):
    if slopes is not None and not (
        isinstance(slopes, torch.Tensor) and slopes.shape == (HQ,) and slopes.is_floating_point()
    ):
        raise ValueError(f"slopes: expected None or a float tensor of shape ({HQ},), got {describe(slopes)}")


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
        q: float [HQ, D]; k, v: float [n, H, D] with HQ a multiple of H.
        alpha: number in [1, ALPHA_MAX] (1: softmax); scale: number > 0.
        slopes: optional float [HQ] ALiBi slopes.
        length: int in [1, n], tokens to use (default n); the query sits at
            position length-1.
    Returns:
        out float [HQ, D] and probabilities float [HQ, length], computed in
        float64 when q is float64, float32 otherwise.
    Raises:
        ValueError naming the argument for bad input.
    """
    _tensor(q, "q", "[q_heads, head_dim]", 2)
    _tensor(k, "k", "[n, kv_heads, head_dim]", 3)
    HQ, D = q.shape
    if k.shape[0] < 1 or k.shape[2] != D or HQ % k.shape[1]:
        raise ValueError(f"k: expected [n >= 1, kv_heads dividing q_heads ({HQ}), head_dim {D}], "
                         f"got shape {tuple(k.shape)}")
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.shape != k.shape:
        raise ValueError(f"v: expected a float tensor of k's shape {tuple(k.shape)}, got {describe(v)}")
    alpha, scale = _check_alpha_scale(alpha, scale)
    _check_slopes(slopes, HQ)
    n = k.shape[0] if length is None else as_int(length, "length", lo=1, hi=k.shape[0])
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
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
    Raises:
        ValueError naming the argument when a shape or dtype does not fit.
    """
    _tensor(p_full, "p_full", "[q_heads, n]", 2)
    HQ, n = p_full.shape
    _tensor(out_full, "out_full", "[q_heads, head_dim]", 2)
    if out_full.shape[0] != HQ:
        raise ValueError(f"out_full: expected {HQ} rows (p_full's q_heads), got shape {tuple(out_full.shape)}")
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool or kept.shape != p_full.shape:
        raise ValueError(f"kept: expected a bool tensor of p_full's shape {tuple(p_full.shape)}, got {describe(kept)}")
    if not isinstance(out_sparse, torch.Tensor) or out_sparse.shape != out_full.shape:
        raise ValueError(f"out_sparse: expected a tensor of out_full's shape {tuple(out_full.shape)}, "
                         f"got {describe(out_sparse)}")
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
    """Metrics for a whole batch (heads of every row concatenated: [B * HQ]).

    Args:
        q: float [B, HQ, D]; cache: the PagedKVCache decoded from.
        seq_ids: B allocated slots (ints, or an int tensor [B]).
        sel: the Selection the sparse decode used (pages [B, S, W], S dividing HQ).
        out_sparse: [B, HQ, D] the sparse output.
        alpha: number in [1, ALPHA_MAX]; scale: number > 0; slopes: optional float [HQ].
    Raises:
        ValueError naming the argument for bad input.
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {describe(cache)}")
    _tensor(q, "q", "[batch, q_heads, head_dim]", 3)
    B, HQ, D = q.shape
    if D != cache.head_dim:
        raise ValueError(f"q: head_dim {D} does not match the cache's head_dim {cache.head_dim}")
    if isinstance(seq_ids, torch.Tensor):
        ok = seq_ids.dim() == 1 and seq_ids.dtype in (torch.int32, torch.int64)
        slots = seq_ids.tolist() if ok else None
    elif isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        slots = None
    else:
        slots = list(seq_ids)
    active = set(cache.active_seqs())
    if slots is None or len(slots) != B or not all(is_int(s) and int(s) in active for s in slots):
        raise ValueError(f"seq_ids: expected {B} slots allocated in the cache, got {describe(seq_ids)}")
    seq_ids = [int(s) for s in slots]
    if not isinstance(sel, Selection) or not isinstance(sel.pages, torch.Tensor) or sel.pages.dim() != 3 \
            or sel.pages.shape[0] != B or sel.sel_heads < 1 or HQ % sel.sel_heads:
        raise ValueError(f"sel: expected a Selection with pages [{B}, S, width] (S dividing {HQ}), "
                         f"got {describe(sel) if not isinstance(sel, Selection) else tuple(sel.pages.shape)}")
    if not isinstance(out_sparse, torch.Tensor) or out_sparse.shape != q.shape:
        raise ValueError(f"out_sparse: expected a tensor of q's shape {tuple(q.shape)}, got {describe(out_sparse)}")
    alpha, scale = _check_alpha_scale(alpha, scale)
    _check_slopes(slopes, HQ)
    rows = []
    for b, s in enumerate(seq_ids):
        k, v = cache.gather(int(s))
        out_f, p_f = dense_attention(q[b], k, v, alpha=alpha, scale=scale, slopes=slopes)
        kept = kept_tokens(sel, HQ, cache.page_size, k.shape[0], b, cache.max_pages_per_seq)
        rows.append(quality(p_f, out_f, kept, out_sparse[b]))
    return Quality(*(torch.cat([getattr(r, f) for r in rows]) for f in ("coverage", "delta", "rho", "R")))
