"""The top-k selection's launches and its public function ``select_topk``."""
from __future__ import annotations

from typing import Optional

import torch

from ...types import Pending, Selection
from ..config import TopKConfig, resolve
from .._common import alloc, as_slopes, cdiv, no_positions, launch_count, launch_opts, next_pow2, num_sms
from ..scoring import meta_strides, prep_query
from .chain import _topk_chunk_kernel, _topk_lb_kernel, _topk_merge_kernel
from .keys import _topk_gmax_kernel, _topk_keys_kernel
from .plan import gmax_groups, half_offset, keys_plan, merge_warps, rowsel_plan, topk_plan, topk_width, use_overlap, use_rowsel
from .rowsel import _topk_rowsel_kernel


def launch_keys(q, sl, ids, cache, keys, ub, MK: int, scale: float, sinks: int, window: int,
                k_pages: int, *, has_alibi: bool, c: TopKConfig, cnt: Optional[torch.Tensor] = None,
                pdl: bool = True) -> dict:
    """Launch _topk_keys_kernel: rank keys of every page and KV head (the
    largest bound of its query heads) into ``keys`` [B * H * MK] int32 and,
    when ``ub`` is given, the certified bounds of every query head into it.
    ``sl``: as_slopes output; ``ids``: int32 cache slots; ``cnt``: int32 [B] zeros, or None: raised by one per chunk
    of keys stored, in batch order (the overlapped selection; a batch row
    is complete at cdiv(MK, plan["KCH"])). Returns the keys_plan used
    (benchmarks/tune_keys.py times this launch alone)."""
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    M = cache.block_table.shape[1]
    smp, smh = meta_strides(cache)
    kp = keys_plan(c, B, MK, H, D, num_sms(q.device))
    opts = launch_opts(q.device, pdl)
    nchk = cdiv(MK, kp["KCH"])
    _topk_keys_kernel[(nchk, B) if cnt is not None else (B, nchk)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_min, keys, ub if ub is not None else keys,
        float(scale), q.stride(0), q.stride(1), smp, smh, half_offset(cache.k_min, cache.k_max),
        M, MK, int(sinks), int(window), k_pages,
        H=H, G=HQ // H, HG=kp["HG"], P=P, D=D, BLOCK_D=next_pow2(D),
        BLOCK_M=kp["BLOCK_M"], NSUB=kp["KCH"] // kp["BLOCK_M"],
        HAS_ALIBI=has_alibi, WRITE_UB=ub is not None, AS_IS=c.keys_as_is,
        cnt_ptr=cnt if cnt is not None else keys, PUBLISH=cnt is not None, num_warps=kp["WARPS"], **opts,
    )
    return kp


def launch_gmax(keys: torch.Tensor, rows: int, MK: int, CH: int, groups: int, opts: dict, c: TopKConfig,
                ready: Optional[torch.Tensor] = None, ws=None):
    """_topk_gmax_kernel over a [rows, MK] key table: the largest key of each of
    about ``groups`` groups per row (gmax_groups); ``ready``: int32 [2, rows]
    counters to zero on the way, or None.
    Returns (gmax int32 [rows * NKP], NKP, group size)."""
    NKP, gs = gmax_groups(MK, CH, groups)
    gb = max(1, c.gmax_keys // gs)
    gmax = alloc(ws).empty(rows * NKP, torch.int32, keys.device)
    _topk_gmax_kernel[(rows, cdiv(NKP, gb))](keys, gmax, ready if ready is not None else gmax, MK, NKP, rows,
                                        GS=gs, GB=gb, ZERO=ready is not None, num_warps=c.gmax_warps, **opts)
    return gmax, NKP, gs


def launch_rowsel(keys: torch.Tensor, MK: int, CH: int, ids: torch.Tensor, seq_lens: torch.Tensor,
                  pages: torch.Tensor, counts: torch.Tensor, sinks: int, window: int, k_pages: int,
                  P: int, *, c: TopKConfig, cnt: Optional[torch.Tensor] = None, nchk: int = 0,
                  ready: Optional[torch.Tensor] = None, pdl: bool = True, ws=None) -> tuple:
    """A whole selection from a key table: _topk_gmax_kernel, then one
    _topk_rowsel_kernel program per row. keys: int32 [B * S * MK] (row b * S + s,
    INT32_MIN past the row's pages); ids: int32 [B] cache slots; pages /
    counts: the Selection's int32 [B, S, W] / [B, S], written here.
    ``cnt``: the keys pass's int32 [B] counters (launch_keys) when it is
    still running: each program waits for its batch row's to reach ``nchk``
    and takes the row's group maxima itself (no _topk_gmax_kernel). ``ready``:
    types.Pending.counters, int32 [2, B, S] (zeros already with ``cnt``;
    else _topk_gmax_kernel zeroes them), or None: each row's counters[0] entry
    is raised to 1 once its pages and count are stored. Returns the
    launch's scratch tensors (Pending.hold)."""
    B, S, W = pages.shape
    opts = launch_opts(keys.device, pdl)
    groups, NKP, rp = rowsel_plan(c, MK, CH, W)
    mem = alloc(ws)
    if cnt is None:
        gmax = launch_gmax(keys, B * S, MK, CH, groups, opts, c, ready=ready, ws=ws)[0]
    else:
        gmax = mem.empty(B * S * NKP, torch.int32, keys.device)
    glist = mem.empty(B * S * rp["NKP_P2"], torch.int32, keys.device)
    ck = mem.empty(B * S * rp["CAP"], torch.int32, keys.device)
    cp = mem.empty(B * S * rp["CAP"], torch.int32, keys.device)
    _topk_rowsel_kernel[(B * S,)](
        ids, seq_lens, keys, gmax, glist, ck, cp, pages, counts, cnt if cnt is not None else counts,
        ready if ready is not None else counts, MK, NKP, W, sinks, window, k_pages, nchk,
        S=S, P=P, NT=c.rowsel_nt, E=c.rowsel_e, POLL=cnt is not None, POLLS=c.overlap_polls, READY=ready is not None,
        **rp,
        num_warps=c.rowsel_warps or (8 if B * S <= num_sms(keys.device) else 4), **opts,
    )
    return gmax, glist, ck, cp


# ---------------------------------------------------------------------------
# public function
# ---------------------------------------------------------------------------


def select_topk(
    q: torch.Tensor,
    cache,
    seq_ids: torch.Tensor,
    *,
    budget: int,
    sinks: int = 0,
    window: int = 0,
    per_query_head: bool = False,
    scale: float,
    slopes: Optional[torch.Tensor] = None,
    ub: Optional[torch.Tensor] = None,
    config=None,
    ws=None,
) -> Selection:
    """Quest top-k selection (Triton), fused with the bound computation.

    Args:
        q: [batch, q_heads, head_dim]; cache: PagedKVCache; seq_ids: int [batch].
        budget: token budget; pages kept per row = max(budget // P, forced),
            forced = last page + ``sinks`` first + ``window`` last pages.
        per_query_head: one selection per query head instead of per KV head.
        scale, slopes: as in scoring.
        ub: optional float32 [batch, q_heads, M] output buffer; when given, the
            Quest bounds plus the reference's rounding slack (``bound_slack``)
            are written there too (the certified policy's safe bound).
        ws: a Workspace for the scratch and the Selection's tensors (None: torch.empty).
    Returns:
        Selection(pages int32 [batch, S, W], counts int32 [batch, S]) with
        W = min(M, max(budget // P, 1 + sinks + window)); pages unsorted;
        through _topk_rowsel_kernel also ``pending`` (types.Pending).
    """
    no_positions(cache, "the top-k selection")
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    S = HQ if per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    k_pages, W = topk_width(M, P, budget, sinks, window)
    dev = q.device
    config = resolve(config)
    c = config.topk
    # the keys pass scores all heads of a page at once: MHA, and GQA with one
    # selection per KV head (keys_gqa)
    all_heads = c.all_heads and (G == 1 or (c.keys_gqa and S == H))
    cfg = topk_plan(c, M, W, NG, D, q.dtype, cache.dtype, B * S, num_sms(dev),
                    cap=c.select_ch if all_heads else 4096)
    NCH, CH = cfg["NCH"], cfg["CH"]
    mem = alloc(ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    pages = mem.empty((B, S, W), torch.int32, dev)  # padding past counts is never read
    counts = mem.empty((B, S), torch.int32, dev)
    MK = NCH * CH
    keys = mem.empty(B * S * MK, torch.int32, dev)
    write_ub = ub is not None
    opts = launch_opts(dev, config.pdl)
    prefilter = all_heads and c.prefilter
    # the overlapped selection (use_overlap) publishes the keys per batch row; not with the
    # certified bounds, which later launches read (they wait for the selection, not the keys pass)
    overlap = prefilter and not write_ub and use_overlap(c, B, W, MK, bool(opts["PDL"]))
    rowsel = overlap or (prefilter and use_rowsel(c, W, MK, B * S, num_sms(dev)))
    # _topk_rowsel_kernel publishes each row (Pending.counters [2, B, S]: rows
    # selected, the attention's own). Overlapped, the counters share one zero
    # fill with the keys pass's per batch row; else _topk_gmax_kernel zeroes them.
    cnt = ready = None
    if overlap:
        zeros = mem.zeros(B + 2 * B * S, torch.int32, dev)
        cnt, ready = zeros[:B], zeros[B:].view(2, B, S)
    elif rowsel:
        ready = mem.empty((2, B, S), torch.int32, dev)
    if all_heads:
        kp = launch_keys(q, sl, ids, cache, keys, ub, MK, scale, sinks, window, k_pages,
                         has_alibi=slopes is not None, c=c, cnt=cnt, pdl=opts["PDL"])
    if rowsel:
        scratch = launch_rowsel(keys, MK, CH, ids, cache.seq_lens, pages, counts, int(sinks), int(window),
                                k_pages, P, c=c, cnt=cnt, nchk=cdiv(MK, kp["KCH"]) if overlap else 0,
                                ready=ready, pdl=opts["PDL"], ws=ws)
        # (the attention may start while this selection, and overlapped the
        # keys pass, still read q, the slopes, ids and the key table)
        return Selection(pages, counts, pending=Pending(ready, launch_count(), (q, sl, ids, keys) + scratch))
    _launch_chain(q, sl, ids, cache, keys, ub if write_ub else keys, pages, counts, cfg, scale=scale, sinks=sinks,
                  window=window, k_pages=k_pages, prefilter=prefilter, keys_ready=all_heads,
                  write_ub=write_ub and not all_heads, has_alibi=slopes is not None, c=c, opts=opts, ws=ws)
    return Selection(pages, counts)


def _launch_chain(q, sl, ids, cache, keys, ub, pages, counts, cfg: dict, *, scale: float, sinks: int, window: int,
                  k_pages: int, prefilter: bool, keys_ready: bool, write_ub: bool, has_alibi: bool,
                  c: TopKConfig, opts: dict, ws=None) -> None:
    """The lb / chunk / merge chain into ``pages`` / ``counts`` (int32 [B, S, W]
    / [B, S]): with ``keys_ready`` from the key table ``keys`` as it is, else
    the chunk kernel scores its pages from k_min / k_max first (and with
    ``write_ub`` stores the certified bounds into ``ub``)."""
    B, S, W = pages.shape
    HQ, D = q.shape[1], q.shape[2]
    G, NG, P, M = HQ // cache.kv_heads, HQ // S, cache.page_size, cache.block_table.shape[1]
    NCH, CH = cfg["NCH"], cfg["CH"]
    MK = NCH * CH
    smp, smh = meta_strides(cache)
    mem = alloc(ws)
    dev = q.device
    if NCH > 1:
        ck = mem.empty(B * S * NCH * W, torch.int32, dev)
        cp = mem.empty(B * S * NCH * W, torch.int32, dev)
        cn = mem.empty(B * S * NCH, torch.int32, dev)
    else:
        ck = cp = cn = keys
    lbs = mem.empty(B * S, torch.int32, dev)
    if prefilter:
        gmax, NKP, _ = launch_gmax(keys, B * S, MK, CH, c.gmax_groups, opts, c, ws=ws)
        _topk_lb_kernel[(B * S,)](gmax, lbs, ids, cache.seq_lens, NKP, int(sinks), int(window), k_pages,
                             S=S, P=P, NKP_P2=next_pow2(NKP), NT=c.lb_nt, E=c.lb_e, num_warps=c.lb_warps, **opts)
    _topk_chunk_kernel[(B * S, NCH)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_min, cache.k_max,
        keys, ck, cp, cn, ub, pages, counts, lbs,
        float(scale), q.stride(0), q.stride(1), smp, smh,
        HQ, G, M, W, int(sinks), int(window), k_pages,
        S=S, NG=NG, NCH=NCH, P=P, D=D, PREFILTER=prefilter,
        BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], NSUB=cfg["NSUB"],
        HAS_ALIBI=has_alibi, WRITE_UB=write_ub, KEYS_READY=keys_ready,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"],
        num_warps=c.select_warps if keys_ready else cfg["WARPS"], num_stages=cfg["STAGES"], **opts,
    )
    if NCH > 1:
        nch_p2 = next_pow2(NCH)
        one_tile = nch_p2 * next_pow2(W) <= c.merge_regs
        block_w = next_pow2(W) if one_tile else max(1, min(next_pow2(W), 8192 // nch_p2))
        _topk_merge_kernel[(B * S,)](
            ids, cache.seq_lens, ck, cp, cn, pages, counts, lbs,
            W, int(sinks), int(window), k_pages,
            NCH=NCH, NCH_P2=nch_p2, BLOCK_W=block_w, S=S, P=P, ONE_TILE=one_tile,
            PREFILTER=prefilter, num_warps=merge_warps(nch_p2 * block_w) if one_tile else 8, **opts,
        )


def table_plan(q: torch.Tensor, cache, S: int, budget: int, sinks: int, window: int, config=None) -> dict:
    """How a key table for ``select_keys`` is laid out (shapes only, so a
    captured graph replays the same choices): ``k_pages``, width ``W``, the
    chunk plan ``cfg`` (NCH chunks of CH pages) and ``MK`` = NCH * CH key
    slots per row."""
    c = resolve(config).topk
    B, HQ, D = q.shape
    M = cache.block_table.shape[1]
    k_pages, W = topk_width(M, cache.page_size, budget, sinks, window)
    cfg = topk_plan(c, M, W, HQ // S, D, q.dtype, cache.dtype, B * S, num_sms(q.device), cap=c.select_ch)
    return dict(k_pages=k_pages, W=W, cfg=cfg, MK=cfg["NCH"] * cfg["CH"])


def select_keys(q: torch.Tensor, ids: torch.Tensor, cache, keys: torch.Tensor, plan: dict, *, S: int,
                sinks: int, window: int, config=None, ws=None) -> Selection:
    """Top-k Selection from a key table another pass has written.

    Args:
        q: [batch, q_heads, head_dim] (read for shapes and, by the chain's
            chunk kernel, its first rows; the keys are not recomputed).
        ids: int32 [batch] block-table rows; cache: the paged cache.
        keys: int32 [batch * S * plan["MK"]]: row b * S + s holds
            ``sortable_key`` of each page's rank (``page_rank`` of its bound),
            INF_KEY for the forced pages (``sinks`` first, ``window`` last and
            the last page) and INT32_MIN past the row's pages.
        plan: ``table_plan(q, cache, S, budget, sinks, window, config)``.
    Returns:
        Selection(pages int32 [batch, S, W] unsorted, counts int32 [batch, S]),
        the k_row best pages of each row as ``select_topk`` keeps them.
    """
    config = resolve(config)
    c = config.topk
    B = q.shape[0]
    W, k_pages, cfg, MK = plan["W"], plan["k_pages"], plan["cfg"], plan["MK"]
    dev = q.device
    mem = alloc(ws)
    pages = mem.empty((B, S, W), torch.int32, dev)
    counts = mem.empty((B, S), torch.int32, dev)
    opts = launch_opts(dev, config.pdl)
    if c.prefilter and use_rowsel(c, W, MK, B * S, num_sms(dev)):
        launch_rowsel(keys, MK, cfg["CH"], ids, cache.seq_lens, pages, counts, int(sinks), int(window), k_pages,
                      cache.page_size, c=c, pdl=opts["PDL"], ws=ws)
        return Selection(pages, counts)
    sl = as_slopes(None, q.shape[1], dev, ws)
    _launch_chain(q, sl, ids, cache, keys, keys, pages, counts, cfg, scale=1.0, sinks=sinks, window=window,
                  k_pages=k_pages, prefilter=c.prefilter, keys_ready=True, write_ub=False, has_alibi=False,
                  c=c, opts=opts, ws=ws)
    return Selection(pages, counts)
