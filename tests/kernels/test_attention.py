"""Attention kernels (kernels/attention/: split, solve, finish, combine) against the reference attention."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Full, TopK  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402
from entmaxkv.kernels import AttentionConfig, KernelConfig  # noqa: E402
from entmaxkv.kernels._common import launch_count  # noqa: E402
from entmaxkv.kernels.attention.plan import _max_share, _plan  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, rel_err  # noqa: E402
from entmaxkv.testing import random_case as case  # noqa: E402
from entmaxkv.types import Pending, Selection  # noqa: E402

AC = AttentionConfig()

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _cfg(c: AttentionConfig) -> KernelConfig:
    return KernelConfig(attention=c)


# attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype,G,P,D,slopes", [
    (torch.float32, 1, 8, 16, False), (torch.float16, 3, 4, 24, True), (torch.bfloat16, 4, 16, 40, True),
], ids=["f32-g1-p8", "f16-g3-p4-alibi", "bf16-g4-p16-d40"])
def test_dense_attend_matches_reference(alpha, dtype, G, P, D, slopes):
    cache, ids, q, sl = case([37, 130, 5, 1], 2, G, D, P, dtype, seed=2, slopes=slopes)
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3, slopes=sl)
    assert out.dtype == q.dtype and tau.dtype == torch.float32
    assert rel_err(out, ref) < TOL[dtype]
    assert (tau.double() - rtau).abs().max() < 1e-5


def test_split_loop_pipelined_only_for_dense_one_head_entmax():
    """Only the dense one-head entmax walk gets a pipelined loop (tl.range
    num_stages, dense_entmax_pipe_* by row count); page lists, softmax and the
    tl.dot paths keep none (measured slower with it). The interpreter runs the
    pipelined loop in the dense tests above."""
    dev = torch.device("cpu")  # 4 multiprocessors on the interpreter
    for rows, many in ((1, False), (8, True)):
        cfg = _plan(AC, rows, 1, 1, 32, 64, 16, dev, False, 2, dense=True)
        _, warps, stages = AC.dense_entmax_pipe_many if many else AC.dense_entmax_pipe_few
        assert (cfg["LOOP_STAGES"], cfg["num_warps"]) == (stages, warps)
        assert cfg["LOOP_STAGES"] is not None
    for NG, softmax, dense in ((1, False, False), (1, True, True), (1, True, False), (4, False, True), (4, True, True)):
        assert _plan(AC, 8, 1, NG, 32, 64, 16, dev, softmax, 2, dense=dense)["LOOP_STAGES"] is None


def _one_split_per_row(c, cache, G):
    """``c`` with every split-count setting of the entmax pass at 1 (one wave
    factor per path), checked: the dense walk of this cache runs one split per row."""
    c = dataclasses.replace(c, split_factor=1, entmax_wave_factor=1, dot_entmax_per_sm=1)
    M, P = cache.block_table.shape[1], cache.page_size
    assert _plan(c, 2, cache.kv_heads, G, 16, M, P, cache.k_pages.device, False, 4, dense=True)["NSPLIT"] == 1
    return c


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("vacc", ["block-acc", "row-acc", "finish"])
def test_dense_entmax_long_splits_many_candidates(alpha, G, vacc, launches):
    """One split per row walks ~90 tiles of nearly flat scores: slots collect
    many candidates (several staging rows), which the split program compacts
    in place; the result must still be exact. Long candidate lists also run
    the V pass through several blocks, with either accumulator (the GPU picks
    by head dim), or the one-launch finish over lists longer than its
    register tile (the solve and the compaction of the support from
    memory, in several blocks)."""
    c = AttentionConfig(finish=vacc == "finish")
    if vacc == "row-acc":
        c = dataclasses.replace(c, vacc_small_d=c.vacc_large_d)
    cache, ids, q, sl = case([2900, 61], 2, G, 16, 8, torch.float32, seed=12, key_scale=0.05)
    c = _one_split_per_row(c, cache, G)
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, config=_cfg(c))
    assert ("_attn_vacc_kernel" if vacc == "finish" else "_attn_finish_kernel") not in launches.names()
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("mode", ["memory", "runtime-choice"])
@pytest.mark.parametrize("sums", ["fused", "separate"])
def test_finish_support_from_memory_over_several_splits(alpha, mode, sums, launches):
    """The one-launch finish (_attn_finish_kernel) over candidate lists longer than its
    register tile, in several splits per row: the solve from memory, the
    support compacted chunk by chunk ([NSPLIT, BLOCK_M] columns at a time)
    into slots already read, then gathered back in that order. Nearly flat
    keys put most tokens in the support. runtime-choice: each row picks the
    register tile when its lists fit it (the 40-token row) or memory. The
    solve's sums in one multi-operand reduction per step (fused, the GPU's
    default; the interpreter's only here, fused_sums_interpreted, as it runs
    such a reduction element by element) or one reduction each."""
    c = AttentionConfig(fused_sums=sums == "fused", fused_sums_interpreted=sums == "fused", finish_max_splits=128,
                        solve_in_regs=mode != "memory", solve_tile=64)
    cache, ids, q, _ = case([300, 40], 2, 1, 16, 4, torch.float32, seed=17, key_scale=0.005)
    cfg = _plan(c, 2, 2, 1, 16, cache.block_table.shape[1], 4, q.device, False, 4, dense=True)
    assert cfg["NSPLIT"] >= 2 and 300 // cfg["NSPLIT"] > 2 * 32
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, config=_cfg(c))
    assert "_attn_finish_kernel" in launches.names() and "_attn_vacc_kernel" not in launches.names()
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=0.3)[0]
    assert (x[0] > rtau[0, :, None]).sum(-1).min() > 100  # (support over several chunks and splits)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("mode", ["memory", "runtime-choice"])
def test_finish_prune_drops_candidates_below_the_rows_bound(alpha, mode, launches):
    """finish_prune: lists longer than the register tile lose, in one pass,
    the candidates below the row's best lower bound on tau (the max over its
    splits), and the solve reads the rest. The split pass is the same with
    and without it, so its list lengths (cn, which the pruning finish
    rewrites) show what was dropped: fewer candidates, never fewer than the
    support, and the same exact output either way. Nearly flat keys, the
    first third of the long row's raised along its queries: the split
    holding them bounds tau far above the other split's own bound, whose
    whole list it then drops."""
    outs, lengths = [], []
    for prune in (False, True):
        c = AttentionConfig(finish_max_splits=128, solve_in_regs=mode != "memory", solve_tile=64,
                            finish_prune=prune)
        cache, ids, q, _ = case([300, 40], 2, 1, 16, 4, torch.float32, seed=23, key_scale=0.01)
        pages = cache.block_table[ids[0]].long()[:100 // 4]
        cache.k_pages[pages] += (q[0] / q[0].norm(dim=-1, keepdim=True))[None, :, None]  # [pages, H, P, D]
        cfg = _plan(c, 2, 2, 1, 16, cache.block_table.shape[1], 4, q.device, False, 4, dense=True)
        assert cfg["NSPLIT"] >= 2
        del launches[:]
        out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.5, config=_cfg(c))
        (kw,) = [k for n, _, k, _ in launches if n == "_attn_finish_kernel"]
        assert kw["PRUNE"] == prune
        (args,) = [a for n, a, _, _ in launches if n == "_attn_finish_kernel"]
        lengths.append(args[2].clone())  # cn [rows, NSPLIT]
        full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.5)
        ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.5)
        assert rel_err(out, ref) < TOL[torch.float32]
        assert (tau.double() - rtau).abs().max() < 1e-5
        outs.append(out)
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=0.5)[0]
    support = (x > rtau[..., None]).sum(-1).flatten()  # per (row, head)
    before, after = lengths[0].sum(-1), lengths[1].sum(-1)
    assert (after <= before).all() and (after >= support).all()
    assert (after[:2] < before[:2] // 2).all()  # the long row's heads lost most of their candidates
    assert rel_err(outs[1], outs[0]) < 1e-6


@pytest.mark.parametrize("G", [1, 2], ids=["one-head", "tl.dot"])
def test_finish_launch_rule(G, launches):
    """Which finish runs, on both paths: lists that may outgrow the register
    tile over more than finish_max_splits splits take the three launches;
    with finish_max_splits at the split count, or lists that always fit,
    the one launch."""
    c0 = AttentionConfig(finish_max_splits=1)
    cache, ids, q, _ = case([300, 40], 2, G, 16, 4, torch.float32, seed=17, key_scale=0.005)
    cfg = _plan(c0, 2, 2, G, 16, cache.block_table.shape[1], 4, q.device, False, 4, dense=True)
    assert cfg["NSPLIT"] >= 2 and cfg["USE_DOT"] == (G > 1)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.3)
    ref, _ = RA.attend(q.double(), cache, ids, full, alpha=1.5, scale=0.3)
    cases = ((64, 1, "three"), (64, cfg["NSPLIT"], "one"), (2**16, 1, "one"))  # (2**16: every list fits)
    for tile, most, path in cases:
        launches.clear()
        c = dataclasses.replace(c0, solve_tile=tile, finish_max_splits=most)
        out, _ = K.dense_attend(q, cache, ids, alpha=1.5, scale=0.3, config=_cfg(c))
        ran = launches.names()
        assert ("_attn_finish_kernel" in ran) == (path == "one") and ("_attn_vacc_kernel" in ran) == (path == "three")
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("lb_mode", [0, 1], ids=["three-reductions", "fused"])
@pytest.mark.parametrize("alpha", [1.5, 1.25, 3.0])
@pytest.mark.parametrize("G,fold", [(1, True), (4, True), (4, False)], ids=["g1", "g4-folded", "g4-zero-rows"])
def test_entmax_bound_update_modes(lb_mode, alpha, G, fold):
    """Both ways pass 1 raises its lower bound (lb_mode_*), on both paths, keep the result exact,
    dense and through a page list: one split per row of ~40 tiles, with a few
    large scores late in the row (the bound jumps) over nearly flat ones (many
    tokens in the support). alpha 3 takes no Newton step (the max only). With
    G = 4 the tl.dot rows repeat the heads and are folded (fold_rows), or are
    padded with zero rows."""
    c = AttentionConfig(lb_mode_one_head=lb_mode, lb_mode_dot_folded=lb_mode, lb_mode_dot_rows=lb_mode,
                        fold_rows=fold)
    cache, ids, q, sl = case([1250, 77], 2, G, 16, 8, torch.float32, seed=21, key_scale=0.05, slopes=True)
    cfg = _cfg(_one_split_per_row(c, cache, G))
    slot = cache.block_table[int(ids[0]), 1100 // 8]  # page of token 1100: its keys along the queries
    cache.k_pages[slot, :, :3] = q[0].view(2, G, 16).mean(1)[:, None].to(cache.dtype) * 2
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl, config=cfg)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5
    pages = full.pages.clone()  # the kept pages of each row in reverse order
    for b, n in enumerate(full.counts[:, 0].tolist()):
        pages[b, :, :n] = full.pages[b, :, :n].flip(-1)
    sel = Selection(pages, full.counts)
    out2, tau2 = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl, config=cfg)
    assert rel_err(out2, ref) < TOL[torch.float32]
    assert (tau2.double() - rtau).abs().max() < 1e-5


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("per_q", [False, True])
@pytest.mark.parametrize("variant", ["default", "three-launch-finish", "memory-solve-no-prefetch",
                                     "memory-finish"])
def test_attend_unsorted_selection_with_garbage_padding(alpha, per_q, variant, launches):
    """Pages in any order; entries past counts are ignored whatever they hold.
    Entmax finishes in one launch (_attn_finish_kernel, these lists are short), or
    (switched off) in three: the tau solve over candidates held in registers
    or (switched off too) reloaded from memory at every step, then the V pass
    and the combine; or in one launch solving from memory. The split kernel
    loads the next tile's page ids ahead or (switched off) at the top of each
    tile."""
    one = variant in ("default", "memory-finish")
    c = AttentionConfig(finish=one, finish_max_splits=128,
                        solve_in_regs=variant in ("default", "three-launch-finish"),
                        prefetch_pages=variant != "memory-solve-no-prefetch")
    H, G, P = 2, 3, 4
    cache, ids, q, sl = case([90, 41, 7], H, G, 16, P, torch.float32, seed=3, slopes=True)
    S = H * G if per_q else H
    M = cache.block_table.shape[1]
    gen = torch.Generator().manual_seed(5)
    W = 9
    pages = torch.randint(0, M, (3, S, W), generator=gen, dtype=torch.int32)  # garbage
    counts = torch.zeros(3, S, dtype=torch.int32)
    for b, n in enumerate([90, 41, 7]):
        npages = -(-n // P)
        for s in range(S):
            k = int(torch.randint(0, min(W, npages) + 1, (1,), generator=gen))
            pages[b, s, :k] = torch.randperm(npages, generator=gen)[:k].to(torch.int32)
            counts[b, s] = k
    out, tau = _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl, _cfg(c))
    if alpha != 1.0:  # (softmax takes neither)
        assert ("_attn_vacc_kernel" if one else "_attn_finish_kernel") not in launches.names()
    empty = (counts.repeat_interleave(H * G // S, dim=1) == 0).to(DEV)
    assert torch.isinf(tau[empty]).all() and (out[empty] == 0).all()  # no kept token: zeros, tau = +inf


def _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl, config=None):
    """K.attend over the selection (pages, counts) against the float64
    reference: output and, on rows that keep a page, tau."""
    sel = Selection(pages.to(DEV), counts.to(DEV))
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl, config=config)
    ref, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out, ref) < 2e-5
    fin = (counts.repeat_interleave(q.shape[1] // counts.shape[1], dim=1) > 0).to(DEV)
    assert (tau[fin].double() - rtau[fin]).abs().max() < 1e-5
    return out, tau


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,D,P,per_q", [(1, 16, 4, False), (3, 40, 8, False), (2, 24, 2, True)])
def test_attend_short_selection_finish_launch(alpha, dtype, G, D, P, per_q, launches):
    """A top-k-sized selection finishes in _attn_finish_kernel (no _solve, _vacc
    or _combine launch), over nearly flat keys: the support holds most kept
    tokens, so its compaction runs several 16-token V blocks on some rows;
    one row keeps no page (zeros, tau = +inf), another keeps one. With the
    policy's tau_hat as warm start where the selection comes from TopK."""
    cfg = _cfg(AttentionConfig(finish_block=16))
    H, lens = 2, [301, 57, 23]
    cache, ids, q, sl = case(lens, H, G, D, P, dtype, seed=31, key_scale=0.005)  # (ALiBi: the test above)
    S = H * G if per_q else H
    gen = torch.Generator().manual_seed(7)
    W = 24
    pages = torch.zeros(3, S, W, dtype=torch.int32)
    counts = torch.zeros(3, S, dtype=torch.int32)
    for b, n in enumerate(lens):
        npages = -(-n // P)
        for s in range(S):
            k = min(W, npages) if b != 2 else s % 2  # batch row 2: rows of zero and one page
            pages[b, s, :k] = torch.randperm(npages, generator=gen)[:k].to(torch.int32)
            counts[b, s] = k
    sel = Selection(pages.to(DEV), counts.to(DEV))
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl, tau_init=None, config=cfg)
    ref, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out, ref) < TOL[dtype]
    fin = (counts.repeat_interleave(H * G // S, dim=1) > 0).to(DEV)
    assert (tau[fin].double() - rtau[fin]).abs().max() < 1e-5
    assert torch.isinf(tau[~fin]).all() and (out[~fin] == 0).all()
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, sel, scale=0.4, slopes=sl)[0]
    support = (x > rtau[..., None]).sum(-1)
    assert support.max() > 2 * 16  # (three V blocks or more)
    pol = TopK(W * P, per_query_head=per_q)
    sel2 = K.select(pol, q, cache, ids, alpha=alpha, scale=0.4, slopes=sl, config=cfg)
    out2, tau2 = K.attend(q, cache, ids, sel2, alpha=alpha, scale=0.4, slopes=sl, tau_init=sel2.tau_hat, config=cfg)
    ref2, rtau2 = RA.attend(q.double(), cache, ids, sel2, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out2, ref2) < TOL[dtype]
    assert (tau2.double() - rtau2).abs().max() < 1e-5
    ran = launches.names()
    assert ran.count("_attn_finish_kernel") == 2
    assert not {"_attn_solve_kernel", "_attn_vacc_kernel", "_attn_combine_kernel"} & set(ran)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype,G,D,P,slopes,own,tail", [
    (torch.float32, 1, 16, 4, False, 16, 3), (torch.float16, 3, 24, 8, True, 0, 2),
    (torch.bfloat16, 2, 40, 2, True, 40, 5),
], ids=["f32-g1-own16-tail3", "f16-g3-alibi-own0-tail2", "bf16-g2-d40-alibi-own40-tail5"])
def test_finish_tail_gathers_long_supports(alpha, dtype, G, D, P, slopes, own, tail, launches):
    """Supports longer than finish_own: the finish gathers the first ``own``
    support tokens, _attn_vtail_kernel's ``tail`` programs per query head the
    rest, and the last to arrive writes the output; rows with a short
    support keep the finish's output. Nearly flat keys put most of the long
    rows in the support; dense and through a selection (short rows and an
    empty one), against the reference and against the finish alone, twice
    on one workspace (the arrival counters start from zero each call)."""
    from entmaxkv.workspace import Workspace

    H, lens = 2, [333, 150, 3]
    cache, ids, q, sl = case(lens, H, G, D, P, dtype, seed=41, key_scale=0.003, slopes=slopes)
    c = AttentionConfig(finish_max_splits=128, finish_block=16, finish_own=own, finish_tail=tail)
    alone = AttentionConfig(finish_max_splits=128, finish_block=16, finish_tail=1)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    M = full.pages.shape[2]
    counts = full.counts.clone()
    counts[2] = 0  # a row with no kept page (zeros, tau = +inf)
    sel = Selection(full.pages, counts)
    ws = Workspace(DEV)
    for run in ("dense", "selection"):
        got = []
        for cfg in (c, c, alone):
            launches.clear()
            ws.begin()
            if run == "dense":
                out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl, config=_cfg(cfg), ws=ws)
            else:
                out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl, config=_cfg(cfg), ws=ws)
            ws.end()
            ran = launches.names()
            assert "_attn_finish_kernel" in ran
            assert ran.count("_attn_vtail_kernel") == (cfg.finish_tail > 1 and M * P > cfg.finish_own)
            got.append((out.clone(), tau.clone()))
        ref_sel = full if run == "dense" else sel
        ref, rtau = RA.attend(q.double(), cache, ids, ref_sel, alpha=alpha, scale=0.3, slopes=sl)
        fin = torch.isfinite(rtau)
        for out, tau in got:
            assert rel_err(out, ref) < TOL[dtype]
            assert (tau[fin].double() - rtau[fin]).abs().max() < 1e-5
            assert torch.isinf(tau[~fin]).all() and (out[~fin] == 0).all()
        assert torch.equal(got[0][0], got[1][0])  # the same bits on a reused workspace
        assert rel_err(got[0][0].float(), got[2][0].float()) < (1e-6 if dtype == torch.float32 else 1e-2)
        x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, ref_sel, scale=0.3, slopes=sl)[0]
        support = (x > rtau[..., None]).sum(-1)
        assert support[0].max() > own + tail * 16  # every tail program of a long head has a block
        if own:
            assert support[2].max() <= own  # the short row keeps the finish's output


@pytest.mark.parametrize("min_tokens", [16, 60], ids=["4-pages", "15-pages"])
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_attend_one_head_list_min_split_share(min_tokens, alpha):
    """One head per program through page lists of very different lengths, with
    as many rows as SMs: each row spreads its kept pages evenly over only as
    many splits as give each split_min_tokens_* (the rest run no tile). Every
    kept page must still be read once: the result is exact."""
    c = AttentionConfig(split_min_tokens_few=4 * min_tokens, split_min_tokens_many=min_tokens)
    H, P, lens = 3, 4, [700, 300, 45]
    cache, ids, q, sl = case(lens, H, 1, 16, P, torch.float32, seed=9, slopes=True)
    W = 120
    cfg = _plan(c, 3, H, 1, 16, W, P, q.device, False, 4, dense=False)
    assert cfg["NSPLIT"] >= 3 and cfg["MIN_PER"] == min_tokens // P
    gen = torch.Generator().manual_seed(11)
    pages = torch.randint(0, cache.block_table.shape[1], (3, H, W), generator=gen, dtype=torch.int32)
    counts = torch.zeros(3, H, dtype=torch.int32)
    for b, n in enumerate(lens):
        npages = -(-n // P)
        for s, k in enumerate([min(W, npages), int(torch.randint(1, 9, (1,), generator=gen)),
                               int(torch.randint(0, min(W, npages) + 1, (1,), generator=gen))]):
            pages[b, s, :k] = torch.randperm(npages, generator=gen)[:k].to(torch.int32)
            counts[b, s] = k
    _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl, _cfg(c))


def test_candidate_room_covers_every_split_share():
    """The candidate buffer is sized by _max_share: no split may take more
    pages than that, whatever the count (brute force over every count)."""
    for W, nsplit, min_per in [(1, 1, 0), (100, 3, 0), (100, 6, 4), (2048, 6, 512), (3000, 44, 32), (77, 5, 16)]:
        worst = max(-(-c // (min(max(c // min_per, 1), nsplit) if min_per else nsplit)) for c in range(W + 1))
        assert worst <= _max_share(W, nsplit, min_per) <= max(worst, -(-W // nsplit)), (W, nsplit, min_per)


def test_float64_query_runs_in_float32():
    cache, ids, q, _ = case([50, 17], 1, 2, 16, 8, torch.float32, seed=4)
    out, tau = K.dense_attend(q.double(), cache, ids, alpha=1.5, scale=0.25)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.25)
    ref, _ = RA.attend(q.double(), cache, ids, full, alpha=1.5, scale=0.25)
    assert out.dtype == torch.float64 and rel_err(out, ref) < 1e-5


_WATCHED = ("_attn_split_softmax_kernel", "_attn_split_entmax_kernel", "_attn_finish_kernel", "_attn_combine_kernel",
            "_attn_solve_kernel")
_SPLIT = {1.0: "_attn_split_softmax_kernel"}


def _watched(launches):
    """(name, POLL, NSPLIT, the snapshot) of the watched attention launches."""
    return [(n, k.get("POLL"), k.get("NSPLIT"), snap) for n, _, k, snap in launches if n in _WATCHED]


@pytest.mark.parametrize("alpha,G,finish,published", [
    (1.0, 1, True, True), (1.5, 1, True, True), (1.5, 1, False, True), (2.0, 2, True, True),
    (1.5, 1, True, False), (1.0, 1, True, False),
], ids=["softmax", "entmax-finish", "entmax-3-launches", "gqa", "finish-poll-gives-up",
        "softmax-poll-gives-up"])
def test_attend_ready(alpha, G, finish, published, launches):
    """attend right after a selection that may still run (Selection.pending,
    poll_ready): the split programs wait for their row's counters[0]; with
    one query head per selection row and two launches they count into
    counters[1] and the finishing launch (_attn_finish_kernel, or _attn_combine_kernel
    for softmax) waits for each row's NSPLIT; otherwise (GQA rows, the
    three entmax launches) counters[1] is left alone. Rows never published
    (the polls give up after poll_polls = 3 loads; without PDL the
    selection had ended) give the same output, equal to attend without
    counters and close to the reference. Nothing polls once another step
    launch came after the selection (a second attend over the same
    Selection, or a select between) or without poll_ready."""
    c = AttentionConfig(finish=finish, poll_polls=3, poll_max_tokens=200)  # (the width here: at most this polls)
    cache, ids, q, sl = case([300, 7, 1001], 2, G, 24, 8, torch.float16, seed=11 + G, slopes=True)
    pol = TopK(200, sinks=1)
    ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    B, S = ref.counts.shape
    plain, tau0 = K.attend(q, cache, ids, Selection(ref.pages, ref.counts), alpha=alpha, scale=0.3, slopes=sl,
                           config=_cfg(c))
    ready = torch.zeros(2, B, S, dtype=torch.int32, device=DEV)
    ready[0] = 1 if published else 0
    launches.clear()
    launches.snap = lambda: ready[1].clone()
    sel = Selection(ref.pages, ref.counts, pending=Pending(ready, launch_count()))
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl, config=_cfg(c))
    assert torch.equal(out, plain) and torch.equal(tau, tau0)
    seen = _watched(launches)
    two = G == 1 and (alpha == 1.0 or finish)  # both launches poll
    split = _SPLIT.get(alpha, "_attn_split_entmax_kernel")
    assert seen[0][:2] == (split, 2 if two else 1)
    last = seen[-1]
    if two:
        assert last[0] == ("_attn_combine_kernel" if alpha == 1.0 else "_attn_finish_kernel") and last[1] is True
        assert bool((last[3] == last[2]).all()), last  # every split program counted in
        assert bool((ready[1] == last[2]).all())
    else:
        assert all(not p for _, p, _, _ in seen[1:]) and bool((last[3] == 0).all())
        assert bool((ready[1] == 0).all())
    assert bool((ready[0] == (1 if published else 0)).all())
    want, _ = RA.attend(q, cache, ids, ref, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, want) < 1e-2
    # not again: the attention above was a launch after the selection
    launches.clear()
    again, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl, config=_cfg(c))
    assert torch.equal(again, plain) and _watched(launches)[0][:2] == (split, 0)
    # a select between, poll_ready off, or a selection wider than
    # poll_max_tokens (25 pages of 8 here): no polling either
    for variant in ("between", "off", "wide"):
        sel = Selection(ref.pages, ref.counts, pending=Pending(ready, launch_count()))
        if variant == "between":
            K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
        cv = dataclasses.replace(c, poll_ready=variant != "off", poll_max_tokens=199 if variant == "wide" else 200)
        launches.clear()
        again, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl, config=_cfg(cv))
        assert torch.equal(again, plain) and _watched(launches)[0][:2] == (split, 0), variant
    bad = Selection(ref.pages, ref.counts, pending=Pending(ready[:1], launch_count()))
    with pytest.raises(ValueError, match="pending"):
        K.attend(q, cache, ids, bad, alpha=alpha, scale=0.3, config=_cfg(c))


# The 34 keys (head dim 3, float16) of a row the fuzz suite found: with alpha
# 3.79 the third largest score sits just above tau, and Halley's steps cycled
# between the two sides of the root without narrowing the bracket.
_CYCLE_KEYS = [
    1.161133, 0.928223, 0.438965, 1.338867, -0.757324, -1.234375,
    0.050842, 2.003906, 0.396484, -1.696289, -0.744629, 0.547363,
    -0.342529, -0.030334, -0.861328, 0.380371, -1.608398, -2.287109,
    -1.177734, -0.67334, 1.318359, -0.085083, 0.159668, 0.891602,
    0.930664, 1.389648, 1.742188, -0.387451, 0.321777, -1.03418,
    -0.825684, 1.177734, 0.375488, 0.338623, 0.631348, -0.277344,
    -0.521973, -0.460449, -1.742188, -0.722656, -0.415527, 0.120117,
    -0.728027, 0.276367, 0.268799, 0.066406, -1.442383, 0.362061,
    -0.963867, -1.455078, -1.451172, 0.426758, -0.955566, 0.738281,
    0.215088, -0.76123, 0.03067, -0.756348, -0.647949, 1.194336,
    -1.313477, -0.619629, -1.495117, 0.632324, -0.424072, -0.007118,
    -0.37793, 2.087891, -0.809082, -1.164062, -0.290771, -0.671875,
    0.609375, 1.522461, 0.605957, -1.233398, -1.173828, 1.883789,
    -0.60498, -0.11084, -0.109558, 0.692871, 0.611816, 0.351562,
    -0.812988, -0.86377, 2.091797, 0.673828, 0.402832, -0.072205,
    0.08197, 1.250977, 0.421631, -1.37793, 0.218994, -0.066711,
    -0.540039, -0.056427, 1.293945, -0.171753, 0.670898, -0.724121,
]


def test_entmax_solve_bisects_when_halley_cycles():
    """A step that does not shrink below half the one before the last is a
    bisection (as in the reference solver): the solve finds tau of the
    fuzz suite's row, whose near-boundary token then stays in the support,
    on the dense pass and through the finish kernel alike."""
    alpha, scale = 3.790645918954886, 0.505704248822797
    k = torch.tensor(_CYCLE_KEYS, dtype=torch.float16).view(34, 1, 3)
    v = torch.randn(34, 1, 3, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    cache = PagedKVCache(20, 3, 1, 3, max_seqs=1, max_pages_per_seq=20, dtype=torch.float16, device=DEV)
    slot = cache.allocate()
    cache.prefill(slot, k.to(DEV), v.to(DEV))
    ids = torch.tensor([slot], dtype=torch.int32, device=DEV)
    q = torch.tensor([[[-0.55224609375, 0.337890625, -0.08660888671875]]], dtype=torch.float16, device=DEV)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=scale)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=scale)
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=scale)[0].flatten()
    assert 0 < float(x.sort(descending=True).values[2] - rtau.flatten()[0]) < 0.01  # (the near-boundary token)
    for finish in (True, False):
        out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale,
                                  config=KernelConfig(attention=AttentionConfig(finish=finish)))
        assert (tau.double() - rtau).abs().max() < 1e-5
        assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype,G,P,slopes", [
    (torch.float32, 1, 4, False), (torch.float16, 2, 8, True), (torch.bfloat16, 3, 4, True),
], ids=["f32-g1", "f16-g2-alibi", "bf16-g3-alibi"])
def test_attend_starts_at_the_selections_lower_bound(alpha, dtype, G, P, slopes, launches):
    """Selection.tau_lower (a proven lower bound on tau over the kept tokens,
    as the certified policy's tau over its seed): the split pass stages only
    scores at or above it from its first tile. The output and tau equal the
    reference whether the bound is loose (tau over a few pages), exact
    (tau itself, rounded to float32) or absent (NaN, +inf: no bound); the
    lists are never shorter than the support, with the exact bound they are
    the support, and on the long row much shorter than without a bound. Nearly flat keys,
    the last 96 of the long row's raised along its queries: until it reaches
    them, the split pass has no bound of its own near tau and keeps every
    token it scores."""
    H = 2
    lens = [301, 77, 6]
    cache, ids, q, sl = case(lens, H, G, 24, P, dtype, seed=31, slopes=slopes, key_scale=0.01)
    npages = -(-lens[0] // P)
    pages = cache.block_table[ids[0]].long()[npages - 96 // P: npages]
    lift = q[0].float().view(H, G, -1).mean(1)
    cache.k_pages[pages] += (lift / lift.norm(dim=-1, keepdim=True)).to(dtype)[None, :, None]  # [pages, H, P, D]
    c = AttentionConfig(finish_prune=False)  # (a pruning finish rewrites the lists' lengths)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.4, slopes=sl)
    few = RP.select(TopK(3), q, cache, ids, alpha=alpha, scale=0.4, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.4, slopes=sl)
    _, seed_tau = RA.attend(q.double(), cache, ids, few, alpha=alpha, scale=0.4, slopes=sl)
    assert (seed_tau <= rtau).all()
    nan_rows = torch.full_like(rtau, float("nan"))
    nan_rows[0] = float("inf")
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=0.4, slopes=sl)[0]
    support = (x > rtau[..., None]).sum(-1).flatten()  # per (row, head)
    pages, counts = full.pages.to(DEV), full.counts.to(DEV)
    lengths = {}
    for name, lower in [("none", None), ("seed", seed_tau), ("exact", rtau), ("not finite", nan_rows)]:
        sel = Selection(pages, counts, tau_lower=None if lower is None else lower.to(torch.float32).to(DEV))
        del launches[:]
        out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl, config=_cfg(c))
        (kw,) = [k for n, _, k, _ in launches if n == "_attn_split_entmax_kernel"]
        assert kw["HAS_LB0"] == (lower is not None)
        (args,) = [a for n, a, _, _ in launches if n == "_attn_split_entmax_kernel"]
        assert rel_err(out, ref) < TOL[dtype], name
        assert (tau.double() - rtau).abs().max() < 1e-5 * (1 + rtau.abs().max()), name
        lengths[name] = args[10].sum(-1)  # cn [rows, NSPLIT] -> candidates per (row, head)
    for name in ("seed", "exact"):
        assert (lengths[name] >= support).all() and (lengths[name] <= lengths["none"]).all(), name
    assert torch.equal(lengths["not finite"], lengths["none"])
    assert (lengths["exact"] <= support + 2).all()  # (ties with tau within the start's margin)
    long_rows = slice(0, H * G)  # (the 301-token row)
    assert (lengths["exact"][long_rows] * 2 < lengths["none"][long_rows]).any()


def test_attend_refuses_a_misshapen_lower_bound():
    cache, ids, q, _ = case([20, 9], 2, 1, 16, 4, torch.float32, seed=1)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.4)
    for bad in (torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.float64), "tau"):
        sel = Selection(full.pages.to(DEV), full.counts.to(DEV), tau_lower=bad)
        with pytest.raises(ValueError, match="tau_lower"):
            K.attend(q, cache, ids, sel, alpha=1.5, scale=0.4)
