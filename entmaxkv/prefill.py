"""Dense causal attention of a row's new tokens over its paged cache (prefill).

A prompt, or a chunk of one after cached context, attends densely: every
new query sees every earlier token of its row, alpha-entmax or softmax. The
keys come from the pages (the new tokens already written there), so one
function serves a whole prompt and any chunking of it, and engines that own
the pages (transformers through ``EntmaxKVCache``, vLLM) share it.

Nothing is T x T: queries go in chunks whose score block holds at most
``max_scores`` entries. Softmax runs through torch SDPA; entmax through the
exact threshold solver (``entmax.entmax``) on each block.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._checks import as_float, as_int, describe
from .entmax import entmax
from .layout import PagedKV
from .limits import check_alpha, effective_alpha

__all__ = ["gather_row", "paged_prefill"]


def gather_row(kv: PagedKV, pages: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` tokens of a row whose logical pages are ``pages``.

    Args:
        kv: the layer's pages.
        pages: int [>= ceil(n / P)] physical page ids of the row, in order.
        n: tokens to read.
    Returns:
        k, v: [kv_heads, n, head_dim] in the storage dtype (copies).
    """
    P, H, D = kv.page_size, kv.kv_heads, kv.head_dim
    used = pages[: (n + P - 1) // P].long()
    k = kv.k_pages[used].transpose(1, 2).reshape(-1, H, D)[:n].transpose(0, 1)
    v = kv.v_pages[used].transpose(1, 2).reshape(-1, H, D)[:n].transpose(0, 1)
    return k, v


def paged_prefill(q: torch.Tensor, kv: PagedKV, pages: torch.Tensor, n: int, *, alpha: float = 1.5,
                  scale: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                  max_scores: int = 1 << 26, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of the last ``t`` of a row's ``n`` cached tokens.

    Query ``i`` (0-based among the ``t``) sits at position ``n - t + i`` and
    attends to tokens ``0 .. n - t + i`` of the row, read from its pages
    (so the new tokens must already be written). With ALiBi the bias of
    key ``j`` is ``slope * (j - position)``.

    Args:
        q: [t, q_heads, head_dim] float16/bfloat16/float32/float64, t <= n,
            q_heads a multiple of kv.kv_heads.
        kv: the layer's ``PagedKV`` (its block table is not used).
        pages: int32/int64 [>= ceil(n / page_size)] physical pages of the row.
        n: tokens of the row, the t new ones last.
        alpha: entmax alpha in [1, 4] (1: softmax).
        scale: score scale (default 1/sqrt(head_dim)).
        alibi_slopes: optional float [q_heads].
        max_scores: the most score entries one query chunk may hold.
        out: optional [t, q_heads, head_dim] in q's dtype, written in place.
    Returns:
        [t, q_heads, head_dim] in q's dtype. Computed in float32 (float64
        for float64 queries).
    """
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a layout.PagedKV, got {describe(kv)}")
    H, D, P = kv.kv_heads, kv.head_dim, kv.page_size
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q: expected a [t, q_heads, {D}] tensor with q_heads a multiple of {H}, got {describe(q)}")
    if not q.is_floating_point() or q.device != kv.device:
        raise ValueError(f"q: expected a floating tensor on {kv.device}, got {q.dtype} on {q.device}")
    t, HQ = q.shape[0], q.shape[1]
    n = as_int(n, "n", lo=max(t, 1))
    if not isinstance(pages, torch.Tensor) or pages.dim() != 1 or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pages: expected an int32/int64 tensor [pages], got {describe(pages)}")
    if pages.numel() * P < n:
        raise ValueError(f"pages: {pages.numel()} pages of {P} tokens hold fewer than n = {n} tokens")
    alpha = effective_alpha(check_alpha(alpha))
    scale = D ** -0.5 if scale is None else as_float(scale, "scale", lo=0.0, lo_open=True)
    max_scores = as_int(max_scores, "max_scores", lo=1)
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (HQ,)):
        raise ValueError(f"alibi_slopes: expected a float tensor of shape ({HQ},), got {describe(alibi_slopes)}")
    if out is None:
        out = torch.empty_like(q)
    elif not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: expected a tensor of shape {tuple(q.shape)} and dtype {q.dtype}, got {describe(out)}")
    if t == 0:
        return out
    G = HQ // H
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = (x.to(dt) for x in gather_row(kv, pages.to(kv.device), n))  # [H, n, D]
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=q.device, dtype=dt).view(HQ, 1, 1)
    keys = torch.arange(n, device=q.device)
    chunk = max(1, min(t, max_scores // max(1, HQ * n)))
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        rel = keys[None, :] - torch.arange(n - t + c0, n - t + c1, device=q.device)[:, None]  # [c, n]: j - pos
        bias = torch.zeros(HQ, c1 - c0, n, dtype=dt, device=q.device)
        if slopes is not None:
            bias = bias + slopes * rel.to(dt)
        bias = bias.masked_fill((rel > 0)[None], float("-inf"))  # causal: key j <= the query's position
        qc = q[c0:c1].transpose(0, 1).to(dt)  # [HQ, c, D]
        if alpha == 1.0:
            o = torch.nn.functional.scaled_dot_product_attention(
                qc[None], k[None], v[None], attn_mask=bias[None], scale=scale, enable_gqa=G > 1)[0]
        else:
            s = torch.einsum("hgcd,hnd->hgcn", qc.view(H, G, c1 - c0, D), k).reshape(HQ, c1 - c0, n)
            p = entmax(s * scale + bias, alpha, dim=-1)
            o = torch.einsum("hgcn,hnd->hgcd", p.view(H, G, c1 - c0, n), v).reshape(HQ, c1 - c0, D)
        out[c0:c1] = o.transpose(0, 1).to(out.dtype)
    return out
