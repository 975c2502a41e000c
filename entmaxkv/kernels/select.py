"""Policy dispatch: ``select(policy, ...)`` with the reference signature.

Reference: ``entmaxkv.policies.select``. Every policy writes fixed-shape
buffers on the device (no host synchronisation), so a whole decode step
(select + attend) can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..types import Certified, Full, Gaussian, TopK
from ..types import Selection
from ._common import alloc
from .config import resolve
from .topk import select_topk


def select_full(q: torch.Tensor, cache, seq_ids: torch.Tensor, per_query_head: bool = False,
                ws=None) -> Selection:
    """Every valid logical page of each row (pages 0..M-1, counts = pages in use)."""
    B, HQ, _ = q.shape
    S = HQ if per_query_head else cache.kv_heads
    M = cache.block_table.shape[1]
    P = cache.page_size
    mem = alloc(ws)
    lens = cache.seq_lens.index_select(0, seq_ids.to(device=cache.seq_lens.device, dtype=torch.long))
    counts = mem.empty((B, S), torch.int32, q.device)
    counts.copy_(((lens + (P - 1)) // P)[:, None].expand(B, S))
    pages = mem.empty((B, S, M), torch.int32, q.device)
    pages.copy_(torch.arange(M, dtype=torch.int32, device=q.device).expand(B, S, M))
    return Selection(pages, counts)


def select(
    policy,
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
) -> Selection:
    """Choose pages for a batch of queries with the Triton kernels.

    Args:
        policy: Full, TopK, Gaussian or Certified (entmaxkv.policies).
        q: [batch, q_heads, head_dim] float16/bfloat16/float32.
        cache: PagedKVCache; seq_ids: int32/int64 [batch] slots on its device.
        alpha: >= 1 (Gaussian and Certified need alpha > 1).
        scale: score scale; slopes: optional float [q_heads] ALiBi slopes.
        config: the kernels' launch choices (KernelConfig; None: defaults).
        ws: a Workspace for the scratch and the Selection (None: torch.empty).
    Returns:
        Selection with pages int32 [batch, S, W] (unsorted within the first
        counts[b, s] entries, zeros after), counts int32 [batch, S] and, for
        Gaussian / Certified, tau_hat float32 [batch, q_heads].
    """
    config = resolve(config)
    if isinstance(policy, Full):
        return select_full(q, cache, seq_ids, policy.per_query_head, ws)
    if isinstance(policy, TopK):
        return select_topk(q, cache, seq_ids, budget=policy.budget, sinks=policy.sinks,
                           window=policy.window, per_query_head=policy.per_query_head,
                           scale=scale, slopes=slopes, config=config, ws=ws)
    if isinstance(policy, Gaussian):
        from .gaussian import select_gaussian

        return select_gaussian(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, config=config,
                               ws=ws)
    if isinstance(policy, Certified):
        from .certified import select_certified

        return select_certified(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes,
                                config=config, ws=ws)
    raise ValueError(f"policy: unknown policy {policy!r}")
