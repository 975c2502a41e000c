"""KernelConfig: every launch choice of the decode step's kernels, in one value.

Each stage has its own frozen dataclass (``AttentionConfig``, ``TopKConfig``,
``GaussianConfig``), defined here so that this module imports nothing of the
kernels (every kernel module imports it). Their defaults are the measured
best on the H200 (docs/tuning.md has the measurements, one section per
setting). Public kernel entry points take ``config=None`` (the defaults);
the plan functions take the stage's config; tests and benchmarks pass a
config (``dataclasses.replace``) instead of changing modules.

Units: token / page / candidate counts are counts of those items; "per SM"
values are programs per multiprocessor; (tile, warps, stages) triples are a
tile of tokens, ``num_warps`` and software-pipeline stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

__all__ = ["AttentionConfig", "GaussianConfig", "KernelConfig", "TopKConfig", "resolve"]


@dataclass(frozen=True)
class AttentionConfig:
    """Launch choices of the sparse and dense attention kernels (kernels/attention/)."""

    # Iterations of the general-alpha Halley solve and its Newton polish (as entmax.py).
    halley_iters: int = 24
    polish_iters: int = 2
    # Cap on Newton-from-the-left steps for alpha in {1.5, 2} (each is exact on its
    # support, so a handful suffice; the cap only guards pathological rows).
    newton_max: int = 64
    # Newton steps per tile that raise the split pass's lower bound on tau.
    tile_newton: int = 1
    # How the split pass raises that bound, per path (one head; tl.dot with folded
    # rows; tl.dot with zero rows): 0 three reductions, 1 one fused reduction.
    lb_mode_one_head: int = 1
    lb_mode_dot_folded: int = 1
    lb_mode_dot_rows: int = 0
    # The solve iterates over registers when every candidate list of a head fits
    # one tile of solve_tile candidates (False: always from memory).
    solve_in_regs: bool = True
    solve_tile: int = 2048
    # _attn_vacc_kernel's (block of candidates, warps, [block, D] accumulator) for
    # head dims <= 64 and larger ones.
    vacc_small_d: Tuple[int, int, bool] = (128, 4, True)
    vacc_large_d: Tuple[int, int, bool] = (32, 1, False)
    # Entmax finishes in one launch (_attn_finish_kernel) when lists always fit the
    # solve tile or with <= finish_max_splits splits (many splits: the solve,
    # V and combine launches spread the work wider); its warps (lists that
    # fit, the others) and V block (support tokens).
    finish: bool = True
    finish_max_splits: int = 4
    finish_warps: Tuple[int, int] = (4, 8)
    finish_block: int = 256
    # The finish gathers at most finish_own support tokens' V rows itself; a
    # longer support (wide NoPE heads, dense rows) is spread over finish_tail
    # programs per query head of one more launch (_attn_vtail_kernel; 0: as
    # many as fill the SMs once, at most 32; 1: never), which the finish's
    # one program per head would otherwise gather alone. Only where a row
    # can keep more than finish_own tokens.
    finish_own: int = 2048
    finish_tail: int = 0
    # The finish first drops, in one pass, the candidates below the row's lower
    # bound on tau when its lists outgrow the register tile (dense rows, whose
    # lists are much longer than their support).
    finish_prune: bool = True
    # The solve's sums in one multi-operand reduction per step; the interpreter
    # runs those element by element, so there only with fused_sums_interpreted.
    fused_sums: bool = True
    fused_sums_interpreted: bool = False
    # The entmax split pass starts its lower bound on tau at the selection's proven
    # one (Selection.tau_lower, the certified policy's tau over its seed) when it
    # has one, so it stages only tokens that can be in the support.
    start_at_tau_lower: bool = True
    # After a still-running selection (Selection.pending), wait per row on its
    # counters instead of the whole launch; with the split grid transposed (rows
    # scheduled in selection order); only for selections of <= poll_max_tokens
    # tokens per row; poll_polls loads before falling back to the whole-launch wait.
    poll_ready: bool = True
    poll_rows_first: bool = True
    poll_max_tokens: int = 2048
    poll_polls: int = 1 << 20
    # Load the next tile's page ids while the current tile's K is in flight
    # (through a page list; dense: per path below).
    prefetch_pages: bool = True
    dense_prefetch_one_head_softmax: bool = True
    dense_prefetch_one_head_entmax: bool = False
    dense_prefetch_dot_softmax: bool = True
    dense_prefetch_dot_entmax: bool = True
    # Dense one-head entmax pass (tile, warps, stages), with at least as many rows
    # as SMs and with fewer.
    dense_entmax_pipe_many: Tuple[int, int, int] = (512, 8, 2)
    dense_entmax_pipe_few: Tuple[int, int, int] = (256, 4, 3)
    # Per-shape overrides of the plan: ((NG, D, softmax), (tile, warps, stages))
    # pairs (benchmarks/tune.py sweeps them); such a shape takes split_factor.
    tune: Tuple[Tuple[Tuple[int, int, bool], Tuple[int, int, int]], ...] = ()
    # Programs per SM the split count aims for (int(factor * SMs) in all, rounded
    # up to whole splits per row), per path.
    split_factor: float = 8
    dot_softmax_list_factor: float = 8
    entmax_wave_factor: float = 2
    dot_softmax_dense_factor: float = 3.88
    # tl.dot entmax with NG < 16 heads (a power of two): the dot's 16 rows hold
    # copies of the heads, folded to [NG, tile] (exact), instead of zero rows.
    fold_rows: bool = True
    # Programs per SM of the tl.dot entmax pass (exactly, rounded down to whole splits).
    dot_entmax_per_sm: float = 2
    # Short one-head selections (<= small_sel_tokens per row, head dim <= 64, fewer
    # rows than SMs): (tile, warps, stages) and programs per SM.
    small_sel_tokens: int = 2048
    small_sel: Tuple[int, int, int] = (32, 1, 2)
    small_sel_factor: float = 16
    # Through a page list (one-head entmax), a row uses only as many splits as give
    # each this many tokens, with fewer rows than SMs and with as many (0: all splits).
    split_min_tokens_few: int = 512
    split_min_tokens_many: int = 8192


@dataclass(frozen=True)
class TopKConfig:
    """Launch choices of the top-k selection kernels (kernels/topk/)."""

    # Score all heads of a page in one program (_topk_keys_kernel) when there is
    # one query head per KV head (False: the per-head chunk kernel); with
    # keys_gqa also for GQA selections per KV head, whose rank is the largest
    # bound of the group's query heads (then the pre-filter and the row
    # selection apply to GQA as well).
    all_heads: bool = True
    keys_gqa: bool = True
    # _topk_chunk_kernel's warps and largest chunk (pages) when the keys are ready.
    select_warps: int = 4
    select_ch: int = 4096
    # Pre-filter the chain with a lower bound lb on each row's K-th key from group maxima.
    prefilter: bool = True
    # Groups per row behind lb; keys per _topk_gmax_kernel program and its warps.
    gmax_groups: int = 512
    gmax_keys: int = 4096
    gmax_warps: int = 4
    # _topk_keys_kernel stores its keys in the layout they are computed in.
    keys_as_is: bool = True
    # Pages per _topk_keys_kernel program.
    keys_ch: int = 32
    # _topk_chunk_kernel scoring its own pages (GQA, per query head): programs per SM
    # the chunk size aims for, stages, and overrides of warps / page block (0: from shapes).
    chunk_progs: float = 2
    chunk_stages: int = 3
    chunk_warps: int = 0
    chunk_block_m: int = 0
    # keys_plan overrides: (name, value) pairs of BLOCK_M, KCH, HG, WARPS (sweeps).
    keys_tune: Tuple[Tuple[str, int], ...] = ()
    # _topk_lb_kernel's warps, thresholds per search round and early stop (-1: exact).
    lb_warps: int = 1
    lb_nt: int = 4
    lb_e: int = 4
    # Candidates of a row _topk_merge_kernel keeps in registers.
    merge_regs: int = 16384
    # One _topk_rowsel_kernel program per row instead of the lb / chunk / merge chain
    # for widths up to rowsel_max_w (use_rowsel), then its warps (0: by row count),
    # keys per step, groups per kept page, largest / smallest group, thresholds per
    # round, short-tile candidates and one-tile keys.
    rowsel: bool = True
    rowsel_max_w: int = 512
    rowsel_min_pages: int = 8192
    rowsel_chain_w: int = 64
    rowsel_warps: int = 0
    rowsel_blk: int = 1024
    rowsel_groups_per_page: int = 16
    rowsel_gs: int = 32
    rowsel_min_gs: int = 16
    rowsel_nt: int = 4
    rowsel_small: int = 512
    rowsel_one: int = 8192
    # Rows whose one tile (<= rowsel_few_tile keys) holds <= rowsel_few keys >= lb past
    # the budget are cut from below in registers (-1: never).
    rowsel_few: int = 8
    rowsel_few_tile: int = 4096
    # The row selection's lb search stops once <= k_row + rowsel_e maxima reach it (-1: exact).
    rowsel_e: int = 0
    # The overlapped selection (use_overlap): the keys pass raises a counter per batch
    # row and _topk_rowsel_kernel, launched without waiting, polls it (at most
    # overlap_polls loads) and selects. It needs PDL launches (overlap_needs_pdl;
    # False runs the same code after the keys pass, as the interpreter has no PDL).
    overlap: bool = True
    overlap_min_batch: int = 2
    overlap_max_keys: int = 32768
    overlap_polls: int = 1 << 20
    overlap_needs_pdl: bool = True


@dataclass(frozen=True)
class GaussianConfig:
    """Launch choices of the Gaussian selection kernels (kernels/gaussian/)."""

    # Halley launches of the page-mixture solve (one launch each; after convergence
    # a launch only forwards the state).
    nit: int = 4
    # Iterations of the scalar solves: the pooled policy (float64) and the float32
    # pooled start of the mixture solve.
    scalar_iters: int = 24
    start_iters: int = 8
    # A relative Halley step this small ends the mixture solve (0: never).
    conv_tol: float = 1e-4
    # The stats launch without tl.dot (prefetch, pages per block, warps, stages,
    # warps per SM) and with it (pages per block, warps, stages, warps per SM);
    # its chunks stay >= min_ch pages.
    stats_tune: Tuple[bool, int, int, Optional[int], int] = (True, 32, 1, None, 32)
    dot_stats_tune: Tuple[int, int, Optional[int], int] = (32, 2, 6, 16)
    min_ch: int = 128
    # Pages per program of the iteration and selection launches: the longest chunk
    # (<= max_ch_few / max_ch_many, by rows >= SMs) giving iter_per_sm programs per SM;
    # their warps; the selection tests blocks of <= sel_ch pages.
    max_ch_few: int = 4096
    max_ch_many: int = 8192
    iter_per_sm: float = 1.5
    iter_warps: int = 4
    sel_ch: int = 1024
    # Pages per block (one load, one register tile) of the iteration chunks.
    iter_block: int = 1024
    select_warps: int = 4


@dataclass(frozen=True)
class KernelConfig:
    """The stage configs plus the choices shared by all stages.

    Attributes:
        attention, topk, gaussian: the stages' launch choices.
        pdl: launch the step's kernels with programmatic dependent launch
            (sm_90+; ignored elsewhere): a kernel's programs may be scheduled
            while its predecessor drains, hiding the gap between dependent
            launches.
    """

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    topk: TopKConfig = field(default_factory=TopKConfig)
    gaussian: GaussianConfig = field(default_factory=GaussianConfig)
    pdl: bool = True


DEFAULT = KernelConfig()


def resolve(config) -> KernelConfig:
    """``config`` itself, or the defaults for None; anything else is a ValueError."""
    if config is None:
        return DEFAULT
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    return config
