"""Page statistics of the keys (docs/spec.md §3): the arithmetic every write shares.

A page's statistics are the elementwise min / max of its valid keys (the
Quest bound) and their mean / population standard deviation (the Gaussian
policy), all in the storage dtype, plus the float32 Welford state (mean, M2)
they are rounded from. Appending one token updates them in O(H * D)
(``welford_step``); a page that receives several tokens at once, or whose
running state stops being finite, gets them recomputed from its rows
(``page_stats``). ``PagedKVCache`` and the slot-mapping write
(``entmaxkv.write``) both call these functions, so the two paths give the
same bits; the Triton write (``entmaxkv.kernels.write``) does the same
operations in the same order.

Shapes: T pages, H KV heads, P page size, D head dim. ``pair`` tensors are
``[T, H, 2, D]`` (min, max) or (mean, M2).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["moments", "page_stats", "page_welford", "row_mask", "welford_step"]


def row_mask(valid: torch.Tensor, page_size: int) -> torch.Tensor:
    """bool [T, 1, P, 1]: row r of page t is valid (r < valid[t], int64 [T])."""
    return (torch.arange(page_size, device=valid.device) < valid[:, None])[:, None, :, None]


def page_welford(keys: torch.Tensor, valid: torch.Tensor,
                 mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 (mean, M2) [T, H, D] of pages ``keys`` [T, H, P, D] over their
    first ``valid`` (int64 [T]) rows, from scratch (two passes: the mean,
    then the squared deviations from it)."""
    if mask is None:
        mask = row_mask(valid, keys.shape[2])
    x = keys.to(torch.float32)
    count = valid.to(torch.float32)[:, None, None]  # [T, 1, 1]
    mean = torch.where(mask, x, 0.0).sum(dim=2) / count  # [T, H, D]
    dev = torch.where(mask, x - mean[:, :, None], 0.0)  # [T, H, P, D]
    return mean, (dev * dev).sum(dim=2)


def page_stats(keys: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Statistics of pages ``keys`` [T, H, P, D] (storage dtype) over their
    first ``valid`` (int64 [T]) rows, from scratch: (bounds [T, H, 2, D] in
    the storage dtype, float32 Welford state [T, H, 2, D])."""
    mask = row_mask(valid, keys.shape[2])
    inf = float("inf")
    kmin = torch.where(mask, keys, inf).amin(dim=2)  # [T, H, D]
    kmax = torch.where(mask, keys, -inf).amax(dim=2)
    mean, m2 = page_welford(keys, valid, mask)
    return torch.stack((kmin, kmax), dim=2), torch.stack((mean, m2), dim=2)


def welford_step(bounds: torch.Tensor, welford: torch.Tensor, kc: torch.Tensor,
                 row: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One appended key per page: (bounds, welford) after storing ``kc``
    ([T, H, D], storage dtype) as row ``row`` (int64 [T]) of pages whose
    statistics were ``bounds`` / ``welford`` ([T, H, 2, D]). Row 0 starts
    the page afresh. NaN propagates (torch.minimum / maximum), so a
    non-finite key leaves a non-finite state for the caller to detect."""
    first = (row == 0)[:, None, None]  # [T, 1, 1]
    count = (row + 1).to(torch.float32)[:, None, None]  # tokens in the page after the step
    kmin = torch.where(first, kc, torch.minimum(bounds[:, :, 0], kc))
    kmax = torch.where(first, kc, torch.maximum(bounds[:, :, 1], kc))
    x = kc.to(torch.float32)
    mean = torch.where(first, 0.0, welford[:, :, 0])
    m2 = torch.where(first, 0.0, welford[:, :, 1])
    delta = x - mean
    mean = mean + delta / count
    m2 = m2 + delta * (x - mean)
    return torch.stack((kmin, kmax), dim=2), torch.stack((mean, m2), dim=2)


def moments(welford: torch.Tensor, count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(k_mean, k_std) [T, H, 2, D] in ``dtype`` from the float32 Welford
    state ``welford`` [T, H, 2, D] over ``count`` tokens (float32,
    broadcastable to [T, H, D])."""
    mean, m2 = welford[:, :, 0], welford[:, :, 1]
    # The square root in float64, rounded once to float32: the correctly
    # rounded float32 root on every device (torch's float32 sqrt on the CPU
    # is not always), which the Triton write's sqrt_rn also gives.
    std = torch.sqrt((m2.clamp_min(0.0) / count).double()).float()
    return torch.stack((mean.to(dtype), std.to(dtype)), dim=2)
