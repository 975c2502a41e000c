"""The certificate test and the certified policy.

Reference: ``entmaxkv.attention.certify`` and ``entmaxkv.policies.select``
with ``Certified``. Shapes: B batch, HQ query heads, S selection heads,
NG = HQ // S, M logical pages, W selection width.

Monotonicity (docs/spec.md §1): tau over any kept set A is <= tau over all
tokens, so a page with (alpha-1) * u_p <= tau_A holds no support token. The
certified policy therefore needs one augmentation round: seed selection A,
exact tau_A over it, then add every page with (alpha-1) * (u_p + slack) >
tau_A; every page still left out satisfies the test against tau_A <= tau_A'.

Kernels:
* ``_cert_mark_kernel``: scatters a Selection into a uint8 page mask [B, S, M]
  (union over query heads, or copy to them, when the seed's selection heads
  differ from the certified policy's), optionally only on the rows whose
  query heads all have a positive ALiBi slope, or only on the others.
* ``_cert_augment_kernel``: kept = mask | forced | (any head: (alpha-1) ub > tau),
  compacted into a Selection with one atomic per block (unsorted pages).
* ``_cert_certify_kernel``: per query head, is any valid unselected page not
  proven empty of support, or any valid page's bound or the tau not finite?
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..types import TopK
from ..types import Selection
from .config import resolve
from ._common import ATOMIC_SEM, alloc, as_slopes, launch_opts, next_pow2, no_positions, pdl_start
from .attention import selection_tau
from .scoring import bounds_with_slack, prep_query
from .topk import select_topk

# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


@triton.jit
def _mark_row(m_w, slopes_ptr, d, NH, FILTER: tl.constexpr, BLOCK_H: tl.constexpr):
    """m_w where destination row d is marked: always (FILTER 0), only where
    the NH query heads of row d all have a slope > 0 (1), or only where
    they do not (2) (``policies.alibi_heads``, read here rather than
    computed per step by separate launches)."""
    if FILTER == 0:
        return m_w
    else:
        o_h = tl.arange(0, BLOCK_H)
        b_sl = tl.load(slopes_ptr + d * NH + o_h, mask=o_h < NH, other=1.0)
        alibi = tl.min((b_sl > 0.0).to(tl.int32), axis=0)  # (a NaN slope is not > 0)
        # (as a block: the interpreter masks only with bool blocks)
        on = (tl.zeros_like(m_w.to(tl.int32)) + alibi) != 0
        if FILTER == 1:
            return m_w & on
        else:
            return m_w & (on == 0)


@triton.jit
def _cert_mark_kernel(pages_ptr, counts_ptr, mask_ptr, slopes_ptr, W, M, NH,
                 S_SRC: tl.constexpr, S_DST: tl.constexpr, BLOCK_W: tl.constexpr, FILTER: tl.constexpr,
                 BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_w = tl.program_id(1)
    i_b = i_r // S_SRC
    i_s = i_r % S_SRC
    cnt = tl.minimum(tl.load(counts_ptr + i_r), W)
    o_w = i_w * BLOCK_W + tl.arange(0, BLOCK_W)
    m_w = o_w < cnt
    b_pg = tl.load(pages_ptr + i_r.to(tl.int64) * W + o_w, mask=m_w, other=0)
    if S_SRC >= S_DST:  # union over the query heads of a KV group
        d = i_s // (S_SRC // S_DST)
        tl.store(mask_ptr + (i_b * S_DST + d).to(tl.int64) * M + b_pg, 1,
                 mask=_mark_row(m_w, slopes_ptr, d, NH, FILTER, BLOCK_H))
    else:  # the group's selection repeated for each of its query heads
        for j in range(S_DST // S_SRC):
            d = i_s * (S_DST // S_SRC) + j
            tl.store(mask_ptr + (i_b * S_DST + d).to(tl.int64) * M + b_pg, 1,
                     mask=_mark_row(m_w, slopes_ptr, d, NH, FILTER, BLOCK_H))


@triton.jit
def _cert_augment_kernel(ubs_ptr, mask_ptr, tau_ptr, ids_ptr, lens_ptr, pages_ptr, counts_ptr,
                    am1, M, HQ, sinks, window,
                    S: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                    ADD: tl.constexpr, FORCED: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_m = tl.program_id(1)
    i_b = i_r // S
    i_s = i_r % S
    seq = tl.load(ids_ptr + i_b).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    npages = (n + P - 1) // P
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_v = (o_m < M) & (o_m < npages)
    keep = tl.load(mask_ptr + i_r.to(tl.int64) * M + o_m, mask=o_m < M, other=0) != 0
    if FORCED:
        keep = keep | (o_m < sinks) | (o_m >= npages - tl.maximum(window, 1))
    if ADD:
        o_g = tl.arange(0, BLOCK_G)
        m_g = o_g < NG
        o_h = (i_b * HQ + i_s * NG + o_g).to(tl.int64)
        b_tau = tl.load(tau_ptr + o_h, mask=m_g, other=float("inf"))
        b_ub = tl.load(ubs_ptr + o_h[:, None] * M + o_m[None, :], mask=m_g[:, None] & m_v[None, :],
                       other=float("-inf"))
        unsafe = (am1 * b_ub > b_tau[:, None]).to(tl.int32)
        keep = keep | (tl.max(unsafe, axis=0) > 0)
    keep = keep & m_v
    f_keep = keep.to(tl.int32)
    base = tl.atomic_add(counts_ptr + i_r, tl.sum(f_keep, axis=0), sem=ATOMIC_SEM)  # (as in the Gaussian selection)
    i_out = base + tl.cumsum(f_keep, axis=0) - 1
    tl.store(pages_ptr + i_r.to(tl.int64) * M + i_out, o_m, mask=keep)


@triton.jit
def _cert_certify_kernel(ub_ptr, slack_ptr, mask_ptr, tau_ptr, lens_ptr, viol_ptr,
                    am1, M, HQ,
                    S: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
                    SOFTMAX: tl.constexpr, HAS_SLACK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_m = tl.program_id(1)
    i_b = i_r // HQ
    i_s = (i_r % HQ) // NG
    n = tl.load(lens_ptr + i_b)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_v = (o_m < M) & (o_m.to(tl.int64) * P < n)
    kept = tl.load(mask_ptr + (i_b * S + i_s).to(tl.int64) * M + o_m, mask=o_m < M, other=0) != 0
    left = m_v & (kept == 0)
    # every valid page's bound is read: a non-finite one (kept or not) means a
    # non-finite key or query, and so does a non-finite tau (attention.certify)
    o_u = i_r.to(tl.int64) * M + o_m
    b_ub = tl.load(ub_ptr + o_u, mask=m_v, other=float("-inf"))
    if HAS_SLACK:
        b_ub += tl.load(slack_ptr + o_u, mask=m_v, other=0.0)
    tau = tl.load(tau_ptr + i_r) + tl.zeros_like(b_ub)  # (a block: every test below is elementwise)
    ok = (tl.abs(b_ub) < float("inf")) | (m_v == 0)  # NaN fails the comparison too
    bad = (ok & (tl.abs(tau) < float("inf"))) == 0
    if SOFTMAX:
        viol = bad | left
    else:
        # "not proven" rather than "unsafe": NaN never passes as a proof
        viol = bad | (left & ~(am1 * b_ub <= tau))
    tl.atomic_max(viol_ptr + i_r, tl.max(viol.to(tl.int32), axis=0), sem=ATOMIC_SEM)


@triton.jit
def _cert_kept_kernel(counts_ptr, ids_ptr, lens_ptr, out_ptr, B, S,
                      P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: kept pages over valid pages of the whole batch."""
    o_b = tl.arange(0, BLOCK_B)
    o_s = tl.arange(0, BLOCK_S)
    kept = 0.0
    valid = 0.0
    for b0 in range(0, B, BLOCK_B):
        m_b = (b0 + o_b) < B
        seq = tl.load(ids_ptr + b0 + o_b, mask=m_b, other=0).to(tl.int64)
        n = tl.load(lens_ptr + seq, mask=m_b, other=0)
        valid += tl.sum(((n + P - 1) // P).to(tl.float32), axis=0)
        m = m_b[:, None] & (o_s < S)[None, :]
        c = tl.load(counts_ptr + (b0 + o_b)[:, None] * S + o_s[None, :], mask=m, other=0)
        kept += tl.sum(tl.sum(c.to(tl.float32), axis=1), axis=0)
    tl.store(out_ptr, kept / tl.maximum(valid * S, 1.0))


# ---------------------------------------------------------------------------
# launchers / public functions
# ---------------------------------------------------------------------------


def page_mask(sel: Selection, B: int, S: int, M: int, pdl: bool = True, ws=None, *,
              into: Optional[torch.Tensor] = None, slopes: Optional[torch.Tensor] = None,
              on_heads: bool = True) -> torch.Tensor:
    """uint8 [B, S, M] mask of the selected logical pages (S may differ from sel's heads).

    ``into``: a zeroed (or partly marked) mask to mark in place (default: a
    new zero one); ``slopes``: float32 [HQ] ALiBi slopes (HQ a multiple of
    S), then only the rows whose query heads all have a slope > 0 are
    marked (``on_heads``) or only the others (the certified policy's two
    seeds, by head type: ``policies.alibi_heads``)."""
    pages = sel.pages.to(torch.int32).contiguous()
    counts = sel.counts.to(torch.int32).contiguous()
    S_src, W = pages.shape[1], pages.shape[2]
    mask = alloc(ws).zeros((B, S, M), torch.uint8, pages.device) if into is None else into
    if W == 0:
        return mask
    block_w = min(1024, next_pow2(W))
    nh = 1 if slopes is None else slopes.shape[0] // S
    opts = launch_opts(mask.device, pdl)
    _cert_mark_kernel[(B * S_src, triton.cdiv(W, block_w))](
        pages, counts, mask, slopes if slopes is not None else counts, W, M, nh, S_SRC=S_src, S_DST=S,
        BLOCK_W=block_w, FILTER=0 if slopes is None else 1 if on_heads else 2, BLOCK_H=next_pow2(nh),
        num_warps=4, **opts,
    )
    return mask


def _compact(mask, ubs, tau, ids, cache, B, S, NG, HQ, *, alpha, sinks, window, add, forced, pdl, ws=None,
             counts=None):
    """The kept pages of ``mask`` (and, with ``add``, the pages whose bound
    clears tau) as a Selection; ``counts``: zeroed int32 [B, S] for its
    atomic list lengths (default: a new zero one)."""
    M = mask.shape[2]
    mem = alloc(ws)
    pages = mem.empty((B, S, M), torch.int32, mask.device)  # padding past counts is never read
    if counts is None:
        counts = mem.zeros((B, S), torch.int32, mask.device)
    block_m = 256 if NG <= 4 else 64
    opts = launch_opts(mask.device, pdl)
    _cert_augment_kernel[(B * S, triton.cdiv(M, block_m))](
        ubs if ubs is not None else mask, mask, tau if tau is not None else mask, ids, cache.seq_lens,
        pages, counts,
        float(alpha - 1.0), M, HQ, int(sinks), int(window),
        S=S, NG=NG, P=cache.page_size, BLOCK_M=block_m, BLOCK_G=next_pow2(NG),
        ADD=add, FORCED=forced, num_warps=4, **opts,
    )
    return Selection(pages, counts)


def select_certified(policy, q, cache, seq_ids, *, alpha: float, scale: float, slopes=None,
                     config=None, ws=None) -> Selection:
    """Certified selection (Triton): seed, tau over the seed, one augmentation.

    On a cache with key sketches (``cache.sketch``) the page summaries bound
    every page and rank the top-k seeds (their key tables written by the
    same launch), and token sketches are read only for pages outside the
    seed whose summary bound clears tau over the seed
    (``policies.certified_parts`` is the reference).

    Args:
        policy: entmaxkv.policies.Certified (seed TopK or Gaussian), alpha > 1.
        q: [batch, q_heads, head_dim]; cache; seq_ids int [batch]; scale; slopes.
    Returns:
        Selection(pages int32 [batch, S, M] unsorted, counts int32 [batch, S]),
        S = q_heads if policy.per_query_head else kv_heads, whose pages provably
        contain the alpha-entmax support of every query head.
    ``config``: the kernels' launch choices (KernelConfig; None: defaults);
    ``ws``: a Workspace for the scratch and the Selection (None: torch.empty).
    """
    cfg = resolve(config)
    if alpha <= 1.0:
        raise ValueError("policy: certified needs entmax (alpha > 1)")
    no_positions(cache, "the certified selection")
    q = prep_query(q)
    B, HQ, D = q.shape
    H = cache.kv_heads
    S = HQ if policy.per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    ids = seq_ids.to(device=q.device, dtype=torch.int32)
    by_head = policy.alibi_seed is not None and slopes is not None  # (policies.alibi_heads)
    seeds = [policy.seed] + ([policy.alibi_seed] if by_head else [])
    # one fill for everything the selection needs zeroed: the lists' atomic
    # lengths (one [B, S] per compaction) and the page mask; each fill is a
    # launch of its own, outside the kernels' programmatic overlap
    zeroed = alloc(ws).zeros(B * S * 4 * len(seeds) + B * S * M, torch.uint8, q.device)
    counts = [zeroed[i * B * S * 4:(i + 1) * B * S * 4].view(torch.int32).view(B, S) for i in range(len(seeds))]
    mask = zeroed[B * S * 4 * len(seeds):].view(B, S, M)
    sl = as_slopes(slopes, HQ, q.device, ws) if by_head else None
    sketched = getattr(cache, "sketch", None) is not None
    pb = terms = None
    tables = {}
    if sketched:  # page summaries bound (and rank) every page; no page box is read
        from . import sketch as SK
        from .topk.launch import table_plan

        sk, scale_f, bt, strides = SK._bound_args(q, cache, ids, scale, slopes, "the certified selection")
        terms = SK.sketch_terms(q, sk, H, ws)
        wanted = [(i, s) for i, s in enumerate(seeds) if isinstance(s, TopK)]
        specs = []
        for _, s in wanted:
            S_s = HQ if s.per_query_head else H
            specs.append((S_s, table_plan(q, cache, S_s, s.budget, s.sinks, s.window, cfg), s.sinks, s.window))
        pb, keys = SK.box_launch(q, cache, sk, bt, strides, ids, scale_f, slopes, terms, specs, ws)
        tables = {i: (spec, k) for (i, _), spec, k in zip(wanted, specs, keys)}
    seed_sel, ubs = _seed(seeds[0], q, cache, ids, alpha, scale, slopes, cfg, ws, want_ub=not sketched,
                          table=tables.get(0))
    # union over / copy to the certified selection heads; with an ALiBi seed,
    # the main seed marks the other heads' rows and the ALiBi seed theirs
    page_mask(seed_sel, B, S, M, cfg.pdl, ws, into=mask, slopes=sl, on_heads=False)
    if by_head:
        other, _ = _seed(seeds[1], q, cache, ids, alpha, scale, slopes, cfg, ws, want_ub=False,
                         table=tables.get(1))
        page_mask(other, B, S, M, cfg.pdl, ws, into=mask, slopes=sl, on_heads=True)
        seed_sel = _compact(mask, None, None, ids, cache, B, S, NG, HQ, alpha=alpha, sinks=0, window=0,
                            add=False, forced=False, pdl=cfg.pdl, ws=ws, counts=counts[1])
    # tau_A per query head over the seed as selected (per KV group or per query
    # head): any subset gives a valid lower bound on the full-cache tau.
    tau_a = selection_tau(q, cache, ids, seed_sel, alpha=alpha, scale=scale, slopes=slopes,
                          tau_init=seed_sel.tau_hat, config=cfg, ws=ws)
    if sketched:  # token sketches only for pages outside the seed that the summary does not rule out
        # need_bounds' launch, its arguments checked above (once per layer)
        ubs = SK._bounds_launch(q, cache, sk, bt, strides, ids, scale_f, slopes, mask, HQ // S, pb,
                                tau_a.to(torch.float32).contiguous(), float(alpha) - 1.0, terms, ws)
    sel = _compact(mask, ubs, tau_a, ids, cache, B, S, NG, HQ, alpha=alpha, sinks=policy.sinks,
                   window=policy.window, add=True, forced=True, pdl=cfg.pdl, ws=ws, counts=counts[0])
    # the kept pages contain the seed's, so tau_A bounds tau over them from below
    sel.tau_lower = tau_a
    return sel


def _seed(seed, q, cache, ids, alpha, scale, slopes, cfg, ws, *, want_ub: bool, table=None):
    """(seed Selection, safe bounds float32 [B, HQ, M] or None): a TopK seed
    writes the bounds in its own pass; a Gaussian one needs a scoring pass.
    ``table`` ((S, plan, sinks, window), keys): a TopK seed's key table
    written already (the sketch summaries' ranks): it is only selected from."""
    B, HQ, _ = q.shape
    M = cache.block_table.shape[1]
    if isinstance(seed, TopK) and table is not None:
        from .topk.launch import select_keys

        (S_s, plan, sinks, window), keys = table
        return select_keys(q, ids, cache, keys, plan, S=S_s, sinks=sinks, window=window, config=cfg, ws=ws), None
    if isinstance(seed, TopK):
        ubs = alloc(ws).empty((B, HQ, M), torch.float32, q.device) if want_ub else None
        sel = select_topk(q, cache, ids, budget=seed.budget, sinks=seed.sinks, window=seed.window,
                          per_query_head=seed.per_query_head, scale=scale, slopes=slopes, ub=ubs,
                          config=cfg, ws=ws)
        return sel, ubs
    from .gaussian import select_gaussian

    sel = select_gaussian(seed, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=cfg, ws=ws)
    return sel, (bounds_with_slack(q, cache, ids, scale=scale, slopes=slopes, ws=ws) if want_ub else None)


def kept_fraction(sel: Selection, seq_lens: torch.Tensor, seq_ids: torch.Tensor, page_size: int,
                  ws=None) -> torch.Tensor:
    """Triton twin of ``entmaxkv.attention.kept_fraction`` (lengths looked up
    through ``seq_ids``): float32 [1], one launch, no host synchronisation."""
    counts = sel.counts.to(torch.int32).contiguous()
    B, S = counts.shape
    out = alloc(ws).empty(1, torch.float32, counts.device)
    _cert_kept_kernel[(1,)](counts, seq_ids, seq_lens, out, B, S, P=page_size,
                            BLOCK_B=min(64, next_pow2(B)), BLOCK_S=next_pow2(S), num_warps=1)
    return out


def certify(
    ub: torch.Tensor,
    sel: Selection,
    tau: torch.Tensor,
    alpha: float,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    slack: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
) -> torch.Tensor:
    """Per-head certificate that sparse attention equals full-cache attention.

    Triton twin of ``entmaxkv.attention.certify``: True when every valid
    unselected page has (alpha-1) * (ub + slack) <= tau (softmax: when no
    valid page was left out), tau is finite and the bound of every valid
    page is finite (NaN never passes). The output and query are checked
    by ``entmaxkv.attention.finite_rows``.

    Args:
        ub: float [batch, q_heads, M] Quest bounds (-inf past the end).
        sel: the Selection used (S = kv_heads or q_heads selection heads).
        tau: float [batch, q_heads] exact thresholds over the selection.
        alpha: >= 1; seq_lens: int [batch] sequence lengths (one per row).
        page_size: tokens per page; slack: optional float [batch, q_heads, M].
        config: the kernels' launch choices (KernelConfig; None: defaults).
        ws: a Workspace for the scratch (None: torch.empty).
    Returns:
        bool [batch, q_heads] (a new tensor).
    """
    B, HQ, M = ub.shape
    S = sel.pages.shape[1]
    dev = ub.device
    ub32 = ub.to(torch.float32).contiguous()
    sl32 = slack.to(torch.float32).contiguous() if slack is not None else ub32
    tau32 = tau.to(device=dev, dtype=torch.float32).contiguous()
    lens = seq_lens.to(device=dev, dtype=torch.int64).contiguous()
    pdl = resolve(config).pdl
    mask = page_mask(sel, B, S, M, pdl, ws)
    viol = alloc(ws).zeros(B * HQ, torch.int32, dev)
    block_m = 512
    opts = launch_opts(dev, pdl)
    _cert_certify_kernel[(B * HQ, triton.cdiv(M, block_m))](
        ub32, sl32, mask, tau32, lens, viol,
        float(alpha - 1.0), M, HQ,
        S=S, NG=HQ // S, P=page_size, BLOCK_M=block_m,
        SOFTMAX=alpha == 1.0, HAS_SLACK=slack is not None, num_warps=4, **opts,
    )
    return (viol == 0).view(B, HQ)
