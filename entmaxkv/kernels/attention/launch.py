"""The attention's launch sequence and its public functions (``attend``,
``dense_attend``, ``selection_tau``): buffers, the plan (plan.py), then the
passes (split.py, solve.py, finish.py, combine.py) in order."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..._checks import describe
from ...types import Selection
from ..config import KernelConfig, resolve
from .._common import (alloc, as_slopes, beta_kind, cdiv, pos_args, dot_flags, entmax_form, interpreting, kernel_alpha, kv_strides,
                       launch_count, launch_opts, next_pow2, split_f32)
from .combine import _attn_combine_kernel
from .finish import _attn_finish_kernel, _attn_vacc_kernel, _attn_vtail_kernel
from .plan import _max_share, _plan, _tail_programs
from .solve import _attn_solve_kernel
from .split import _attn_split_entmax_kernel, _attn_split_softmax_kernel


def _check_inputs(q: torch.Tensor, cache) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.kv_heads:
        raise ValueError(f"q: expected [batch, q_heads, {cache.head_dim}] with q_heads a multiple "
                         f"of {cache.kv_heads}, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q: the head_dim axis must be contiguous")
    if cache.num_pages * cache.page_size >= 2**31:
        raise ValueError("cache: num_pages * page_size must stay below 2**31 (token ids are int32)")


def _run(
    q, cache, seq_ids, pages, counts, S: int, W: int, dense: bool, *,
    alpha: float, scale: float, slopes, tau_init, want_out: bool = True, ready=None, config: KernelConfig,
    ws=None, out=None, want_candidates: bool = False, tau_lower=None,
):
    """Launch the split pass and the finishing kernels; returns (out or None, tau).
    ``ready``: Selection.pending.counters (int32 [2, B, S]) or None
    (AttentionConfig.poll_ready); ``config``: the launch choices; ``ws``:
    where scratch comes from (a Workspace, or None: torch.empty); ``out``:
    [B, HQ, D] in q's dtype to write, or None (allocated); ``tau_lower``:
    float32 [B, HQ] proven lower bounds on tau over the kept tokens, or None
    (entmax: the split pass starts its bound there)."""
    c = config.attention
    alpha = kernel_alpha(alpha)
    _check_inputs(q, cache)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    NG = HQ // S
    dev = q.device
    qk = q.float() if q.dtype == torch.float64 else q  # the oracle dtype runs in float32
    softmax = alpha == 1.0
    cfg = _plan(c, B, S, NG, D, W, P, dev, softmax, cache.k_pages.element_size(), dense)
    NSPLIT, BLOCK_T = cfg["NSPLIT"], cfg["BLOCK_T"]
    NS_P2 = next_pow2(NSPLIT)
    dot_f32, prec = dot_flags(cache.dtype)
    if qk.dtype != cache.dtype:
        dot_f32, prec = True, "ieee"
    (skp, skh, skr), (svp, svh, svr) = kv_strides(cache)
    mem = alloc(ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    if dense:  # unread placeholders (DENSE walks every page): no fill is launched
        pages = mem.empty((1, 1, 1), torch.int32, dev)
        counts = mem.empty((1, 1), torch.int32, dev)
    R = B * HQ
    f32 = torch.float32
    tau = mem.empty(R, f32, dev)
    beta = 1.0 / (alpha - 1.0) if not softmax else 1.0
    bk = beta_kind(alpha)
    form = entmax_form(alpha) if not softmax else 0
    am1, am1_lo = split_f32(alpha - 1.0)
    # 1.5-entmax builds p / (alpha-1)^2 (shifted_prob); its sum is scaled once
    pscale = (alpha - 1.0) ** 2 if bk == 2 else 1.0
    CAP = 1
    if softmax:
        pm = mem.empty((R, NSPLIT), f32, dev)
        pl = mem.empty((R, NSPLIT), f32, dev)
        finish = False
    else:
        # one candidate list per (query head, split), room for all its tokens
        # (staged as rows of BLOCK_T slots, then compacted in place)
        CAP = cdiv(_max_share(W, NSPLIT, cfg["MIN_PER"]) * P, BLOCK_T) * BLOCK_T
        cx = mem.empty(R * NSPLIT * CAP, f32, dev)
        ci = mem.empty(R * NSPLIT * CAP, torch.int32, dev)
        cn = mem.empty((R, NSPLIT), torch.int32, dev)
        clb = mem.empty((R, NSPLIT), f32, dev)
        cm = mem.empty((R, NSPLIT), f32, dev)
        pm = pl = clb  # unused
        block_k = max(4, c.solve_tile // NS_P2)  # [NS_P2, BLOCK_K] candidates per step
        fits = CAP <= block_k
        finish = want_out and c.finish and (fits or NSPLIT <= c.finish_max_splits)
    # the split partials, read by _attn_vacc_kernel / _attn_combine_kernel only
    pacc = mem.empty((R, NSPLIT, D), f32, dev) if softmax or (want_out and not finish) else pm
    # (the bound's Newton step needs f convex, alpha <= 2, and u^beta to hold
    # its digits in float32: not for beta above 16, near softmax)
    newton = c.tile_newton if (not softmax and alpha <= 2.0 and beta <= 16.0) else 0
    lb_mode = getattr(c, "lb_mode_" + cfg["PATH"]) if newton <= 1 else 0  # the fused step takes one Newton step at most
    opts = launch_opts(dev, config.pdl)
    # poll_ready: the split programs wait for their own rows; with one query
    # head per row and two launches (split, then finish or combine) the
    # second waits for its rows' split programs too
    poll = 0
    if c.poll_ready and ready is not None and not dense and W * P <= c.poll_max_tokens:
        poll = 2 if (S == HQ and want_out and (softmax or finish)) else 1
    rdy = ready[0] if poll else tau
    done = ready[1] if poll == 2 else tau

    rows_first = bool(poll) and c.poll_rows_first and B * S < 65536  # (a grid's y extent)
    pos = pos_args(cache)  # (the split passes compute the positions)
    grid = (NSPLIT, B * S) if rows_first else (B * S, NSPLIT)
    if softmax:
        _attn_split_softmax_kernel[grid](
            qk, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens, ids, pages, counts, sl,
            pm, pl, pacc, rdy, done,
            float(scale),
            qk.stride(0), qk.stride(1),
            skp, skh, skr, svp, svh, svr,
            cache.block_table.stride(0), pages.stride(0), pages.stride(1), counts.stride(0),
            HQ, G, W,
            S=S, NG=NG, NSPLIT=NSPLIT, P=P, D=D,
            BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"], BLOCK_T=BLOCK_T,
            DENSE=dense, HAS_ALIBI=slopes is not None,
            USE_DOT=cfg["USE_DOT"], DOT_F32=dot_f32, PREC=prec, PREFETCH=cfg["PREFETCH"],
            LOOP_STAGES=cfg["LOOP_STAGES"], POLL=poll, POLLS=c.poll_polls, ROWS_FIRST=rows_first,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pos, **opts,
        )
    else:
        _attn_split_entmax_kernel[grid](
            qk, cache.k_pages, cache.block_table, cache.seq_lens, ids, pages, counts, sl,
            cx, ci, cn, clb, cm, rdy, done, tau_lower if tau_lower is not None else tau,
            float(scale), am1, float(beta),
            qk.stride(0), qk.stride(1),
            skp, skh, skr,
            cache.block_table.stride(0), pages.stride(0), pages.stride(1), counts.stride(0),
            HQ, G, W, CAP,
            S=S, NG=NG, NSPLIT=NSPLIT, MIN_PER=cfg["MIN_PER"], P=P, D=D,
            BLOCK_G=cfg["BLOCK_G"], R=cfg["R"], BLOCK_D=cfg["BLOCK_D"], BLOCK_T=BLOCK_T,
            DENSE=dense, HAS_ALIBI=slopes is not None,
            BETA_KIND=bk, NEWTON=newton, LB_MODE=lb_mode,
            USE_DOT=cfg["USE_DOT"], DOT_F32=dot_f32, PREC=prec, PREFETCH=cfg["PREFETCH"],
            LOOP_STAGES=cfg["LOOP_STAGES"], POLL=poll, POLLS=c.poll_polls, ROWS_FIRST=rows_first,
            HAS_LB0=tau_lower is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pos, **opts,
        )
    if want_candidates:  # the split pass's lists only (entmaxkv.distributed solves tau across ranks)
        return cx.view(R, NSPLIT, CAP), ci.view(R, NSPLIT, CAP), cn, clb
    if not softmax:
        # (FORM 1 starts at r = 0: a warm start in tau's units lost r's digits)
        has_init = tau_init is not None and form != 1
        tinit = tau_init.reshape(R).to(f32).contiguous() if has_init else tau
        fused = c.fused_sums and (c.fused_sums_interpreted or not interpreting())
        if finish:
            out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev) if out is None else out
            block_d = next_pow2(D)
            block_c = max(16, min(c.finish_block, 8192 // block_d))
            tail = _tail_programs(c, R, W, P, dev)
            vpart = mem.empty((R, tail + 1, D), f32, dev) if tail > 1 else tau
            vinfo = mem.empty((R, 3), torch.int32, dev) if tail > 1 else cn
            _attn_finish_kernel[(R,)](
                cx, ci, cn, clb, cm, tinit, tau, cache.v_pages, out, done, vpart, vinfo,
                float(alpha), float(beta), am1, am1_lo, pscale, CAP, c.finish_own, (tail + 1) * D,
                svp, svh, svr, out.stride(0), out.stride(1),
                HQ, G,
                NSPLIT=NSPLIT, NS_P2=NS_P2, BLOCK_K=block_k, BLOCK_M=min(block_k, BLOCK_T),  # (divides CAP)
                P=P, D=D, BLOCK_D=block_d, BLOCK_C=block_c,
                BETA_KIND=bk, HAS_INIT=has_init,
                HALLEY=c.halley_iters, POLISH=c.polish_iters, NEWTON_CAP=c.newton_max,
                MODE=(0 if fits else 1) if c.solve_in_regs else 2, FUSED=fused, FORM=form,
                PRUNE=c.finish_prune and not fits, TAIL=tail > 1, POLL=poll == 2,
                POLLS=c.poll_polls,
                num_warps=c.finish_warps[0 if fits else 1], **opts,
            )
            if tail > 1:
                _attn_vtail_kernel[(R, tail)](
                    cx, ci, cache.v_pages, out, vpart, vinfo,
                    pscale, CAP, c.finish_own,
                    svp, svh, svr, out.stride(0), out.stride(1),
                    HQ, G,
                    NSPLIT=NSPLIT, TAIL=tail, TAIL_P2=next_pow2(tail + 1),
                    P=P, D=D, BLOCK_D=block_d, BLOCK_C=block_c, BETA_KIND=bk,
                    num_warps=4, **opts,
                )
            return out, tau.view(B, HQ)
        # the row max and the shifted threshold, for the V pass
        th = mem.empty((R, 2), torch.float64 if form == 2 else f32, dev)
        _attn_solve_kernel[(R,)](
            cx, cn, clb, cm, tinit, tau, th,
            float(alpha), float(beta), am1, am1_lo, CAP,
            NSPLIT=NSPLIT, NS_P2=NS_P2, BLOCK_K=block_k,
            BETA_KIND=bk, HAS_INIT=has_init,
            HALLEY=c.halley_iters, POLISH=c.polish_iters, NEWTON_CAP=c.newton_max, IN_REGS=c.solve_in_regs,
            FUSED=fused, FORM=form, num_warps=8, **opts,
        )
        if not want_out:
            return None, tau.view(B, HQ)
        block_d = next_pow2(D)
        vblock, vwarps, vrows = c.vacc_small_d if block_d <= 64 else c.vacc_large_d
        _attn_vacc_kernel[(R, NSPLIT)](
            cache.v_pages, cx, ci, cn, th, pacc,
            am1, float(beta), am1_lo, CAP,
            svp, svh, svr,
            HQ, G,
            NSPLIT=NSPLIT, P=P, D=D, BLOCK_D=block_d,
            BLOCK_C=max(16, min(vblock, 8192 // block_d)), BETA_KIND=bk, FORM=form, ACC_ROWS=vrows,
            num_warps=vwarps, **opts,
        )
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev) if out is None else out
    _attn_combine_kernel[(R,)](
        pm, pl, pacc, tau, out, done,
        pscale, out.stride(0), out.stride(1), HQ,
        NSPLIT=NSPLIT, NS_P2=NS_P2, D=D, BLOCK_D=next_pow2(D), SOFTMAX=softmax, SCALED=bk == 2 and not softmax,
        POLL=poll == 2, POLLS=c.poll_polls,
        num_warps=1 if D <= 64 else 2, **opts,
    )
    return out, tau.view(B, HQ)


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    sel: Selection,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    tau_init: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact alpha-entmax (alpha = 1: softmax) attention over the selected pages.

    Triton twin of ``entmaxkv.attention.attend``: reads only the K of the
    selected pages through the block table (each page once for every query
    head of its selection row), solves tau exactly per query head over the
    kept scores, and reads V only for tokens in the support (softmax: every
    kept token).

    Args:
        q: [batch, q_heads, head_dim] float16/bfloat16/float32 (float64 runs in
            float32), head_dim axis contiguous.
        cache: PagedKVCache (k_pages/v_pages [num_pages, kv_heads, P, D]).
        seq_ids: int32/int64 [batch] cache slots, on the cache device.
        sel: Selection; pages int32 [batch, S, W] logical page ids (any order,
            distinct, first counts[b, s] valid), counts int32 [batch, S],
            S = kv_heads (one selection per KV group) or q_heads. When it
            comes from the launch just before (``pending``), each row starts
            as soon as it is selected (AttentionConfig.poll_ready).
        alpha: >= 1 (1 softmax, 1.5, 2 fast paths; any alpha > 1 works;
            alpha - 1 < limits.SOFTMAX_BELOW runs as softmax). The
            probabilities are built shifted by the row max (exact for large
            scores); alpha < 1.5 through log1p, alpha > limits.FLOAT64_ABOVE
            in float64 (entmax_form).
        scale: score scale; slopes: optional float [q_heads] ALiBi slopes.
        tau_init: optional float [batch, q_heads] warm start (used, clamped
            into the bracket, by the general-alpha Halley solver only).
        ``sel.tau_lower`` (float32 [batch, q_heads], e.g. the certified
            policy's tau over its seed): a proven lower bound on tau over the
            selected tokens; entmax drops the scores below it from the start
            (a larger value would drop support tokens).
    Returns:
        out [batch, q_heads, head_dim] in q's dtype (zeros for a head with no
        kept token) and tau float32 [batch, q_heads] (softmax: log-sum-exp;
        +inf for a head with no kept token).
    ws: a Workspace for the scratch (None: allocated per call): float32 +
    int32 candidates of size batch * q_heads * W * P for entmax (W = sel
    width). out: optional [batch, q_heads, head_dim] in q's dtype, written
    (and returned) instead of a new tensor; the tau returned is scratch
    when ``ws`` is given (valid until the workspace's next step).
    """
    B, HQ, _ = q.shape
    pages, counts = sel.pages, sel.counts
    S, W = pages.shape[1], pages.shape[2]
    if S not in (cache.kv_heads, HQ) or pages.shape[0] != B:
        raise ValueError(f"sel: expected pages [batch, kv_heads or q_heads, W], got {tuple(pages.shape)}")
    if pages.dtype != torch.int32:
        pages = pages.to(torch.int32)
    if counts.dtype != torch.int32:
        counts = counts.to(torch.int32)
    counts = counts.contiguous()
    if pages.stride(-1) != 1:
        pages = pages.contiguous()
    ready = None
    if sel.pending is not None and sel.pending.launch == launch_count():  # nothing launched since it
        ready = sel.pending.counters
        if (ready.dtype != torch.int32 or tuple(ready.shape) != (2, B, S) or not ready.is_contiguous()
                or ready.device != q.device):
            raise ValueError(f"sel: pending.counters must be a contiguous int32 [2, {B}, {S}] tensor on "
                             f"{q.device}, got {ready.dtype} {tuple(ready.shape)} on {ready.device}")
    lower = sel.tau_lower
    if lower is not None and (not isinstance(lower, torch.Tensor) or lower.dtype != torch.float32
                              or tuple(lower.shape) != (B, HQ) or lower.device != q.device):
        raise ValueError(f"sel: tau_lower must be a float32 [{B}, {HQ}] tensor on {q.device}, got "
                         f"{describe(lower)}")
    config = resolve(config)
    if kernel_alpha(alpha) == 1.0 or not config.attention.start_at_tau_lower:
        lower = None
    return _run(q, cache, seq_ids, pages, counts, S, max(W, 1), False,
                alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init, ready=ready,
                config=config, ws=ws, out=out, tau_lower=None if lower is None else lower.contiguous())


def dense_attend(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-cache attention (the ``Full`` policy) without a Selection.

    Same algorithm as :func:`attend` with every logical page of each sequence
    kept; the entmax version writes only the candidate scores (x above a
    running lower bound on tau) to HBM, never the whole score row, and reads
    V only for support tokens.

    Args and returns as :func:`attend` (no ``sel``, no ``tau_init``; ``ws``, ``out`` as there).
    Workspace (entmax): batch * q_heads * max_pages_per_seq * P candidates.
    """
    M = cache.block_table.shape[1]
    return _run(q, cache, seq_ids, None, None, cache.kv_heads, M, True,
                alpha=alpha, scale=scale, slopes=slopes, tau_init=None, config=resolve(config), ws=ws, out=out)


def candidates(q, cache, seq_ids, sel: Optional[Selection], *, alpha: float, scale: float, slopes=None,
               config=None, ws=None):
    """The entmax split pass alone: every kept token that can be in the
    support, per query head (alpha > 1).

    Returns (scores float32 [B * HQ, C] in score units, -inf on padding;
    token ids int64 [B * HQ, C], physical page * P + row; lower float32
    [B * HQ]): every kept token left out of the lists has a score below
    ``lower``, which is at most the threshold over the kept tokens (in
    score units, tau / (alpha - 1)). ``sel`` None: every page (Full).
    Views of scratch (``ws``): valid until its next step.
    """
    if kernel_alpha(alpha) == 1.0:
        raise ValueError("alpha: candidates are for entmax (alpha > 1)")
    B, HQ, _ = q.shape
    if sel is None:
        cx, ci, cn, clb = _run(q, cache, seq_ids, None, None, cache.kv_heads, cache.block_table.shape[1], True,
                               alpha=alpha, scale=scale, slopes=slopes, tau_init=None, config=resolve(config),
                               ws=ws, want_candidates=True)
    else:
        S, W = sel.pages.shape[1], sel.pages.shape[2]
        cx, ci, cn, clb = _run(q, cache, seq_ids, sel.pages.to(torch.int32).contiguous(),
                               sel.counts.to(torch.int32).contiguous(), S, max(W, 1), False, alpha=alpha,
                               scale=scale, slopes=slopes, tau_init=None, config=resolve(config), ws=ws,
                               want_candidates=True)
    R, NS, CAP = cx.shape
    listed = torch.arange(CAP, device=cx.device)[None, None, :] < cn[:, :, None]
    scores = torch.where(listed, cx, float("-inf")).view(R, NS * CAP)
    tokens = torch.where(listed, ci, 0).to(torch.int64).view(R, NS * CAP)
    return scores, tokens, clb.amax(dim=1)


def selection_tau(q, cache, seq_ids, sel: Selection, *, alpha: float, scale: float,
                  slopes=None, tau_init=None, config=None, ws=None) -> torch.Tensor:
    """tau [batch, q_heads] over the selected pages without computing the output
    (entmax only; used by the certified policy)."""
    B, HQ, _ = q.shape
    S, W = sel.pages.shape[1], sel.pages.shape[2]
    _, tau = _run(q, cache, seq_ids, sel.pages.to(torch.int32).contiguous(), sel.counts.to(torch.int32),
                  S, max(W, 1), False, alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init,
                  want_out=False, config=resolve(config), ws=ws)
    return tau
