"""The slot-mapping cache write (reference): store K/V rows and update page statistics.

An engine decides where each new token goes before the step (a *slot*:
``physical_page * page_size + row``, vLLM's ``slot_mapping``; negative:
padding, skipped) and writes every layer with the same mapping. Token ``t``
goes to row ``slot[t] % P`` of page ``slot[t] // P``; the statistics of each
touched page are brought up to date (docs/spec.md §3):

- a page that receives one token: one incremental step (``stats.welford_step``,
  the same arithmetic as ``PagedKVCache.append``, bit for bit), or a fresh
  start when the token is its row 0;
- a page that receives several tokens (a prefill chunk), or whose running
  state stops being finite (a non-finite key): recomputed from its rows.

Contract: the tokens of one page appear consecutively in ``slot_mapping``,
in row order, and the last of them is the page's last valid row (rows after
it are stale); every append, prefill and chunked prefill writes this way.

This reference compacts the padding away on the host (one synchronisation
on CUDA); the Triton twin (``entmaxkv.kernels.write``) reads the mapping on
the device only and can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from . import stats
from .layout import PagedKV
from .sketch import write_sketch

__all__ = ["write_kv"]


def write_kv(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ([T, kv_heads, head_dim], any floating dtype, cast to
    the storage dtype) at ``slot_mapping`` (int32/int64 [T]; < 0 skips the
    token) of ``kv`` and update the statistics of every touched page.

    No validation here (``entmaxkv.ops.write_kv`` validates); no autograd
    (the values are detached).
    """
    P = kv.page_size
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    T = slots.shape[0]
    if T == 0:
        return
    kc, vc = k.detach().to(kv.dtype), v.detach().to(kv.dtype)  # [T, H, D]
    page, row = slots // P, slots % P
    kv.k_pages[page, :, row] = kc
    kv.v_pages[page, :, row] = vc

    # Runs of consecutive tokens in one page; each page's last token stands for it.
    change = page[1:] != page[:-1]
    true = torch.ones(1, dtype=torch.bool, device=page.device)
    first = torch.cat((true, change))
    last = torch.cat((change, true))
    run = torch.cumsum(first.to(torch.int64), 0) - 1  # [T] run id
    run_len = torch.zeros(T, dtype=torch.int64, device=page.device).scatter_add_(0, run, torch.ones_like(run))
    lp, lrow, lk = page[last], row[last], kc[last]  # one entry per touched page
    single = (run_len[run[last]] == 1)[:, None, None, None]

    step_bounds, step_welford = stats.welford_step(kv.k_bounds[lp], kv.welford[lp], lk, lrow)
    re_bounds, re_welford = stats.page_stats(kv.k_pages[lp], lrow + 1)
    finite = torch.isfinite(step_welford).flatten(1).all(dim=1)[:, None, None, None]
    bounds = torch.where(single, step_bounds, re_bounds)  # running min/max are exact
    welford = torch.where(single & finite, step_welford, re_welford)
    count = (lrow + 1).to(torch.float32)[:, None, None]
    kv.k_bounds[lp] = bounds
    kv.welford[lp] = welford
    kv.k_moments[lp] = stats.moments(welford, count, kv.dtype)
    if kv.sketch is not None:
        write_sketch(kv.sketch, kc, page, row)
