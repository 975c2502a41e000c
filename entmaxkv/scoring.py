"""Page scoring from per-page key metadata (docs/spec.md §3-5).

Reference implementations (pure PyTorch, also the CPU path). Every function
reads the cache's metadata through the block table and returns fixed-width
tensors over M = ``cache.max_pages_per_seq`` logical pages, so nothing here
reads a GPU value on the host.

Shapes: B batch, HQ query heads, H KV heads, G = HQ // H, D head dim,
M logical pages per sequence, P page size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cache import PagedKVCache


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 when the query is float64 (the oracle), float32 otherwise."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@dataclass
class PageLayout:
    """Where each logical page of each batch row sits and what it holds.

    Attributes:
        phys:    int64 [B, M] physical page id of each logical page.
        seq_len: int64 [B] sequence lengths.
        n_tok:   int64 [B, M] valid tokens per page (0 past the end).
        first:   int64 [B, M] position of the page's first token (global
                 positions for a shard with a position table).
        pos_q:   int64 [B] position of the query (the last cached token).
    """

    phys: torch.Tensor
    seq_len: torch.Tensor
    n_tok: torch.Tensor
    first: torch.Tensor
    pos_q: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, M]: the page holds at least one token."""
        return self.n_tok > 0

    @property
    def num_pages(self) -> torch.Tensor:
        """int64 [B]: logical pages in use per sequence."""
        return self.valid.sum(-1)


def page_layout(cache: PagedKVCache, seq_ids: torch.Tensor) -> PageLayout:
    """Read block-table rows and lengths for a batch of sequences."""
    P = cache.page_size
    phys = cache.block_table.index_select(0, seq_ids).long()  # [B, M]
    seq_len = cache.seq_lens.index_select(0, seq_ids).long()  # [B]
    M = phys.shape[1]
    start = torch.arange(M, device=phys.device, dtype=torch.long) * P  # [M] first stored token of each page
    n_tok = (seq_len[:, None] - start[None, :]).clamp(0, P)  # [B, M]
    positions = getattr(cache, "positions", None)
    if positions is None:
        return PageLayout(phys, seq_len, n_tok, start.expand_as(n_tok), seq_len - 1)
    # a shard of a longer sequence (layout.PagedKV.positions): global positions
    pos = positions.index_select(0, seq_ids).long()  # [B, 2]: query, first stored token
    stride = getattr(cache, "pos_stride", None) or P
    first = pos[:, 1:] + torch.arange(M, device=phys.device, dtype=torch.long)[None, :] * stride
    return PageLayout(phys, seq_len, n_tok, first, pos[:, 0])


def _slopes(slopes: Optional[torch.Tensor], hq: int, like: torch.Tensor) -> torch.Tensor:
    """ALiBi slopes as [HQ] in the compute dtype (zeros when absent = NoPE)."""
    if slopes is None:
        return torch.zeros(hq, dtype=like.dtype, device=like.device)
    return slopes.to(device=like.device, dtype=like.dtype)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, HQ, D] -> [B, H, G, D] (query head h uses KV head h // G)."""
    B, HQ, D = q.shape
    return q.view(B, kv_heads, HQ // kv_heads, D)


def _prepare(q, cache, seq_ids, layout):
    """Shared set-up of the scoring functions: (layout, compute dtype, q as [B, H, G, D])."""
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    dt = compute_dtype(q)
    return lay, dt, _grouped(q.to(dt), cache.kv_heads)


def quest_bounds(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
) -> torch.Tensor:
    """Quest upper bound of every page's scores, per query head.

    u_p = scale * sum_i max(q_i kmin_i, q_i kmax_i) + max_{j in page} slope (j - pos_q),
    computed as relu(q).kmax - relu(-q).kmin (the same maximum, as two matmuls).
    u_p >= s_j for every token j of page p, so it is a safe screen.

    Args:
        q: [B, HQ, D] queries (any float dtype).
        cache: the paged cache; seq_ids: int32/int64 [B] slots on its device.
        scale: score scale (1/sqrt(D) by default upstream).
        slopes: optional float [HQ] ALiBi slopes (0 = no positional bias).
    Returns:
        float32 (float64 for float64 q) [B, HQ, M]; -inf for pages past the end.
    """
    lay, dt, qg = _prepare(q, cache, seq_ids, layout)  # qg: [B, H, G, D]
    B, HQ, D = q.shape
    kmax = cache.k_max[lay.phys].to(dt)  # [B, M, H, D]
    kmin = cache.k_min[lay.phys].to(dt)
    ub = torch.einsum("bhgd,bmhd->bhgm", qg.clamp(min=0), kmax) + torch.einsum(
        "bhgd,bmhd->bhgm", qg.clamp(max=0), kmin
    )
    ub = (ub * scale).reshape(B, HQ, -1)  # [B, HQ, M]
    sl = _slopes(slopes, HQ, ub)[None, :, None]
    # The bias slope*(j - pos_q) is linear in j: its page maximum sits at one end.
    rel_first = (lay.first - lay.pos_q[:, None]).to(dt)[:, None, :]  # [B, 1, M]
    rel_last = (lay.first + lay.n_tok - 1 - lay.pos_q[:, None]).to(dt)[:, None, :]
    ub = ub + torch.maximum(sl * rel_first, sl * rel_last)
    return ub.masked_fill(~lay.valid[:, None, :], float("-inf"))


def bound_slack(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
) -> torch.Tensor:
    """Rounding allowance for comparing bounds with an exact threshold.

    A computed score and a computed bound can each be off by about
    D * eps * (scale * sum_i |q_i| |k_i| + |bias|); certification compares
    them, so it adds this slack to the bound to stay safe. float [B, HQ, M].
    """
    lay, dt, qg = _prepare(q, cache, seq_ids, layout)
    B, HQ, D = q.shape
    qg = qg.abs()
    kabs = torch.maximum(cache.k_max[lay.phys].abs(), cache.k_min[lay.phys].abs()).to(dt)
    mag = torch.einsum("bhgd,bmhd->bhgm", qg, kabs).reshape(B, HQ, -1) * scale
    sl = _slopes(slopes, HQ, mag).abs()[None, :, None]
    mag = mag + sl * (lay.pos_q[:, None, None].to(dt) + 2.0)
    return 4.0 * (D + 4) * torch.finfo(dt).eps * mag


def safe_bounds(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
    ub: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What the certificate compares with a computed threshold, float [B, HQ, M]:
    the Quest bound plus ``bound_slack`` and, where the cache holds key
    sketches (``cache.sketch``), the smaller of that and the token
    sketches' safe bound (``entmaxkv.sketch.sketch_bounds``;
    docs/spec.md §6). ``ub``: the Quest bounds when already computed."""
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    if ub is None:
        ub = quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
    bound = ub + bound_slack(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
    if getattr(cache, "sketch", None) is None:
        return bound
    from .sketch import sketch_bounds

    return torch.minimum(bound, sketch_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay))


def gaussian_stats(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    *,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
):
    """Per-page Gaussian model of a token's score (docs/spec.md §5).

    mu_p = scale * q.kmean_p + slope * (mean position of the page - pos_q)
    sigma_p^2 = scale^2 * sum_i q_i^2 std_{p,i}^2 + slope^2 * var(positions in the page)

    The positional term is the exact variance of the (deterministic) ALiBi
    bias over the page's tokens, (n^2 - 1) / 12 for n consecutive positions;
    it vanishes without ALiBi, where this is exactly the spec's diagonal model.

    Returns:
        mu, sigma: float32 (float64 for float64 q) [B, HQ, M] (0 past the end);
        n_tok: same dtype [B, M], valid tokens per page.
    """
    lay, dt, qg = _prepare(q, cache, seq_ids, layout)
    B, HQ, D = q.shape
    kmean = cache.k_mean[lay.phys].to(dt)  # [B, M, H, D]
    kstd = cache.k_std[lay.phys].to(dt)
    mu = torch.einsum("bhgd,bmhd->bhgm", qg, kmean).reshape(B, HQ, -1) * scale
    var = torch.einsum("bhgd,bmhd->bhgm", qg * qg, kstd * kstd).reshape(B, HQ, -1) * scale**2
    n = lay.n_tok.to(dt)  # [B, M]
    sl = _slopes(slopes, HQ, mu)[None, :, None]
    mean_pos = lay.first.to(dt) + (n - 1) / 2 - lay.pos_q[:, None].to(dt)
    mu = mu + sl * mean_pos[:, None, :]
    var = var + sl * sl * ((n * n - 1).clamp(min=0) / 12)[:, None, :]
    valid = lay.valid[:, None, :]
    mu = mu.masked_fill(~valid, 0.0)
    sigma = var.clamp(min=0).sqrt().masked_fill(~valid, 0.0)
    return mu, sigma, n
