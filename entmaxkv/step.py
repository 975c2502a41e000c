"""One decode step on a backend: selection, attention and, on request, the statistics.

The shared core of ``decode`` (one call) and ``planner.Decoder`` (plan once,
run per layer); it validates nothing (its callers do).
"""
from __future__ import annotations

import torch

from . import attention, scoring
from .backend import Backend
from .policies import Full
from .types import DecodeStats


def run_step(ops: Backend, policy, q, cache, ids, alpha, scale, slopes, *, need_bounds=False, ws=None, out=None):
    """Selection + attention on backend ``ops`` (no validation).

    ``cache``: a PagedKVCache or a layout.PagedKV; ``ws``: a Workspace for
    the scratch (None: allocated); ``out``: the [B, HQ, D] output to write
    (None: allocated). Returns (selection, out, tau, quest bounds or None);
    the selection is None for Full without ``need_bounds`` (the dense pass
    needs none).
    """
    # Bounds only for the certificate; selection computes what it needs itself
    # (the kernels fuse the bound into top-k), and the reference reuses these.
    ub = ops.quest_bounds(q, cache, ids, scale=scale, slopes=slopes, ws=ws) if need_bounds else None
    if isinstance(policy, Full):
        o, tau = ops.dense_attend(q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, ws=ws, out=out)
        sel = (ops.select(policy, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, ub=ub, ws=ws)
               if need_bounds else None)
        return sel, o, tau, ub
    sel = ops.select(policy, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, ub=ub, ws=ws)
    o, tau = ops.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes, tau_init=sel.tau_hat, ws=ws,
                        out=out)
    return sel, o, tau, ub


def step_stats(ops: Backend, cache, ids, sel, out, tau, ub, alpha, HQ, q, scale, slopes) -> DecodeStats:
    """Per-query-head statistics and the exactness certificate.

    ``certified`` is ``ops.certify`` (the bounds and tau are finite and the
    bounds prove every left-out page empty of support) and the head's output
    ``out`` and query ``q`` are finite: a few reductions over tensors the
    step already has, all on the device (no host synchronisation). Every
    tensor of the result is new (none is workspace scratch).
    """
    lay = scoring.page_layout(cache, ids)
    M = lay.n_tok.shape[1]
    S = sel.sel_heads
    keep = attention.selection_mask(sel, M).repeat_interleave(HQ // S, dim=1)  # [B, HQ, M]
    keep = keep & lay.valid[:, None, :]
    pages_read = keep.sum(-1).to(torch.int32)
    tokens_read = (keep * lay.n_tok[:, None, :]).sum(-1).to(torch.int32)
    coverage = (tokens_read.to(torch.float32) / lay.seq_len[:, None].clamp(min=1).to(torch.float32))
    slack = scoring.bound_slack(q, cache, ids, scale=scale, slopes=slopes, layout=lay)
    if getattr(cache, "sketch", None) is None:
        certified = ops.certify(ub, sel, tau, alpha, lay.seq_len, page_size=cache.page_size, slack=slack)
    else:  # the sketches' bounds carry their own allowances
        bound = torch.minimum(ub + slack, ops.sketch_bounds(q, cache, ids, scale=scale, slopes=slopes))
        certified = ops.certify(bound, sel, tau, alpha, lay.seq_len, page_size=cache.page_size)
    certified = certified & attention.finite_rows(out, q)
    return DecodeStats(pages_read, tokens_read, coverage, tau.to(torch.float32, copy=True), certified)
