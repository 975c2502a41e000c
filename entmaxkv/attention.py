"""Reference sparse attention over selected pages, and the certificate.

Pure PyTorch; the Triton kernels in ``entmaxkv.kernels`` are checked
against these functions. Shapes: B batch, HQ query heads, H KV heads,
S selection heads (H or HQ), W selection width, P page size, D head dim.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .cache import PagedKVCache
from .entmax import _check_alpha, _entmax_and_threshold
from .scoring import PageLayout, _slopes, compute_dtype, page_layout
from .types import Selection


def selected_tokens(
    cache: PagedKVCache, sel: Selection, lay: PageLayout
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Physical pages, positions and validity of every selected token slot.

    Returns:
        phys:  int64 [B, S, W] physical page of each selection entry.
        pos:   int64 [B, S, W * P] token position (index in the sequence; the
               global one for a shard with a position table).
        valid: bool  [B, S, W * P] the slot is a selected, existing token.
    """
    B, S, W = sel.pages.shape
    P = cache.page_size
    logical = sel.pages.long()
    entry_ok = torch.arange(W, device=logical.device)[None, None, :] < sel.counts[..., None]
    logical = torch.where(entry_ok, logical, torch.zeros_like(logical))
    phys = lay.phys.gather(1, logical.reshape(B, S * W)).reshape(B, S, W)
    rows = torch.arange(P, device=logical.device)
    stored = logical[..., None] * P + rows  # [B, S, W, P] index among the row's stored tokens
    valid = entry_ok[..., None] & (stored < lay.seq_len[:, None, None, None])
    pos = lay.first.gather(1, logical.reshape(B, S * W)).reshape(B, S, W)[..., None] + rows
    return phys, pos.reshape(B, S, W * P), valid.reshape(B, S, W * P)


def _kv_head_of_sel(cache: PagedKVCache, S: int, HQ: int, device) -> torch.Tensor:
    """int64 [S]: the KV head each selection head reads."""
    if S == cache.kv_heads:
        return torch.arange(S, device=device)
    return torch.arange(S, device=device) // (HQ // cache.kv_heads)


def selected_scores(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    sel: Selection,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
    with_values: bool = False,
):
    """Scores of every query head over its selected tokens.

    Returns:
        scores: float [B, HQ, W * P] (-inf on padding / missing tokens);
        values: float [B, S, W * P, D] if ``with_values`` else None.
    """
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    dt = compute_dtype(q)
    B, HQ, D = q.shape
    S = sel.sel_heads
    phys, pos, valid = selected_tokens(cache, sel, lay)
    kvh = _kv_head_of_sel(cache, S, HQ, q.device)[None, :, None]  # [1, S, 1]
    k = cache.k_pages[phys, kvh].to(dt).reshape(B, S, -1, D)  # [B, S, W*P, D]
    qs = q.to(dt).view(B, S, HQ // S, D)  # query heads grouped by selection head
    s = torch.einsum("bsgd,bsnd->bsgn", qs, k) * scale
    sl = _slopes(slopes, HQ, s).view(1, S, HQ // S, 1)
    rel = (pos - lay.pos_q[:, None, None]).to(dt)[:, :, None, :]  # [B, S, 1, W*P]
    s = (s + sl * rel).masked_fill(~valid[:, :, None, :], float("-inf"))
    v = cache.v_pages[phys, kvh].to(dt).reshape(B, S, -1, D) if with_values else None
    return s.reshape(B, HQ, -1), v


def attend(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    sel: Selection,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    tau_init: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact alpha-entmax (alpha = 1: softmax) attention over the selected pages.

    The threshold tau is solved exactly over the kept scores (``tau_init``,
    e.g. the Gaussian estimate, is only a warm start), so the output is
    exactly entmax over the kept set; when the kept set contains the full
    support it equals full-cache attention. ``sel.tau_lower`` is not read:
    the kernels use it only to skip scores that have zero weight.

    Args:
        q: [B, HQ, D]; sel: Selection with S in {H, HQ} selection heads.
        tau_init: optional float [B, HQ].
        alpha: checked and made effective as in entmax() (limits.check_alpha,
            limits.effective_alpha).
    Returns:
        out: [B, HQ, D] in q.dtype; tau: float32/float64 [B, HQ]
        (+inf for a head with no kept token, whose output is zeros).
    """
    alpha = _check_alpha(alpha)
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    B, HQ, D = q.shape
    S = sel.sel_heads
    s, v = selected_scores(
        q, cache, seq_ids, sel, scale=scale, slopes=slopes, layout=lay, with_values=True
    )
    # The same solve as entmax(): p is built from the row-max-shifted scores
    # and the log-threshold, never from tau, so |scores| ~ 1e7 and alpha near
    # 1 keep their digits (a p from the unshifted scores and tau does not).
    p, tau = _entmax_and_threshold(s, alpha, tau_init=tau_init)  # [B, HQ, N], [B, HQ]
    p = p.to(v.dtype)
    out = torch.einsum("bsgn,bsnd->bsgd", p.view(B, S, HQ // S, -1), v).reshape(B, HQ, D)
    return out.to(q.dtype), tau.to(s.dtype)


def certify(
    ub: torch.Tensor,
    sel: Selection,
    tau: torch.Tensor,
    alpha: float,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    slack: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-head certificate that sparse attention equals full-cache attention.

    By monotonicity (docs/spec.md §1) the threshold over any kept set is <= the
    full-cache threshold, so a page whose bound satisfies (alpha-1) * u <= tau
    holds no support token. The result is exact when every valid unselected
    page passes this test. Softmax (alpha = 1) has full support: certified
    only when nothing was left out.

    The test only proves something about finite numbers, so a head is also
    refused when its tau is not finite or when the bound (ub + slack) of any
    of its valid pages, kept or not, is not finite: a non-finite bound comes
    from a non-finite key (or query), where full-cache attention itself is
    not finite. NaN fails every comparison here, so it can never pass as a
    proof. The output and the query are checked by ``finite_rows``; decode
    reports ``certify(...) & finite_rows(out, q)``.

    Args:
        ub: float [B, HQ, M] Quest bounds (-inf past the end).
        sel: the Selection used; tau: float [B, HQ] exact thresholds over it.
        seq_lens: int [B]; slack: optional float [B, HQ, M] rounding allowance.
    Returns:
        bool [B, HQ] (a device tensor: nothing is read on the host).
    """
    B, HQ, M = ub.shape
    S = sel.sel_heads
    keep = selection_mask(sel, M).repeat_interleave(HQ // S, dim=1)  # [B, HQ, M]
    first = torch.arange(M, device=ub.device) * page_size
    valid = (first[None, :] < seq_lens.long()[:, None])[:, None, :]  # [B, 1, M]
    left_out = valid & ~keep
    bound = ub if slack is None else ub + slack
    finite = torch.isfinite(tau) & (torch.isfinite(bound) | ~valid).all(-1)
    if alpha == 1.0:
        return finite & ~left_out.any(-1)
    safe = (alpha - 1.0) * bound <= tau[..., None]
    return finite & (safe | ~left_out).all(-1)


def finite_rows(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """bool [B, HQ]: the head's output row out [B, HQ, D] and its query q
    [B, HQ, D] are finite (the rest of the certificate's inputs; one
    reduction over each, on the device)."""
    return torch.isfinite(out).all(-1) & torch.isfinite(q).all(-1)


def selection_mask(sel: Selection, M: int) -> torch.Tensor:
    """bool [B, S, M]: logical page m is among the valid entries of the row."""
    B, S, W = sel.pages.shape
    entry_ok = torch.arange(W, device=sel.pages.device)[None, None, :] < sel.counts[..., None]
    idx = torch.where(entry_ok, sel.pages.long(), torch.full_like(sel.pages, M, dtype=torch.long))
    mask = torch.zeros(B, S, M + 1, dtype=torch.bool, device=sel.pages.device)
    mask.scatter_(2, idx, True)
    return mask[..., :M]


def kept_fraction(sel: Selection, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """float32 [1]: the selection's kept pages over the valid pages of its
    rows, summed over the batch and the selection heads (``seq_lens``: int
    [B], the rows' lengths). What the planner reads back to decide whether
    the certified policy should run as the dense pass."""
    valid = ((seq_lens.to(torch.float32) + (page_size - 1)) // page_size).sum() * sel.counts.shape[1]
    return (sel.counts.to(torch.float32).sum() / valid.clamp_min(1.0)).reshape(1)
