"""Page selection policies (docs/spec.md §5): each maps scores to a Selection.

A policy is a small frozen dataclass of parameters; ``select`` turns it into
fixed-shape tensors. Every policy always keeps the last (still filling)
page, plus optional attention sinks (the first ``sinks`` pages) and a local
window (the last ``window`` pages).

GQA: by default one selection per KV head, the union over its query group,
so a selected page is read once for the whole group; ``per_query_head=True``
selects for each query head separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .attention import attend, selection_mask
from .cache import PagedKVCache
from .gaussian import normal_icdf, pooled_moments, solve_tau_hat
from .scoring import PageLayout, gaussian_stats, page_layout, quest_bounds, safe_bounds
from ._checks import as_bool, as_choice, as_float, as_int, describe
from .limits import SOFTMAX_BELOW, check_alpha, effective_alpha
from .types import POLICIES, Certified, Full, Gaussian, Policy, Selection, TopK  # noqa: F401 (re-exported)
from .types import check_policy_fields


POLICY_NAMES = ("full", "topk", "gaussian", "certified")


def make_policy(name: str, *, budget: int = 1024, q_max: float = 0.995, margin: float = 0.0,
                pooled: bool = False, seed_budget: Optional[int] = None, alibi_seed_budget: Optional[int] = None):
    """A policy from command-line style settings.

    name: "full", "topk" (``budget`` tokens), "gaussian" (``q_max``,
    ``margin``, ``pooled``) or "certified" (seeded by TopK(``seed_budget`` or
    ``budget``), and on heads with ALiBi slopes by TopK(``alibi_seed_budget``)
    when given). Every setting is checked whichever policy is named
    (ValueError naming it).
    """
    name = as_choice(name, "name", POLICY_NAMES)
    budget = as_int(budget, "budget", lo=1)
    q_max = as_float(q_max, "q_max", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    margin = as_float(margin, "margin", lo=0.0)
    pooled = as_bool(pooled, "pooled")
    seed_budget = budget if seed_budget is None else as_int(seed_budget, "seed_budget", lo=1)
    if alibi_seed_budget is not None:
        alibi_seed_budget = as_int(alibi_seed_budget, "alibi_seed_budget", lo=1)
    if name == "full":
        return Full()
    if name == "topk":
        return TopK(budget=budget)
    if name == "gaussian":
        return Gaussian(q_max=q_max, margin=margin, pooled=pooled)
    alibi = None if alibi_seed_budget is None else TopK(budget=alibi_seed_budget)
    return Certified(seed=TopK(budget=seed_budget), alibi_seed=alibi)


def check_policy(policy, *, alpha: float, page_size: int) -> None:
    """Raise ValueError (naming ``policy.<field>``, ``alpha`` or
    ``page_size``) for a policy that cannot run with these settings.

    The fields were checked when the policy was built; they are checked
    again here because a frozen dataclass can still be changed around its
    constructor. What depends on the call is new: TopK budgets of at least
    one page, alpha in [1, ALPHA_MAX] (limits.check_alpha), and entmax for
    Gaussian and Certified (whatever its seed): they raise a ValueError
    naming ``alpha`` when the effective alpha is 1 (softmax, which includes
    alpha < 1 + SOFTMAX_BELOW; limits.effective_alpha).
    """
    if not isinstance(policy, (Full, TopK, Gaussian, Certified)):
        raise ValueError(
            f"policy: expected a Full, TopK, Gaussian or Certified instance, got {describe(policy)}"
        )
    alpha = effective_alpha(check_alpha(alpha))
    page_size = as_int(page_size, "page_size", lo=1)
    check_policy_fields(policy, "policy")
    if isinstance(policy, TopK) and policy.budget < page_size:
        raise ValueError(
            f"policy.budget: expected an int >= page_size ({page_size}), got {policy.budget!r}"
        )
    if isinstance(policy, (Gaussian, Certified)) and alpha == 1.0:
        raise ValueError(
            f"alpha: {policy.name} needs entmax (alpha >= 1 + {SOFTMAX_BELOW:g}); alpha runs as "
            "softmax here, which has no sparse support to find: use Full or TopK"
        )
    if isinstance(policy, Certified):
        for name in ("seed", "alibi_seed"):
            seed = getattr(policy, name)
            if isinstance(seed, TopK) and seed.budget < page_size:
                raise ValueError(
                    f"policy.{name}.budget: expected an int >= page_size ({page_size}), got {seed.budget!r}"
                )
            if seed is not None:
                check_policy(seed, alpha=alpha, page_size=page_size)


def forced_pages(policy, lay: PageLayout) -> torch.Tensor:
    """bool [B, M]: pages every policy keeps (last page, sinks, window)."""
    M = lay.n_tok.shape[1]
    idx = torch.arange(M, device=lay.n_tok.device)[None, :]
    npages = lay.num_pages[:, None]
    sinks = getattr(policy, "sinks", 0)
    window = max(getattr(policy, "window", 0), 1)  # the last page always
    forced = (idx < sinks) | (idx >= npages - window)
    return forced & lay.valid


def compact(keep: torch.Tensor, width: Optional[int] = None) -> Selection:
    """bool [B, S, M] page mask -> Selection (ascending pages, padded).

    Sorting the key (page if kept else M + page) puts kept pages first in
    ascending order with a fixed output width; no host synchronisation.
    """
    B, S, M = keep.shape
    idx = torch.arange(M, device=keep.device)
    key = torch.where(keep, idx, idx + M)
    pages = key.sort(dim=-1).values
    if width is not None:
        pages = pages[..., :width]
    counts = keep.sum(-1).to(torch.int32)
    pages = torch.where(pages < M, pages, torch.zeros_like(pages))
    return Selection(pages.to(torch.int32), counts)


def topk_rank(ub: torch.Tensor, forced: torch.Tensor, S: int) -> torch.Tensor:
    """float [B, S, M]: the rank of each page for top-k selection.

    A page ranks by its largest bound over the query heads that share the
    selection row. A NaN bound (a non-finite key or query) ranks as -inf, so
    every page with a finite bound wins over it; a +inf bound ranks as the
    largest finite value, so it never ties with the forced pages, which rank
    +inf and therefore always come first. Pages past the end keep their -inf.
    """
    rank = torch.where(torch.isnan(ub), torch.full_like(ub, float("-inf")), ub)
    rank = _by_selection_head(rank, S).amax(2).clamp(max=torch.finfo(ub.dtype).max)
    return torch.where(forced, torch.full_like(rank, float("inf")), rank)


def topk_keep(ub: torch.Tensor, forced: torch.Tensor, lay: PageLayout, S: int, k_pages: int,
              width: int) -> torch.Tensor:
    """bool [B, S, M]: the pages TopK keeps, from bounds ub [B, HQ, M].

    Each row keeps min(max(forced pages, k_pages), pages in use) pages, the
    forced ones first, then by ``topk_rank``. The sort is stable, so among
    equal ranks the lower page comes first: a valid page whose bound was NaN
    (rank -inf) still precedes the pages past the end (also -inf), and a row
    is never left with fewer pages than it should keep (never empty: its
    last page is forced).
    """
    B, _, M = forced.shape
    rank = topk_rank(ub, forced, S)
    order = rank.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    count = torch.minimum(
        torch.clamp(forced.sum(-1), min=k_pages), lay.num_pages[:, None].expand(B, S)
    )
    keep = torch.zeros(B, S, M, dtype=torch.bool, device=ub.device)
    keep.scatter_(2, order, torch.arange(width, device=ub.device) < count[..., None])
    return keep


def _by_selection_head(x: torch.Tensor, S: int) -> torch.Tensor:
    """[B, HQ, M] -> [B, S, G', M] with G' = HQ // S heads per selection head."""
    B, HQ, M = x.shape
    return x.view(B, S, HQ // S, M)


def _sel_heads(policy, cache: PagedKVCache, HQ: int) -> int:
    return HQ if getattr(policy, "per_query_head", False) else cache.kv_heads


def select(
    policy: Policy,
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    layout: Optional[PageLayout] = None,
    ub: Optional[torch.Tensor] = None,
) -> Selection:
    """Choose pages for a batch of queries (reference implementation).

    Args:
        policy: Full, TopK, Gaussian or Certified.
        q: [B, HQ, D]; seq_ids: int [B] cache slots; alpha >= 1; scale > 0;
        slopes: optional [HQ] ALiBi slopes; ub: precomputed Quest bounds.
    Returns:
        Selection with pages int32 [B, S, W] (W = M, or the page budget for
        TopK), counts int32 [B, S], tau_hat float [B, HQ] for Gaussian.
    """
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    B, HQ, _ = q.shape
    S = _sel_heads(policy, cache, HQ)
    M = lay.n_tok.shape[1]
    forced = forced_pages(policy, lay)[:, None, :].expand(B, S, M)

    if isinstance(policy, Full):
        return compact(lay.valid[:, None, :].expand(B, S, M))

    if isinstance(policy, TopK):
        if ub is None:
            ub = quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
        k_pages = max(policy.budget // cache.page_size, 1)
        n_forced_max = 1 + policy.sinks + policy.window
        width = min(M, max(k_pages, n_forced_max))
        return compact(topk_keep(ub, forced, lay, S, k_pages, width), width)

    if isinstance(policy, Gaussian):
        return _select_gaussian(policy, q, cache, seq_ids, lay, forced, S, alpha, scale, slopes)

    if isinstance(policy, Certified):
        parts = certified_parts(policy, q, cache, seq_ids, lay, S, alpha=alpha, scale=scale, slopes=slopes, ub=ub)
        add = (alpha - 1.0) * parts.bound > parts.tau_a[..., None]  # [B, HQ, M]
        add = _by_selection_head(add, S).any(2) & lay.valid[:, None, :]
        sel = compact(parts.seed | add | forced)
        sel.tau_lower = parts.tau_a.to(torch.float32)  # (the kept pages contain the seed's)
        return sel

    raise ValueError(f"policy: unknown policy {policy!r}")


def alibi_heads(slopes: Optional[torch.Tensor], S: int, HQ: int) -> Optional[torch.Tensor]:
    """bool [S]: selection heads whose query heads all have a positive ALiBi
    slope (None without slopes)."""
    if slopes is None:
        return None
    return (slopes > 0).view(S, HQ // S).all(1)


def _seed_as(sel: Selection, B: int, S: int, M: int) -> torch.Tensor:
    """bool [B, S, M]: a seed's pages as a mask over S selection heads
    (union over query heads, or copied to them)."""
    mask = selection_mask(sel, M)
    if sel.sel_heads > S:
        return mask.view(B, S, -1, M).any(2)
    if sel.sel_heads < S:
        return mask.repeat_interleave(S // sel.sel_heads, dim=1)
    return mask


def _seed_mask(policy, q, cache, seq_ids, lay, S, alpha, scale, slopes, ub):
    """The certified policy's seed: (mask [B, S, M], Selection) from ``seed``
    or, on the heads ``alibi_heads`` marks, from ``alibi_seed``."""
    B, HQ, _ = q.shape
    M = lay.n_tok.shape[1]
    kw = dict(alpha=alpha, scale=scale, slopes=slopes, layout=lay, ub=ub)
    seed = select(policy.seed, q, cache, seq_ids, **kw)
    mask = _seed_as(seed, B, S, M)
    heads = alibi_heads(slopes, S, HQ) if policy.alibi_seed is not None else None
    if heads is None:
        return mask, seed
    other = _seed_as(select(policy.alibi_seed, q, cache, seq_ids, **kw), B, S, M)
    mask = torch.where(heads[None, :, None], other, mask)
    return mask, compact(mask)


@dataclass
class CertifiedParts:
    """The certified policy's intermediate results (one layer, one step).

    seed: bool [B, S, M] the seed's pages; tau_a: float [B, HQ] the exact
    threshold over them; bound: float [B, HQ, M] the safe page bound the
    augmentation compares with tau_a; sketched: bool [B, S, M] the pages
    whose token sketches were read (None without sketches).
    """

    seed: torch.Tensor
    tau_a: torch.Tensor
    bound: torch.Tensor
    sketched: Optional[torch.Tensor]


def certified_parts(policy, q, cache, seq_ids, lay, S, *, alpha, scale, slopes, ub=None) -> CertifiedParts:
    """Seed, tau_A and the safe bound of the certified policy (docs/spec.md §5, §6).

    Without sketches the bound is Quest's plus its slack. With sketches
    (``cache.sketch``) no page box is read: the page summaries bound every
    page (and rank a top-k seed); token sketches are read only for pages
    outside the seed whose summary bound clears tau_A, and there the bound
    is the smaller of the two.
    """
    if getattr(cache, "sketch", None) is None:
        if ub is None:
            ub = quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
        seed_mask, seed = _seed_mask(policy, q, cache, seq_ids, lay, S, alpha, scale, slopes, ub)
        tau_a = _seed_tau(q, cache, seq_ids, seed, lay, alpha, scale, slopes)
        bound = safe_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay, ub=ub)
        return CertifiedParts(seed_mask, tau_a, bound, None)
    from .sketch import page_box_bounds, sketch_bounds

    pb = page_box_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
    seed_mask, seed = _seed_mask(policy, q, cache, seq_ids, lay, S, alpha, scale, slopes, pb)
    tau_a = _seed_tau(q, cache, seq_ids, seed, lay, alpha, scale, slopes)
    clears = (alpha - 1.0) * pb > tau_a[..., None]
    sketched = _by_selection_head(clears, S).any(2) & ~seed_mask & lay.valid[:, None, :]
    tb = sketch_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
    per_head = sketched.repeat_interleave(q.shape[1] // S, dim=1)
    bound = torch.where(per_head, torch.minimum(pb, tb), pb)
    return CertifiedParts(seed_mask, tau_a, bound, sketched)


def _seed_tau(q, cache, seq_ids, seed: Selection, lay, alpha, scale, slopes) -> torch.Tensor:
    """tau_A [B, HQ] over the seed's pages: a lower bound on the full tau."""
    _, tau_a = attend(q, cache, seq_ids, seed, alpha=alpha, scale=scale, slopes=slopes, tau_init=seed.tau_hat,
                      layout=lay)
    return tau_a


def _select_gaussian(policy, q, cache, seq_ids, lay, forced, S, alpha, scale, slopes):
    """Gaussian-aware selection: estimate tau_hat, keep pages whose high
    quantile clears it (docs/spec.md §5)."""
    B, HQ, _ = q.shape
    mu, sigma, n = gaussian_stats(q, cache, seq_ids, scale=scale, slopes=slopes, layout=lay)
    w = n[:, None, :].expand_as(mu)
    if policy.pooled:
        mu_g, sigma_g, n_g = pooled_moments(mu, sigma, w)
        tau_hat = solve_tau_hat(mu_g[..., None], sigma_g[..., None], n_g[..., None], alpha)
    else:
        tau_hat = solve_tau_hat(mu, sigma, w, alpha)
    # z for the largest of n Gaussian draws: Phi(z)^n = q_max (n = tokens in the page).
    n_safe = n.clamp(min=1)
    z = normal_icdf(torch.as_tensor(policy.q_max, dtype=mu.dtype, device=mu.device) ** (1.0 / n_safe))
    hi = (alpha - 1.0) * (mu + z[:, None, :] * sigma)
    keep = hi > (tau_hat[..., None] - policy.margin)
    keep = _by_selection_head(keep, S).any(2) & lay.valid[:, None, :]
    sel = compact(keep | forced)
    sel.tau_hat = tau_hat.to(torch.float32) if mu.dtype != torch.float64 else tau_hat
    return sel
