"""Launch plan of the attention passes from shapes and the AttentionConfig only
(no GPU value is read, so a captured graph replays the same plan)."""
from __future__ import annotations

from ..config import AttentionConfig
from .._common import cdiv, interpreting, next_pow2, num_sms


def _plan(c: AttentionConfig, B: int, S: int, NG: int, D: int, W: int, P: int, device, softmax: bool,
          itemsize: int = 2, dense: bool = True) -> dict:
    """Block sizes and split count from shapes and ``c`` only (graph-capturable)."""
    # Measured on the H200 (benchmarks/tune.py; experiments/logs/tune*.log):
    # one head per program, d 32: softmax 256 x 4 warps, entmax 512 x 8 warps
    # through a selection's page list (dense: dense_entmax_pipe_*), 3 stages;
    # tl.dot path, d 128 bf16: softmax 32 x 4 warps x 6 stages (dense: 32 x 2
    # warps x 4 stages, 3.88 per SM), entmax (K only) 128 x 4 warps x 3 stages
    # at 2 programs per SM. Deep pipelines of small tiles win there; the stage
    # count is capped so the buffers stay within ~160 KB of shared memory for
    # any head dim and dtype.
    use_dot = NG >= 2
    block_d = next_pow2(D)
    rows = B * S
    many = rows >= num_sms(device)
    loop_stages = None  # tl.range num_stages of the split loop (None: not pipelined)
    if use_dot:
        block_g = max(16, next_pow2(NG))
        block_d = max(16, block_d)
        warps = 4
        if softmax:
            block_t, depth = max(16, min(32, 4096 // block_d)), 6
            if dense:  # with the page-id prefetch (dense_prefetch_dot_softmax)
                depth, warps = 4, 2
        else:  # (3 stages through a page list, and with the prefetch dense: GQA 4 x 32k 0.145 -> 0.138 ms)
            block_t, depth = max(16, min(128, 16384 // block_d)), 3
        stage_bytes = block_t * block_d * itemsize * (2 if softmax else 1)
        stages = max(2, min(depth, (160 * 1024) // stage_bytes))
    else:
        block_g = 1
        if softmax:
            block_t, warps = max(16, min(256, 8192 // block_d)), 4
        elif dense:  # software-pipelined (tiles measured at d 32; larger head dims keep the tile's elements)
            pipe_t, warps, loop_stages = c.dense_entmax_pipe_many if many else c.dense_entmax_pipe_few
            block_t = max(16, pipe_t * 32 // max(32, block_d))
        else:  # through a page list, with the page-id prefetch: 512-token tiles at d 32 (docs/tuning.md)
            block_t, warps = max(16, min(512, 16384 // block_d)), 8
        stages = 3
    if use_dot:
        factor = c.dot_softmax_dense_factor if dense else c.dot_softmax_list_factor
    elif not softmax and dense and many:
        factor = c.entmax_wave_factor
    else:
        factor = c.split_factor
    small = (not use_dot and not dense and block_d <= 64 and W * P <= c.small_sel_tokens
             and (softmax or not many))
    if small:
        (block_t, warps, stages), factor = c.small_sel, c.small_sel_factor
    key = (NG, D, softmax)
    tuned = dict(c.tune)
    if key in tuned:
        (block_t, warps, stages), factor = tuned[key], c.split_factor
    if interpreting():
        block_t = min(block_t, 32)
    if use_dot and not softmax:
        want = max(1, int(c.dot_entmax_per_sm * num_sms(device)) // rows)
    else:
        want = cdiv(max(1, int(factor * num_sms(device))), rows)
    tokens = W * P
    nsplit = max(1, min(want, W, 128, max(1, tokens // (2 * block_t))))
    dense_prefetch = ((c.dense_prefetch_dot_softmax if softmax else c.dense_prefetch_dot_entmax) if use_dot
                      else (c.dense_prefetch_one_head_softmax if softmax else c.dense_prefetch_one_head_entmax))
    prefetch = c.prefetch_pages and (not dense or dense_prefetch)
    # (not for short selections: their many small programs are the point)
    min_per = (c.split_min_tokens_many if many else c.split_min_tokens_few) // P if (not use_dot and not softmax and not dense and not small) else 0
    fold = use_dot and not softmax and c.fold_rows and NG == next_pow2(NG) and NG < block_g
    path = ("dot_folded" if fold else "dot_rows") if use_dot else "one_head"  # (the lb_mode_* field)
    return dict(USE_DOT=use_dot, BLOCK_G=block_g, R=NG if fold else block_g, BLOCK_D=block_d, BLOCK_T=block_t,
                NSPLIT=nsplit, MIN_PER=min_per, PREFETCH=prefetch, PATH=path, num_warps=warps,
                num_stages=stages, LOOP_STAGES=loop_stages)


def _max_share(W: int, nsplit: int, min_per: int) -> int:
    """The most pages one split takes from a row of at most W kept pages (the
    split kernel's shares: ceil(count / used) over used splits)."""
    share = cdiv(W, nsplit)
    if min_per > 0:  # used = clamp(count // min_per, 1, nsplit): the largest count for each used < nsplit
        for used in range(1, nsplit):
            share = max(share, cdiv(min(W, (used + 1) * min_per - 1), used))
    return share


def _tail_programs(c: AttentionConfig, R: int, W: int, P: int, device) -> int:
    """Programs per query head of _attn_vtail_kernel after the one-launch
    finish of R = B * HQ rows keeping at most W pages of P tokens; 1: no
    tail launch (finish_tail 1, or no row can keep more than finish_own
    tokens, or the rows alone fill the SMs)."""
    if c.finish_tail == 1 or W * P <= c.finish_own:
        return 1
    return c.finish_tail if c.finish_tail > 1 else max(1, min(32, num_sms(device) // R))
