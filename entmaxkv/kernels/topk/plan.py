"""Launch plans of the top-k selection from shapes and the TopKConfig only (no
GPU value is read, so a captured graph replays the same choices)."""
from __future__ import annotations

from typing import Tuple

import torch

from ..config import TopKConfig
from .._common import cdiv, interpreting, next_pow2
from ..scoring import score_plan


def topk_plan(c: TopKConfig, M: int, K: int, NG: int, D: int, q_dtype, cache_dtype, rows: int, sms: int,
              cap: int = 4096) -> dict:
    """Chunk size: as large as possible (up to 4096 pages), so that the
    bisection of a chunk is short next to its metadata read and the merge has
    few candidates, but small enough for two programs per multiprocessor."""
    cfg = score_plan(NG, D, q_dtype, cache_dtype)
    if cfg["USE_DOT"]:
        # half the scoring kernels' page block (32 pages at d 128): the chunk
        # kernel holds its keys too (experiments/logs/tune_select.log, GQA 4 x 128k /
        # 512k selection 71.5 -> 59.1 / 187.8 -> 161.8 us)
        cfg["BLOCK_M"] = max(16, min(cfg["BLOCK_M"], 4096 // cfg["BLOCK_D"]))
    if c.chunk_block_m:
        cfg["BLOCK_M"] = c.chunk_block_m
    block_m = cfg["BLOCK_M"]
    cap = 256 if interpreting() else cap
    ch = max(block_m, min(cap, next_pow2(M)))
    floor = max(block_m, min(ch, 1024, next_pow2(4 * K)))
    while ch > floor and rows * cdiv(M, ch) < c.chunk_progs * sms:
        ch //= 2
    # 4 warps on the tl.dot path at any chunk size (8 warps with 32-page
    # blocks: 242 vs 162 us at GQA 4 x 512k, experiments/logs/tune_select.log)
    warps = 4 if cfg["USE_DOT"] or ch < 2048 else 8
    cfg.update(CH=ch, NSUB=ch // block_m, NCH=cdiv(M, ch), WARPS=c.chunk_warps or warps,
               STAGES=c.chunk_stages)
    return cfg


def keys_plan(c: TopKConfig, B: int, MK: int, H: int, D: int, sms: int) -> dict:
    """_topk_keys_kernel blocks: BLOCK_M pages x HG heads per step (about 16K
    values in registers), c.keys_ch pages per program (many short programs:
    a small last wave; experiments/logs/tune_keys.log). ``c.keys_tune``
    (benchmarks/tune_keys.py) overrides any entry."""
    hp = next_pow2(H)
    hg = H & -H  # the largest power of two dividing H: unmasked contiguous runs
    if hg * 4 < hp:
        hg = hp  # few heads per run: one masked step over all heads instead
    per_page = hg * 2 * next_pow2(D)
    block_m = max(1, min(32, 16384 // per_page))
    if interpreting():
        block_m = min(block_m, 16)
    plan = dict(BLOCK_M=block_m, KCH=max(block_m, c.keys_ch), HG=hg,
                WARPS=8 if block_m * per_page >= 8192 else 4)
    plan.update(dict(c.keys_tune))
    return plan


def merge_warps(n: int) -> int:
    """Warps of a merge holding n candidate slots in registers: 1 per 256 (at
    least 1, at most 8): its bisection is latency-bound, and fewer warps
    reduce with fewer cross-warp steps."""
    return max(1, min(8, n // 256))


def half_offset(first: torch.Tensor, second: torch.Tensor) -> int:
    """Element offset of a cache statistic from its partner (D for the packed layout)."""
    return (second.data_ptr() - first.data_ptr()) // first.element_size()


def gmax_groups(MK: int, CH: int, groups: int) -> Tuple[int, int]:
    """(NKP, group size) of about ``groups`` groups per row of MK key slots
    (the size a power of two dividing CH pages)."""
    gs = min(CH, next_pow2(cdiv(MK, groups)))
    return MK // gs, gs


def use_rowsel(c: TopKConfig, W: int, MK: int, rows: int, sms: int) -> bool:
    """Whether a pre-filtered selection of W pages from rows of MK key slots
    (B*S = rows of them) takes _topk_rowsel_kernel rather than the chunked chain
    (shapes only, so the choice is the same at every replay)."""
    if not c.rowsel or next_pow2(W) > c.rowsel_max_w:
        return False
    return MK >= c.rowsel_min_pages or rows < sms or W > c.rowsel_chain_w


def use_overlap(c: TopKConfig, B: int, W: int, MK: int, pdl: bool) -> bool:
    """Whether a pre-filtered selection of W pages from B batch rows of MK
    key slots is overlapped with the keys pass (c.overlap; ``pdl``: the
    launches are PDL launches, without which there is nothing to overlap,
    unless c.overlap_needs_pdl is off). Shapes and ``c`` only, so the choice
    is the same at every replay."""
    return (c.overlap and c.rowsel and (pdl or not c.overlap_needs_pdl) and next_pow2(W) <= c.rowsel_max_w
            and B >= c.overlap_min_batch and MK <= c.overlap_max_keys)


def rowsel_plan(c: TopKConfig, MK: int, CH: int, W: int) -> Tuple[int, int, dict]:
    """_topk_rowsel_kernel's shapes for rows of MK key slots (CH pages per key
    chunk) and a selection W pages wide: (the group count asked of
    gmax_groups, NKP groups, constexprs: GS keys per group, NKP_P2 group
    list slots, GB groups per step of the general loop, a CAP-slot candidate
    buffer and SMALL-slot short tile, the one tile's ONE_G groups and FEW
    rule, GT groups per step of a program's own group maxima)."""
    groups = min(max(c.gmax_groups, c.rowsel_groups_per_page * next_pow2(W), MK // c.rowsel_gs),
                 max(c.gmax_groups, MK // c.rowsel_min_gs))
    NKP, gs = gmax_groups(MK, CH, groups)
    blk = max(c.rowsel_blk, gs)
    cap = next_pow2(blk + next_pow2(W))
    one_g = max(1, min(next_pow2(W), c.rowsel_one // gs))
    return groups, NKP, dict(GS=gs, NKP_P2=next_pow2(NKP), GB=blk // gs, CAP=cap, SMALL=min(cap, c.rowsel_small),
                             ONE_G=one_g, FEW=c.rowsel_few if one_g * gs <= c.rowsel_few_tile else -1,
                             GT=max(1, c.gmax_keys // gs))


def topk_width(M: int, page_size: int, budget: int, sinks: int, window: int) -> Tuple[int, int]:
    """(k_pages, width) exactly as the reference sizes them."""
    k_pages = max(budget // page_size, 1)
    return k_pages, min(M, max(k_pages, 1 + sinks + window))
