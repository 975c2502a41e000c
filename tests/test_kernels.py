"""Triton kernels against the pure-PyTorch reference (entmaxkv.kernels vs entmaxkv.*).

Without a GPU the kernels run on Triton's CPU interpreter: TRITON_INTERPRET=1
must be set before the kernel modules are imported (Triton picks the
interpreter when ``@triton.jit`` runs), so this module sets it at import and,
should another test have imported the kernels first in compiled mode, drops
those modules and imports them again. The reference stays on the CPU either way.

Shapes are small and odd on purpose (lengths 1, 5, 37, 130, ..., head dims
16/24/40, GQA groups 1/3/4, page sizes 1..16, shuffled block tables with
spare pages); errors are relative RMS against a float64 reference run;
selections are compared as sets.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from helpers import load_kernels  # noqa: E402

K = load_kernels()

from entmaxkv import Certified, Full, Gaussian, TopK, decode  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.gaussian import pooled_moments, solve_tau_hat  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402
from entmaxkv.types import Pending, Selection  # noqa: E402
from helpers import alibi, random_cache, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
# relative RMS error of the kernel output against the float64 reference: the
# math is float32, the output is rounded to the query dtype.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def setup(lens, H, G, D, P, dtype=torch.float32, seed=0, key_scale=1.5, slopes=False):
    cache, slots, _, _ = random_cache(list(lens), H, D, P, dtype=dtype, seed=seed, key_scale=key_scale,
                                      device=DEV)
    gen = torch.Generator().manual_seed(seed + 101)
    q = (torch.randn(len(lens), H * G, D, generator=gen) * 1.5).to(dtype).to(DEV)
    ids = torch.tensor(slots, dtype=torch.int32, device=DEV)
    sl = alibi(H * G).to(DEV) if slopes else None
    return cache, ids, q, sl


def page_sets(sel):
    B, S, _ = sel.pages.shape
    p, c = sel.pages.cpu(), sel.counts.cpu()
    return [[set(p[b, s, : int(c[b, s])].tolist()) for s in range(S)] for b in range(B)]


# ---------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,G,slopes", [
    (torch.float32, 1, False), (torch.float16, 3, True), (torch.bfloat16, 4, True), (torch.float16, 2, False),
], ids=["f32-g1", "f16-g3-alibi", "bf16-g4-alibi", "f16-g2"])
def test_scoring_matches_reference(dtype, G, slopes):
    cache, ids, q, sl = setup([37, 130, 5], 2, G, 24, 8, dtype, seed=1, slopes=slopes)
    ub = K.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    rub = RS.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    fin = torch.isfinite(rub)
    assert torch.equal(torch.isfinite(ub), fin)
    assert rel_err(ub[fin], rub[fin]) < 1e-6
    mu, sg, n = K.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    rmu, rsg, rn = RS.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    assert rel_err(mu, rmu) < 1e-6 and rel_err(sg, rsg) < 1e-6 and torch.equal(n, rn.float())


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype,G,P,D,slopes", [
    (torch.float32, 1, 8, 16, False), (torch.float16, 3, 4, 24, True), (torch.bfloat16, 4, 16, 40, True),
], ids=["f32-g1-p8", "f16-g3-p4-alibi", "bf16-g4-p16-d40"])
def test_dense_attend_matches_reference(alpha, dtype, G, P, D, slopes):
    cache, ids, q, sl = setup([37, 130, 5, 1], 2, G, D, P, dtype, seed=2, slopes=slopes)
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3, slopes=sl)
    assert out.dtype == q.dtype and tau.dtype == torch.float32
    assert rel_err(out, ref) < TOL[dtype]
    assert (tau.double() - rtau).abs().max() < 1e-5


def test_split_loop_pipelined_only_for_dense_one_head_entmax():
    """Only the dense one-head entmax walk gets a pipelined loop (tl.range
    num_stages, DENSE_ENTMAX_PIPE by row count); page lists, softmax and the
    tl.dot paths keep none (measured slower with it). The interpreter runs the
    pipelined loop in the dense tests above."""
    A = sys.modules["entmaxkv.kernels.attention"]
    dev = torch.device("cpu")  # 4 multiprocessors on the interpreter
    for rows, many in ((1, False), (8, True)):
        cfg = A._plan(rows, 1, 1, 32, 64, 16, dev, False, 2, dense=True)
        _, warps, stages = A.DENSE_ENTMAX_PIPE[many]
        assert (cfg["LOOP_STAGES"], cfg["num_warps"]) == (stages, warps)
        assert cfg["LOOP_STAGES"] is not None
    for NG, softmax, dense in ((1, False, False), (1, True, True), (1, True, False), (4, False, True), (4, True, True)):
        assert A._plan(8, 1, NG, 32, 64, 16, dev, softmax, 2, dense=dense)["LOOP_STAGES"] is None


class _Forbidden:
    """Stands in for a kernel that the path under test must not launch."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} was launched")


def _one_split_per_row(monkeypatch, cache, G):
    """Every split-count knob of the entmax pass set to 1 (one wave factor
    per path), checked: the dense walk of this cache runs one split per row."""
    A = sys.modules["entmaxkv.kernels.attention"]
    for knob in ("SPLIT_FACTOR", "ENTMAX_WAVE_FACTOR", "DOT_ENTMAX_PER_SM"):
        monkeypatch.setattr(A, knob, 1)
    M, P = cache.block_table.shape[1], cache.page_size
    assert A._plan(2, cache.kv_heads, G, 16, M, P, cache.k_pages.device, False, 4, dense=True)["NSPLIT"] == 1


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("vacc", ["block-acc", "row-acc", "finish"])
def test_dense_entmax_long_splits_many_candidates(alpha, G, vacc, monkeypatch):
    """One split per row walks ~90 tiles of nearly flat scores: slots collect
    many candidates (several staging rows), which the split program compacts
    in place; the result must still be exact. Long candidate lists also run
    the V pass through several blocks, with either accumulator (the GPU picks
    by head dim), or the one-launch finish over lists longer than its
    register tile (the solve and the compaction of the support from
    memory, in several blocks)."""
    A = sys.modules["entmaxkv.kernels.attention"]
    if vacc == "row-acc":
        monkeypatch.setattr(A, "VACC_SMALL_D", A.VACC_LARGE_D)
    monkeypatch.setattr(A, "FINISH", vacc == "finish")
    monkeypatch.setattr(A, "_vacc_kernel" if vacc == "finish" else "_finish_kernel", _Forbidden("not this path"))
    cache, ids, q, sl = setup([2900, 61], 2, G, 16, 8, torch.float32, seed=12, key_scale=0.05)
    _one_split_per_row(monkeypatch, cache, G)
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("mode", ["memory", "runtime-choice"])
@pytest.mark.parametrize("sums", ["fused", "separate"])
def test_finish_support_from_memory_over_several_splits(alpha, mode, sums, monkeypatch):
    """The one-launch finish (_finish_kernel) over candidate lists longer than its
    register tile, in several splits per row: the solve from memory, the
    support compacted chunk by chunk ([NSPLIT, BLOCK_M] columns at a time)
    into slots already read, then gathered back in that order. Nearly flat
    keys put most tokens in the support. runtime-choice: each row picks the
    register tile when its lists fit it (the 40-token row) or memory. The
    solve's sums in one multi-operand reduction per step (fused, the GPU's
    default; the interpreter's only here, FUSED_SUMS_INTERPRETED, as it runs
    such a reduction element by element) or one reduction each."""
    A = sys.modules["entmaxkv.kernels.attention"]
    monkeypatch.setattr(A, "FUSED_SUMS", sums == "fused")
    monkeypatch.setattr(A, "FUSED_SUMS_INTERPRETED", sums == "fused")
    monkeypatch.setattr(A, "FINISH_MAX_SPLITS", 128)
    monkeypatch.setattr(A, "SOLVE_IN_REGS", mode != "memory")
    monkeypatch.setattr(A, "SOLVE_TILE", 64)
    monkeypatch.setattr(A, "_vacc_kernel", _Forbidden("_vacc_kernel"))
    cache, ids, q, _ = setup([300, 40], 2, 1, 16, 4, torch.float32, seed=17, key_scale=0.005)
    cfg = A._plan(2, 2, 1, 16, cache.block_table.shape[1], 4, q.device, False, 4, dense=True)
    assert cfg["NSPLIT"] >= 2 and 300 // cfg["NSPLIT"] > 2 * 32
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=0.3)[0]
    assert (x[0] > rtau[0, :, None]).sum(-1).min() > 100  # (support over several chunks and splits)


@pytest.mark.parametrize("G,want", [(1, "three"), (2, "one")], ids=["one-head", "tl.dot"])
def test_finish_launch_rule(G, want, monkeypatch):
    """Which finish runs: lists that may outgrow the register tile over more
    than FINISH_MAX_SPLITS splits keep the three launches on the one-head
    path and take the one launch on the tl.dot path (what was measured
    faster); lists that always fit take the one launch on both."""
    A = sys.modules["entmaxkv.kernels.attention"]
    monkeypatch.setattr(A, "FINISH_MAX_SPLITS", 1)
    cache, ids, q, _ = setup([300, 40], 2, G, 16, 4, torch.float32, seed=17, key_scale=0.005)
    cfg = A._plan(2, 2, G, 16, cache.block_table.shape[1], 4, q.device, False, 4, dense=True)
    assert cfg["NSPLIT"] >= 2 and cfg["USE_DOT"] == (G > 1)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.3)
    ref, _ = RA.attend(q.double(), cache, ids, full, alpha=1.5, scale=0.3)
    for tile, path in ((64, want), (2**16, "one")):  # (2**16: every list fits)
        monkeypatch.setattr(A, "SOLVE_TILE", tile)
        forbid = ("_vacc_kernel",) if path == "one" else ("_finish_kernel",)
        with monkeypatch.context() as m:
            for name in forbid:
                m.setattr(A, name, _Forbidden(name))
            out, _ = K.dense_attend(q, cache, ids, alpha=1.5, scale=0.3)
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("lb_mode", [0, 1], ids=["three-reductions", "fused"])
@pytest.mark.parametrize("alpha", [1.5, 1.25, 3.0])
@pytest.mark.parametrize("G,fold", [(1, True), (4, True), (4, False)], ids=["g1", "g4-folded", "g4-zero-rows"])
def test_entmax_bound_update_modes(lb_mode, alpha, G, fold, monkeypatch):
    """Both ways pass 1 raises its lower bound (LB_MODE), on both paths, keep the result exact,
    dense and through a page list: one split per row of ~40 tiles, with a few
    large scores late in the row (the bound jumps) over nearly flat ones (many
    tokens in the support). alpha 3 takes no Newton step (the max only). With
    G = 4 the tl.dot rows repeat the heads and are folded (FOLD_ROWS), or are
    padded with zero rows."""
    A = sys.modules["entmaxkv.kernels.attention"]
    monkeypatch.setattr(A, "LB_MODE", dict.fromkeys(A.LB_MODE, lb_mode))
    monkeypatch.setattr(A, "FOLD_ROWS", fold)
    cache, ids, q, sl = setup([1250, 77], 2, G, 16, 8, torch.float32, seed=21, key_scale=0.05, slopes=True)
    _one_split_per_row(monkeypatch, cache, G)
    slot = cache.block_table[int(ids[0]), 1100 // 8]  # page of token 1100: its keys along the queries
    cache.k_pages[slot, :, :3] = q[0].view(2, G, 16).mean(1)[:, None].to(cache.dtype) * 2
    out, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    full = RP.select(Full(), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (tau.double() - rtau).abs().max() < 1e-5
    pages = full.pages.clone()  # the kept pages of each row in reverse order
    for b, c in enumerate(full.counts[:, 0].tolist()):
        pages[b, :, :c] = full.pages[b, :, :c].flip(-1)
    sel = Selection(pages, full.counts)
    out2, tau2 = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out2, ref) < TOL[torch.float32]
    assert (tau2.double() - rtau).abs().max() < 1e-5


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("per_q", [False, True])
@pytest.mark.parametrize("variant", ["default", "three-launch-finish", "memory-solve-no-prefetch",
                                     "memory-finish"])
def test_attend_unsorted_selection_with_garbage_padding(alpha, per_q, variant, monkeypatch):
    """Pages in any order; entries past counts are ignored whatever they hold.
    Entmax finishes in one launch (_finish_kernel, these lists are short), or
    (switched off) in three: the tau solve over candidates held in registers
    or (switched off too) reloaded from memory at every step, then the V pass
    and the combine; or in one launch solving from memory. The split kernel
    loads the next tile's page ids ahead or (switched off) at the top of each
    tile."""
    A = sys.modules["entmaxkv.kernels.attention"]
    one = variant in ("default", "memory-finish")
    monkeypatch.setattr(A, "FINISH", one)
    monkeypatch.setattr(A, "FINISH_MAX_SPLITS", 128)
    monkeypatch.setattr(A, "SOLVE_IN_REGS", variant in ("default", "three-launch-finish"))
    monkeypatch.setattr(A, "PREFETCH_PAGES", variant != "memory-solve-no-prefetch")
    forbid = "_vacc_kernel" if one else "_finish_kernel"
    if alpha != 1.0:  # (softmax takes neither)
        monkeypatch.setattr(A, forbid, _Forbidden(forbid))
    H, G, P = 2, 3, 4
    cache, ids, q, sl = setup([90, 41, 7], H, G, 16, P, torch.float32, seed=3, slopes=True)
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
    out, tau = _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl)
    empty = (counts.repeat_interleave(H * G // S, dim=1) == 0).to(DEV)
    assert torch.isinf(tau[empty]).all() and (out[empty] == 0).all()  # no kept token: zeros, tau = +inf


def _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl):
    """K.attend over the selection (pages, counts) against the float64
    reference: output and, on rows that keep a page, tau."""
    sel = Selection(pages.to(DEV), counts.to(DEV))
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl)
    ref, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out, ref) < 2e-5
    fin = (counts.repeat_interleave(q.shape[1] // counts.shape[1], dim=1) > 0).to(DEV)
    assert (tau[fin].double() - rtau[fin]).abs().max() < 1e-5
    return out, tau


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,D,P,per_q", [(1, 16, 4, False), (3, 40, 8, False), (2, 24, 2, True)])
def test_attend_short_selection_finish_launch(alpha, dtype, G, D, P, per_q, monkeypatch):
    """A top-k-sized selection finishes in _finish_kernel (no _solve, _vacc
    or _combine launch), over nearly flat keys: the support holds most kept
    tokens, so its compaction runs several 16-token V blocks on some rows;
    one row keeps no page (zeros, tau = +inf), another keeps one. With the
    policy's tau_hat as warm start where the selection comes from TopK."""
    A = sys.modules["entmaxkv.kernels.attention"]
    monkeypatch.setattr(A, "FINISH_BLOCK", 16)
    for name in ("_solve_kernel", "_vacc_kernel", "_combine_kernel"):
        monkeypatch.setattr(A, name, _Forbidden(name))
    H, lens = 2, [301, 57, 23]
    cache, ids, q, sl = setup(lens, H, G, D, P, dtype, seed=31, key_scale=0.005)  # (ALiBi: the test above)
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
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl, tau_init=None)
    ref, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out, ref) < TOL[dtype]
    fin = (counts.repeat_interleave(H * G // S, dim=1) > 0).to(DEV)
    assert (tau[fin].double() - rtau[fin]).abs().max() < 1e-5
    assert torch.isinf(tau[~fin]).all() and (out[~fin] == 0).all()
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, sel, scale=0.4, slopes=sl)[0]
    support = (x > rtau[..., None]).sum(-1)
    assert support.max() > 2 * 16  # (three V blocks or more)
    pol = TopK(W * P, per_query_head=per_q)
    sel2 = K.select(pol, q, cache, ids, alpha=alpha, scale=0.4, slopes=sl)
    out2, tau2 = K.attend(q, cache, ids, sel2, alpha=alpha, scale=0.4, slopes=sl, tau_init=sel2.tau_hat)
    ref2, rtau2 = RA.attend(q.double(), cache, ids, sel2, alpha=alpha, scale=0.4, slopes=sl)
    assert rel_err(out2, ref2) < TOL[dtype]
    assert (tau2.double() - rtau2).abs().max() < 1e-5


@pytest.mark.parametrize("min_tokens", [16, 60], ids=["4-pages", "15-pages"])
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_attend_one_head_list_min_split_share(min_tokens, alpha, monkeypatch):
    """One head per program through page lists of very different lengths, with
    as many rows as SMs: each row spreads its kept pages evenly over only as
    many splits as give each SPLIT_MIN_TOKENS (the rest run no tile). Every
    kept page must still be read once: the result is exact."""
    A = sys.modules["entmaxkv.kernels.attention"]
    monkeypatch.setattr(A, "SPLIT_MIN_TOKENS", {False: 4 * min_tokens, True: min_tokens})
    H, P, lens = 3, 4, [700, 300, 45]
    cache, ids, q, sl = setup(lens, H, 1, 16, P, torch.float32, seed=9, slopes=True)
    W = 120
    cfg = A._plan(3, H, 1, 16, W, P, q.device, False, 4, dense=False)
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
    _attend_vs_reference(q, cache, ids, pages, counts, alpha, sl)


def test_candidate_room_covers_every_split_share():
    """The candidate buffer is sized by _max_share: no split may take more
    pages than that, whatever the count (brute force over every count)."""
    A = sys.modules["entmaxkv.kernels.attention"]
    for W, nsplit, min_per in [(1, 1, 0), (100, 3, 0), (100, 6, 4), (2048, 6, 512), (3000, 44, 32), (77, 5, 16)]:
        worst = max(-(-c // (min(max(c // min_per, 1), nsplit) if min_per else nsplit)) for c in range(W + 1))
        assert worst <= A._max_share(W, nsplit, min_per) <= max(worst, -(-W // nsplit)), (W, nsplit, min_per)


def test_float64_query_runs_in_float32():
    cache, ids, q, _ = setup([50, 17], 1, 2, 16, 8, torch.float32, seed=4)
    out, tau = K.dense_attend(q.double(), cache, ids, alpha=1.5, scale=0.25)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.25)
    ref, _ = RA.attend(q.double(), cache, ids, full, alpha=1.5, scale=0.25)
    assert out.dtype == torch.float64 and rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [
    TopK(24), TopK(64, sinks=1, window=2), TopK(40, per_query_head=True), TopK(16, sinks=3, window=1),
], ids=["k24", "k64-sinks-window", "k40-per-q", "k16-sinks3"])
@pytest.mark.parametrize("P,lens", [(4, [37, 1300, 5]), (8, [2100, 1, 333])], ids=["p4", "p8"])
@pytest.mark.parametrize("merge", ["regs", "loop"])
def test_topk_select_matches_reference(policy, P, lens, merge, monkeypatch):
    """lens with 1300/2100 tokens span several chunks: the merge kernel runs,
    with the row's candidates in registers or (MERGE_REGS = 1) streamed."""
    if merge == "loop":
        monkeypatch.setattr(sys.modules["entmaxkv.kernels.topk"], "MERGE_REGS", 1)
    cache, ids, q, sl = setup(lens, 2, 3, 16, P, torch.float16, seed=6, slopes=True)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert sel.pages.shape == ref.pages.shape
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("policy", [TopK(24), TopK(40, sinks=1, window=2)], ids=["k24", "k40-sinks-window"])
@pytest.mark.parametrize("dtype,H,D,P,slopes", [
    (torch.float16, 3, 24, 4, True), (torch.bfloat16, 5, 16, 8, False), (torch.float32, 2, 40, 1, True),
], ids=["f16-h3-alibi", "bf16-h5", "f32-h2-p1-alibi"])
@pytest.mark.parametrize("all_heads", [True, "rowsel", False], ids=["all-heads", "all-heads-rowsel", "per-head"])
def test_topk_one_query_head_per_kv_head(policy, dtype, H, D, P, slopes, all_heads, monkeypatch):
    """MHA (G = 1): _keys_kernel scores every head of a page in one program
    (odd head counts pad to a power of two), then the chunked chain or
    (rowsel, forced sink / window pages among the keys) _rowsel_kernel; the
    per-head path must agree."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    monkeypatch.setattr(tk, "ALL_HEADS", bool(all_heads))
    monkeypatch.setattr(tk, "ROWSEL", all_heads == "rowsel")
    monkeypatch.setattr(tk, "ROWSEL_MIN_PAGES", 0)
    cache, ids, q, sl = setup([700, 3, 1100], H, 1, D, P, dtype, seed=9, slopes=slopes)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert sel.pages.shape == ref.pages.shape
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)


def _spy_rowsel(monkeypatch, tk):
    """Record (cnt, nchk) of every launch_rowsel call, after it ran."""
    calls = []
    real = tk.launch_rowsel

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append((k.get("cnt"), k.get("nchk", 0)))
        return out
    monkeypatch.setattr(tk, "launch_rowsel", spy)
    return calls


def test_rowsel_dispatch(monkeypatch):
    """use_rowsel picks _rowsel_kernel except for short rows with small
    budgets when rows >= SMs (the benchmark's 8 x 32k top-k 1024), and
    select_topk follows it (a spy on launch_rowsel), the pages right either way."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    assert not tk.use_rowsel(64, 2048, 192, 132)  # 8 x 32k top-k 1024: the chunked chain
    assert tk.use_rowsel(256, 2048, 192, 132)  # top-k 4096
    assert tk.use_rowsel(64, 8192, 192, 132)  # 8 x 128k
    assert tk.use_rowsel(64, 2048, 24, 132)  # batch 1
    assert not tk.use_rowsel(1024, 2**17, 24, 132)  # wider than ROWSEL_MAX_W
    calls = _spy_rowsel(monkeypatch, tk)
    for lens, H, policy, want in [([700, 3], 1, TopK(24), True), ([700, 3, 1100], 2, TopK(24), False),
                                  ([700, 3, 1100], 2, TopK(300), True)]:
        calls.clear()
        cache, ids, q, _ = setup(lens, H, 1, 16, 4, torch.float16, seed=H + len(lens))
        sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3)
        ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3)
        assert bool(calls) == want  # 4 SMs on the interpreter: rows >= 4 with W <= 64 take the chain
        assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
        assert page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("policy", [TopK(24), TopK(40, sinks=1, window=2), TopK(300)],
                         ids=["k24", "k40-sinks-window", "k300"])
@pytest.mark.parametrize("dtype,H,D,P,slopes,lens", [
    (torch.float16, 3, 24, 4, True, [700, 3, 1100]), (torch.bfloat16, 5, 16, 8, False, [1500, 2]),
    (torch.float32, 2, 40, 1, True, [37, 900, 1, 401]),
], ids=["f16-h3-b3-alibi", "bf16-h5-b2", "f32-h2-p1-b4-alibi"])
def test_topk_overlapped(policy, dtype, H, D, P, slopes, lens, monkeypatch):
    """The overlapped selection (use_overlap forced: on the interpreter
    there is no PDL, so the selection runs after the keys pass, but through
    the same code): _keys_kernel in batch order raising a counter per batch
    row after each chunk, _rowsel_kernel polling it and taking its rows'
    group maxima itself. Every batch row's counter must end at the number
    of chunks the selection waits for, and the pages must be the
    reference's (odd lengths, a sequence of one page, sinks / window, ALiBi)."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    monkeypatch.setattr(tk, "use_overlap", lambda B, W, MK, pdl: True)
    calls = _spy_rowsel(monkeypatch, tk)
    cache, ids, q, sl = setup(lens, H, 1, D, P, dtype, seed=len(lens) + H, slopes=slopes)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert len(calls) == 1 and calls[0][0] is not None and calls[0][1] >= 1
    cnt, nchk = calls[0]
    assert torch.equal(cnt.cpu(), torch.full((len(lens),), nchk, dtype=torch.int32))
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)
    # every row published as selected, the attention's counters still zero;
    # the scratch the selection reads kept with it
    ready = sel.pending.counters
    assert ready.shape == (2, len(lens), H) and len(sel.pending.hold) == 8
    assert bool((ready[0] == 1).all()) and bool((ready[1] == 0).all())
    out, _ = K.attend(q, cache, ids, sel, alpha=1.5, scale=0.3, slopes=sl)  # (its rows polled: POLL_READY)
    want, _ = RA.attend(q, cache, ids, ref, alpha=1.5, scale=0.3, slopes=sl)
    assert rel_err(out, want) < 1e-2


def test_topk_overlap_dispatch(monkeypatch):
    """use_overlap: batch >= 2, rows of at most OVERLAP_MAX_KEYS slots,
    widths _rowsel_kernel takes, PDL launches; select_topk follows it but
    never with the certified bounds (ub), and not on the interpreter (no
    PDL) unless forced."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    assert tk.use_overlap(8, 64, 8192, True)  # 8 x 128k top-k 1024
    assert tk.use_overlap(8, 256, 32768, True)  # 8 x 512k top-k 4096
    assert not tk.use_overlap(1, 64, 8192, True)  # batch 1
    assert not tk.use_overlap(8, 64, 65536, True)  # 8 x 1M: rows too long for one program's maxima
    assert not tk.use_overlap(8, 1024, 8192, True)  # wider than ROWSEL_MAX_W
    assert not tk.use_overlap(8, 64, 8192, False)  # no PDL: nothing to overlap
    monkeypatch.setattr(tk, "OVERLAP", False)
    assert not tk.use_overlap(8, 64, 8192, True)
    monkeypatch.setattr(tk, "OVERLAP", True)
    calls = _spy_rowsel(monkeypatch, tk)
    cache, ids, q, _ = setup([700, 3, 1100], 2, 1, 16, 4, torch.float16, seed=3)
    ref = RP.select(TopK(300), q, cache, ids, alpha=1.5, scale=0.3)
    sel = K.select(TopK(300), q, cache, ids, alpha=1.5, scale=0.3)
    assert calls == [(None, 0)] and page_sets(sel) == page_sets(ref)  # the interpreter: no PDL
    monkeypatch.setattr(tk, "use_overlap", lambda B, W, MK, pdl: True)
    calls.clear()
    ub = torch.empty(3, 2, cache.block_table.shape[1], dtype=torch.float32, device=DEV)
    sel = tk.select_topk(q, cache, ids, budget=300, scale=0.3, ub=ub)
    assert calls == [(None, 0)] and page_sets(sel) == page_sets(ref)  # the certified bounds: not overlapped
    calls.clear()
    sel = tk.select_topk(q, cache, ids, budget=300, scale=0.3)
    assert len(calls) == 1 and calls[0][0] is not None and page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("published", [True, False], ids=["published", "poll-gives-up"])
def test_rowsel_poll(published, monkeypatch):
    """_rowsel_kernel with counters (launch_rowsel's cnt) on a ready key
    table: waiting for counters already at nchk, or for counters that never
    get there (OVERLAP_POLLS = 3: the poll gives up, and without PDL the
    keys were complete before the launch), it selects each row's k largest
    keys, taking the group maxima itself."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    monkeypatch.setattr(tk, "OVERLAP_POLLS", 3)
    gen = torch.Generator().manual_seed(8)
    P, MK, CH, nchk = 4, 1024, 256, 5
    n_pages = [1000, 10, 750, 333]
    lens = torch.tensor([m * P for m in n_pages], dtype=torch.int32)
    keys = torch.full((4, MK), -2**31, dtype=torch.int32)
    for r, m in enumerate(n_pages):
        keys[r, :m] = torch.randint(-2**31 + 1, 2**31 - 1, (m,), generator=gen, dtype=torch.int64).to(torch.int32)
    cnt = torch.full((2,), nchk if published else 1, dtype=torch.int32, device=DEV)
    pages = torch.full((2, 2, 16), -1, dtype=torch.int32, device=DEV)
    counts = torch.full((2, 2), -1, dtype=torch.int32, device=DEV)
    tk.launch_rowsel(keys.flatten().to(DEV), MK, CH, torch.tensor([0, 2], dtype=torch.int32, device=DEV),
                     lens.to(DEV), pages, counts, 0, 0, 9, P, cnt=cnt, nchk=nchk)
    for r, m in enumerate(n_pages):
        seq_len = int(lens[[0, 2][r // 2]])  # batch row b reads cache slot ids[b]; its two rows share it
        k_row = min(9, -(-seq_len // P))
        got = pages.view(4, 16)[r, :k_row].cpu().long()
        assert int(counts.view(4)[r]) == k_row and len(set(got.tolist())) == k_row
        want = torch.topk(keys[r, :m], min(k_row, m)).values
        assert torch.equal(torch.sort(keys[r, got]).values, torch.sort(want).values), r


def test_rowsel_publishes():
    """The _rowsel_kernel path without the keys-pass overlap (batch 1, or
    rows fewer than SMs) publishes its rows too: _gmax_kernel zeroes the
    Pending counters (garbage before), _rowsel_kernel raises counters[0] to
    1 per row, and the attention launched next polls them, its split
    programs counting into counters[1]; the output equals the attention
    over the same pages without counters."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    keys = torch.randint(-1000, 1000, (3 * 64,), dtype=torch.int32, device=DEV)
    ready = torch.full((2, 3), 7, dtype=torch.int32, device=DEV)
    opts = tk.launch_opts(keys.device)
    gmax, NKP, gs = tk.launch_gmax(keys, 3, 64, 16, 4, opts, ready=ready)
    assert bool((ready == 0).all())
    assert torch.equal(gmax.view(3, NKP).cpu(), keys.view(3, NKP, gs).amax(dim=2).cpu())
    cache, ids, q, _ = setup([700, 3, 1100], 2, 1, 16, 4, torch.float16, seed=5)
    sel = K.select(TopK(300), q, cache, ids, alpha=1.0, scale=0.3)
    counters = sel.pending.counters
    assert counters.shape == (2, 3, 2) and bool((counters[0] == 1).all()) and bool((counters[1] == 0).all())
    out, _ = K.attend(q, cache, ids, sel, alpha=1.0, scale=0.3)
    n = int(counters[1, 0, 0])
    assert n >= 1 and bool((counters[1] == n).all())  # every split program of every row counted in
    plain, _ = K.attend(q, cache, ids, Selection(sel.pages, sel.counts), alpha=1.0, scale=0.3)
    assert torch.equal(out, plain)


class _SpyKernel:
    """Stands in for a jit kernel: records (name, POLL, NSPLIT, snap()) at
    each launch, before running the real kernel."""

    def __init__(self, real, name, seen, snap):
        self.real, self.name, self.seen, self.snap = real, name, seen, snap

    def __getitem__(self, grid):
        def launch(*a, **k):
            self.seen.append((self.name, k.get("POLL"), k.get("NSPLIT"), self.snap()))
            return self.real[grid](*a, **k)
        return launch


@pytest.mark.parametrize("alpha,G,finish,published", [
    (1.0, 1, True, True), (1.5, 1, True, True), (1.5, 1, False, True), (2.0, 2, True, True),
    (1.5, 1, True, False), (1.0, 1, True, False),
], ids=["softmax", "entmax-finish", "entmax-3-launches", "gqa", "finish-poll-gives-up",
        "softmax-poll-gives-up"])
def test_attend_ready(alpha, G, finish, published, monkeypatch):
    """attend right after a selection that may still run (Selection.pending,
    POLL_READY): the split programs wait for their row's counters[0]; with
    one query head per selection row and two launches they count into
    counters[1] and the finishing launch (_finish_kernel, or _combine_kernel
    for softmax) waits for each row's NSPLIT; otherwise (GQA rows, the
    three entmax launches) counters[1] is left alone. Rows never published
    (the polls give up after POLL_POLLS = 3 loads; without PDL the
    selection had ended) give the same output, equal to attend without
    counters and close to the reference. Nothing polls once another step
    launch came after the selection (a second attend over the same
    Selection, or a select between) or without POLL_READY."""
    A = sys.modules["entmaxkv.kernels.attention"]
    C = sys.modules["entmaxkv.kernels._common"]
    monkeypatch.setattr(A, "FINISH", finish)
    monkeypatch.setattr(A, "POLL_POLLS", 3)
    monkeypatch.setattr(A, "POLL_MAX_TOKENS", 200)  # (the width here: at most this polls)
    cache, ids, q, sl = setup([300, 7, 1001], 2, G, 24, 8, torch.float16, seed=11 + G, slopes=True)
    pol = TopK(200, sinks=1)
    ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    B, S = ref.counts.shape
    plain, tau0 = K.attend(q, cache, ids, Selection(ref.pages, ref.counts), alpha=alpha, scale=0.3, slopes=sl)
    seen = []
    for name in ("_split_kernel", "_finish_kernel", "_combine_kernel", "_solve_kernel"):
        monkeypatch.setattr(A, name, _SpyKernel(getattr(A, name), name, seen, lambda: ready[1].clone()))
    ready = torch.zeros(2, B, S, dtype=torch.int32, device=DEV)
    ready[0] = 1 if published else 0
    sel = Selection(ref.pages, ref.counts, pending=Pending(ready, C.launch_count()))
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    assert torch.equal(out, plain) and torch.equal(tau, tau0)
    two = G == 1 and (alpha == 1.0 or finish)  # both launches poll
    assert seen[0][:2] == ("_split_kernel", 2 if two else 1)
    last = seen[-1]
    if two:
        assert last[0] == ("_combine_kernel" if alpha == 1.0 else "_finish_kernel") and last[1] is True
        assert bool((last[3] == last[2]).all()), last  # every split program counted in
        assert bool((ready[1] == last[2]).all())
    else:
        assert all(not p for _, p, _, _ in seen[1:]) and bool((last[3] == 0).all())
        assert bool((ready[1] == 0).all())
    assert bool((ready[0] == (1 if published else 0)).all())
    want, _ = RA.attend(q, cache, ids, ref, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, want) < 1e-2
    # not again: the attention above was a launch after the selection
    seen.clear()
    again, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    assert torch.equal(again, plain) and seen[0][:2] == ("_split_kernel", 0)
    # a select between, POLL_READY off, or a selection wider than
    # POLL_MAX_TOKENS (25 pages of 8 here): no polling either
    for case in ("between", "off", "wide"):
        sel = Selection(ref.pages, ref.counts, pending=Pending(ready, C.launch_count()))
        if case == "between":
            K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
        monkeypatch.setattr(A, "POLL_READY", case != "off")
        monkeypatch.setattr(A, "POLL_MAX_TOKENS", 199 if case == "wide" else 200)
        seen.clear()
        again, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
        assert torch.equal(again, plain) and seen[0][:2] == ("_split_kernel", 0), case
    monkeypatch.setattr(A, "POLL_READY", True)
    bad = Selection(ref.pages, ref.counts, pending=Pending(ready[:1], C.launch_count()))
    with pytest.raises(ValueError, match="pending"):
        K.attend(q, cache, ids, bad, alpha=alpha, scale=0.3)


@pytest.mark.parametrize("layout", ["iid", "clustered", "ties"])
@pytest.mark.parametrize("path", ["rowsel", "rowsel-cut", "chunks", "chunks-exact-lb", "no-prefilter"])
def test_topk_long_rows_prefilter(layout, path, monkeypatch):
    """Long MHA rows, small budget: more group maxima (_gmax_kernel) than
    pages kept, so no page below the k-th largest group maximum lb is read
    past the maxima. rowsel: _rowsel_kernel appends a row's keys >= lb to its
    candidate buffer; rowsel-cut: with 8 keys per step and 16 slots, so the
    buffer overflows and is cut to its k best (again and again when
    clustered or tied); chunks: _lb_kernel, then _chunk_kernel drops the
    pages below lb and bisects the chunks left with more than k (clustered:
    the best pages crowd into one chunk) and _merge_kernel merges them
    (lb stopped early, at most LB_E maxima past k; exact-lb: bisected to the
    k-th maximum); no-prefilter: every chunk bisects. ties: 300 pages share the top bound,
    so which pages are kept is arbitrary but they must be k_row pages of the
    top rank."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    monkeypatch.setattr(tk, "PREFILTER", path != "no-prefilter")
    monkeypatch.setattr(tk, "ROWSEL", path.startswith("rowsel"))
    monkeypatch.setattr(tk, "ROWSEL_MIN_PAGES", 0)
    if path == "rowsel-cut":
        monkeypatch.setattr(tk, "ROWSEL_BLK", 8)
    if path == "chunks-exact-lb":
        monkeypatch.setattr(tk, "LB_NT", 1)
        monkeypatch.setattr(tk, "LB_E", -1)
    gen = torch.Generator().manual_seed(21)
    B, n, H, D, P = 2, 4000, 2, 16, 4
    k = torch.randn(B, n, H, D, generator=gen)
    v = torch.randn(B, n, H, D, generator=gen)
    q = torch.randn(B, H, D, generator=gen)
    if layout == "clustered":
        k[:, 1200:2000] *= 3.0
    elif layout == "ties":
        k[:, 400:1600] = (10.0 * q / q.norm(dim=-1, keepdim=True))[:, None]
    cache, slots = PagedKVCache.from_dense(k, v, [n, 2999], P, dtype=torch.float16, spare_pages=3,
                                           shuffle=True, generator=gen, device=DEV)
    ids = torch.tensor(slots, dtype=torch.int32, device=DEV)
    q = q.to(torch.float16).to(DEV)
    pol = TopK(24)
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=0.25)
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.25)
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    if layout != "ties":
        assert page_sets(sel) == page_sets(ref)
        return
    rank = RS.quest_bounds(q, cache, ids, scale=0.25).cpu()
    got = page_sets(sel)
    for b, n_b in enumerate([n, 2999]):
        last = (n_b + P - 1) // P - 1
        for h in range(H):
            r = rank[b, h].clone()
            r[last] = float("inf")  # forced: the page holding the query
            kept = got[b][h]
            t = torch.sort(r, descending=True).values[len(kept) - 1]
            assert last in kept and all(r[p] >= t for p in kept)
            assert {int(p) for p in (r > t).nonzero().flatten()} <= kept
            assert (r[sorted(kept - {last})] == t).sum() >= 2  # really ties at the threshold


@pytest.mark.parametrize("order", ["random", "permutation", "ascending", "descending", "few-values", "equal",
                                   "late-ties"])
@pytest.mark.parametrize("groups", ["tight", "tight-exact-lb", "tight-buffer", "tight-from-below", "no-lb", "cut"])
def test_topk_rowsel_key_table(order, groups, monkeypatch):
    """_gmax_kernel + _rowsel_kernel on hand-made key tables against
    torch.topk: the kept keys of each row (3 rows of 1000 / 10 / 750 pages,
    6 or 9 pages kept) must be exactly the row's k largest (as a multiset:
    ties may be kept in any order), at distinct pages of the row. tight: 256
    groups per row, every listed group read in one tile (the usual case),
    cut in registers from below when at most ROWSEL_FEW keys >= lb are past
    the budget (buffer: never, through the candidate buffer and the search
    from above; from-below: whatever the excess, ties included), lb's search
    stopped as soon as no more than k maxima reach it (exact-lb: searched to
    the k-th maximum, ROWSEL_E = -1); no-lb: 4 groups, fewer than k, so lb cannot filter and every key is a
    candidate (more than fit the one tile's 512 slots: the step loop, into a
    2048-slot buffer, cut to its k best when full); cut: 64 groups of 16,
    no one-tile pass, 16-key steps into a 32-slot buffer, cut again and
    again (ascending: at nearly every step; equal: every key ties;
    late-ties: a key just above a cut's k-th key arrives after it, and a
    later cut's k-th key is below the first cut's)."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    monkeypatch.setattr(tk, "GMAX_GROUPS", {"no-lb": 4, "cut": 64}.get(groups, 256))
    monkeypatch.setattr(tk, "ROWSEL_FEW", {"tight-buffer": -1, "tight-from-below": 10**6}.get(groups, 8))
    monkeypatch.setattr(tk, "ROWSEL_E", -1 if groups == "tight-exact-lb" else 0)
    monkeypatch.setattr(tk, "ROWSEL_GROUPS_PER_PAGE", 0)
    monkeypatch.setattr(tk, "ROWSEL_GS", 4096)
    if groups == "cut":
        monkeypatch.setattr(tk, "ROWSEL_BLK", 8)
        monkeypatch.setattr(tk, "ROWSEL_ONE", 16)
    gen = torch.Generator().manual_seed(5)
    P, MK, CH = 4, 1024, 256
    lens = torch.tensor([4000, 37, 2999], dtype=torch.int32)
    n_pages = [1000, 10, 750]
    keys = torch.full((3, MK), -2**31, dtype=torch.int32)
    for r, m in enumerate(n_pages):
        if order == "random":
            row = torch.randint(-2**31 + 1, 2**31 - 1, (m,), generator=gen, dtype=torch.int64)
        elif order == "permutation":  # consecutive keys: one just above a cut's k-th key comes later
            row = torch.randperm(m, generator=gen)
        elif order == "ascending":
            row = torch.arange(m) - 500
        elif order == "descending":
            row = -torch.arange(m)
        elif order == "few-values":
            row = torch.randint(0, 5, (m,), generator=gen) * 7
        elif order == "equal":
            row = torch.full((m,), 123)
        else:  # with "cut": a cut to 10s, 8 keys of 11, then a step of 11s: a cut whose k-th key is below lo
            row = torch.full((m,), 10)
            row[48:56], row[56:64], row[64:80] = 11, 0, 11
        keys[r, :m] = row.to(torch.int32)
    for k_pages, W in [(6, 6), (9, 16)]:
        pages = torch.full((3, 1, W), -1, dtype=torch.int32, device=DEV)
        counts = torch.full((3, 1), -1, dtype=torch.int32, device=DEV)
        tk.launch_rowsel(keys.flatten().to(DEV), MK, CH, torch.arange(3, dtype=torch.int32, device=DEV),
                         lens.to(DEV), pages, counts, 0, 0, k_pages, P)
        for r, m in enumerate(n_pages):
            k_row = min(k_pages, m)
            assert int(counts[r, 0]) == k_row
            got = pages[r, 0, :k_row].cpu().long()
            assert len(set(got.tolist())) == k_row and int(got.min()) >= 0 and int(got.max()) < m
            want = torch.topk(keys[r, :m], k_row).values
            assert torch.equal(torch.sort(keys[r, got]).values, torch.sort(want).values), (r, order)


TK = sys.modules["entmaxkv.kernels.topk"]


@triton.jit
def _kth_probe(key_ptr, k_ptr, out_ptr, N: tl.constexpr, NT: tl.constexpr, E: tl.constexpr):
    """One row of N keys per program: kth_largest_nt(keys, k[row], NT, E)."""
    i = tl.program_id(0)
    b_key = tl.load(key_ptr + i * N + tl.arange(0, N))
    tl.store(out_ptr + i, TK.kth_largest_nt(b_key, tl.load(k_ptr + i), NT, E))


@pytest.mark.parametrize("NT,E", [(1, -1), (4, -1), (4, 0), (4, 3), (8, 0)])
def test_kth_largest_nt_early_stop(NT, E):
    """kth_largest_nt on rows of 256 int32 keys (random over the whole range,
    a narrow range with ties, +inf keys of forced pages, INT32_MIN padding)
    against torch.topk's k-th value v: exact (T == v) for E < 0 or NT = 1;
    with E >= 0 a lower bound, T <= v, with count(keys >= T) >= k and either
    T == v or count(keys >= T) <= k + E. Some row must stop early (T < v) for
    E >= 0, so the early stop is really exercised."""
    gen = torch.Generator().manual_seed(NT * 10 + E)
    N, R = 256, 48
    keys = torch.randint(-2**31 + 1, 2**31 - 1, (R, N), generator=gen, dtype=torch.int64)
    keys[12:24] = torch.randint(1000, 1040, (12, N), generator=gen)  # narrow, many ties
    keys[24:36, :20] = 0x7F800000  # +inf: forced pages
    keys[36:, 200:] = -2**31  # padding
    keys = keys.to(torch.int32)
    k = torch.randint(1, 40, (R,), generator=gen, dtype=torch.int32)
    out = torch.empty(R, dtype=torch.int32, device=DEV)
    _kth_probe[(R,)](keys.to(DEV), k.to(DEV), out, N=N, NT=NT, E=E)
    out = out.cpu()
    early = 0
    for r in range(R):
        v = int(torch.topk(keys[r], int(k[r])).values[-1])
        t = int(out[r])
        c = int((keys[r] >= t).sum())
        if E < 0 or NT == 1:
            assert t == v, (r, t, v)
        else:
            assert t <= v and c >= int(k[r]) and (t == v or c <= int(k[r]) + E), (r, t, v, c)
            early += t < v
    if E >= 0 and NT > 1:
        assert early > 0


@pytest.mark.parametrize("H,hg", [(6, None), (12, 4), (5, 8), (4, 1)], ids=["h6", "h12-hg4", "h5-masked", "h4-hg1"])
def test_topk_keys_pass_head_groups(H, hg, monkeypatch):
    """_keys_kernel steps over (page block, head group): H = 6 and 12 read
    runs of 2 / 4 heads (3 groups), H = 5 one masked run of 8, HG = 1 one head
    per step; several programs per row (KCH = 8). Keys (the selection) and
    the certified upper bounds (u + slack) against the reference."""
    tk = sys.modules["entmaxkv.kernels.topk"]
    tune = {"BLOCK_M": 4, "KCH": 8}
    if hg is not None:
        tune["HG"] = hg
    monkeypatch.setattr(tk, "KEYS_TUNE", tune)
    cache, ids, q, sl = setup([900, 3, 455], H, 1, 24, 4, torch.float16, seed=13, slopes=True)
    pol = TopK(32, sinks=1, window=1)
    M = cache.block_table.shape[1]
    ub = torch.full((3, H, M), float("nan"), device=DEV)
    sel = tk.select_topk(q, cache, ids, budget=32, sinks=1, window=1, scale=0.3, slopes=sl, ub=ub)
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)
    want = (RS.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
            + RS.bound_slack(q, cache, ids, scale=0.3, slopes=sl)).cpu()
    got = ub.cpu()
    live = torch.isfinite(want)
    assert torch.equal(live, torch.isfinite(got))
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-4)


def test_topk_all_heads_with_unpacked_statistics():
    """A cache whose k_min / k_max are separate tensors (not views of k_bounds,
    e.g. built by another framework): the all-heads pass takes the pair's
    offset from the pointers and must select what the reference selects."""
    cache, ids, q, sl = setup([300, 77], 3, 1, 24, 4, torch.float16, seed=4, slopes=True)
    cache.k_min = cache.k_min.clone()
    cache.k_max = cache.k_max.clone()
    assert cache.k_max.data_ptr() - cache.k_min.data_ptr() != 24 * 2  # really unpacked
    pol = TopK(32, sinks=1)
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert page_sets(sel) == page_sets(ref)


def _gaussian_oracle(q, cache, ids, sl, alpha, pooled):
    """tau_hat from float64 statistics (the reference solve, float64 path)."""
    mu, sg, n = RS.gaussian_stats(q.double(), cache, ids, scale=0.3, slopes=None if sl is None else sl.double())
    w = n[:, None, :].expand_as(mu)
    if pooled:
        a, b, c = pooled_moments(mu, sg, w)
        return solve_tau_hat(a[..., None], b[..., None], c[..., None], alpha, iters=120)
    return solve_tau_hat(mu, sg, w, alpha, iters=120)


@pytest.mark.parametrize("alpha,pooled,per_q,slopes", [
    (1.5, False, False, False), (2.0, False, False, True), (4.0 / 3.0, False, True, True),
    (1.5, True, False, True), (1.25, False, False, False),
], ids=["a1.5", "a2-alibi", "a4/3-per-q", "a1.5-pooled", "a1.25-reference-path"])
def test_gaussian_select(alpha, pooled, per_q, slopes):
    _check_gaussian_select(alpha, pooled, per_q, slopes)


@pytest.mark.parametrize("pooled", [False, True], ids=["iterated", "pooled"])
def test_gaussian_select_short_stats_chunks(pooled, monkeypatch):
    """The stats and selection launches cut into more chunks than the
    iteration launches (as on a GPU with few rows, and as SEL_CH does on
    long rows): the partial statistics still merge right and every page is
    tested once."""
    gk = importlib.import_module("entmaxkv.kernels.gaussian")
    monkeypatch.setattr(gk, "MIN_CH", 16)
    monkeypatch.setattr(gk, "STATS_TUNE", (True, 16, 4, None, 4096))
    monkeypatch.setattr(gk, "SEL_CH", 32)  # and selection chunks shorter than the partials' chunks
    cfg = gk.gauss_plan(113, 2, 16, torch.float32, torch.float32, rows=4, sms=4)
    assert cfg["NCS"] > cfg["NCH"]
    _check_gaussian_select(1.5, pooled, False, True)


@pytest.mark.parametrize("slopes", [True, False], ids=["alibi", "iid"])
def test_gaussian_select_several_blocks_per_chunk(slopes, monkeypatch):
    """Iteration chunks of several blocks (each block's mu, sigma loaded
    while the previous one is used, the last prefetch masked off): every
    block is summed once, with its own pages."""
    gk = importlib.import_module("entmaxkv.kernels.gaussian")
    monkeypatch.setattr(gk, "ITER_BLOCK", 16)
    cfg = gk.gauss_plan(113, 2, 16, torch.float32, torch.float32, rows=4, sms=4)
    assert cfg["CH"] >= 64  # so the iteration launches loop over >= 4 blocks
    _check_gaussian_select(1.5, False, False, slopes)


@pytest.mark.parametrize("B,H,n,ch", [
    (8, 24, 1 << 20, 8192),  # paper 8 x 1M: 192 rows >= SMs, 8 chunks of 8192 pages
    (8, 24, 1 << 19, 8192),
    (8, 24, 1 << 17, 4096),  # one 8192-page chunk per row would leave 192 programs < 1.5 per SM
    (8, 24, 1 << 15, 1024),
    (1, 24, 1 << 21, 4096),  # 1 x 2M: 24 rows < SMs keep 4096-page chunks
], ids=["8x1M", "8x512k", "8x128k", "8x32k", "1x2M"])
def test_gaussian_iteration_chunks_by_rows(B, H, n, ch, monkeypatch):
    """The GPU plan of the iteration chunks (interpreter cap off): the
    longest chunk of MAX_CH[many rows] that keeps ITER_PER_SM programs per
    SM, on an H200's 132 SMs."""
    gk = importlib.import_module("entmaxkv.kernels.gaussian")
    monkeypatch.setattr(gk, "interpreting", lambda: False)
    M = n // 16
    cfg = gk.gauss_plan(M, 1, 32, torch.float16, torch.float16, rows=B * H, sms=132)
    assert cfg["CH"] == ch and cfg["NCH"] == -(-M // ch)
    assert B * H * cfg["NCH"] >= gk.ITER_PER_SM * 132 or ch == 1024


@pytest.mark.parametrize("G,D,dtype,prefetch", [
    (1, 24, torch.float16, False), (1, 24, torch.float16, True), (2, 40, torch.float32, True),
    (4, 16, torch.bfloat16, False),
], ids=["mha-f16", "mha-f16-prefetch", "g2-f32-prefetch", "gqa4-bf16-dot"])
def test_gaussian_stats_blocks(G, D, dtype, prefetch, monkeypatch):
    """The stats launch with 16-page blocks (several per chunk), on the
    elementwise path loading each block's page ids and moments one block
    ahead or not, and on the tl.dot path: every block must be reduced with
    its own pages (tau_hat against the oracle, pages by the definition)."""
    gk = importlib.import_module("entmaxkv.kernels.gaussian")
    monkeypatch.setattr(gk, "STATS_TUNE", (prefetch, 16, 4, None, 1 << 16))
    monkeypatch.setattr(gk, "DOT_STATS_TUNE", (16, 4, None, 1 << 16))
    monkeypatch.setattr(gk, "MIN_CH", 32)
    cfg = gk.gauss_plan(113, G, D, dtype, dtype, rows=3, sms=4)
    assert cfg["SNSUB"] >= 2 and cfg["SBLOCK_M"] == 16 and cfg["SPREFETCH"] == (prefetch and G < 3)
    _check_gaussian_select(1.5, False, False, True, H=3, G=G, D=D, dtype=dtype)


@pytest.mark.parametrize("H,D,dtype,alpha,pooled,slopes", [
    (3, 24, torch.float16, 1.5, False, True), (4, 16, torch.float32, 2.0, False, False),
    (5, 40, torch.bfloat16, 4.0 / 3.0, True, True),
], ids=["h3-f16-a1.5-alibi", "h4-f32-a2", "h5-bf16-a4/3-pooled-alibi"])
def test_gaussian_select_one_query_head_per_kv_head(H, D, dtype, alpha, pooled, slopes):
    """MHA (G = 1), odd head counts and dims, half-precision caches: tau_hat
    and the pages by the definition."""
    _check_gaussian_select(alpha, pooled, False, slopes, H=H, G=1, D=D, dtype=dtype)


def test_gaussian_select_unpacked_statistics():
    """k_mean / k_std as separate tensors (not views of k_moments, e.g. built
    by another framework): the same selection as the packed cache."""
    cache, ids, q, sl = setup([500, 61], 3, 1, 16, 8, torch.float16, seed=12, slopes=True)
    pol = Gaussian(q_max=0.99, margin=0.05, sinks=1)
    want = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    cache.k_mean = cache.k_mean.clone()
    cache.k_std = cache.k_std.clone()
    assert cache.k_std.data_ptr() - cache.k_mean.data_ptr() != 16 * 2  # really unpacked
    got = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert torch.equal(got.tau_hat, want.tau_hat)
    assert page_sets(got) == page_sets(want)


@pytest.mark.parametrize("slopes", [False, True], ids=["iid", "alibi"])
def test_gaussian_converged_launches_forward_the_state(slopes, monkeypatch):
    """Once a Halley step is below CONV_TOL the later iteration launches skip
    their pages: tau_hat must equal (to float32 rounding) the solve that never
    stops early, itself within 1e-4 of the float64 oracle."""
    gk = sys.modules["entmaxkv.kernels.gaussian"]
    cache, ids, q, sl = setup([3000, 700], 2, 1, 16, 4, torch.float32, seed=21, slopes=slopes)
    pol = Gaussian(q_max=0.99, margin=0.05, sinks=1)
    early = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    monkeypatch.setattr(gk, "CONV_TOL", 0.0)
    monkeypatch.setattr(gk, "NIT", 8)
    full = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    rel = (early.tau_hat.double() - full.tau_hat.double()).abs() / full.tau_hat.double().abs()
    assert rel.max().item() <= 2.4e-7, rel.max().item()
    oracle = _gaussian_oracle(q, cache, ids, sl, 1.5, False)
    assert (early.tau_hat.double() - oracle).abs().max() < 1e-4


def _check_gaussian_select(alpha, pooled, per_q, slopes, H=2, G=2, D=16, dtype=torch.float32):
    lens = [300, 900, 9]
    cache, ids, q, sl = setup(lens, H, G, D, 8, dtype, seed=7, slopes=slopes)
    pol = Gaussian(q_max=0.99, margin=0.05, pooled=pooled, sinks=1, per_query_head=per_q)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    oracle = _gaussian_oracle(q, cache, ids, sl, alpha, pooled)
    assert (sel.tau_hat.double() - oracle).abs().max() < 1e-4
    # the kept pages follow the definition, evaluated at the kernel's tau_hat
    mu, sg, n = RS.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    z = RP.normal_icdf(torch.tensor(0.99, dtype=mu.dtype) ** (1.0 / n.clamp(min=1)))
    crit = (alpha - 1) * (mu + z[:, None, :] * sg) - (sel.tau_hat[..., None] - 0.05)
    S = sel.pages.shape[1]
    got = page_sets(sel)
    for b, n_b in enumerate(lens):
        npages = -(-n_b // 8)
        for s in range(S):
            heads = [s] if per_q else list(range(G * s, G * s + G))
            c = crit[b, heads, :npages].amax(0)
            sure_in = {int(p) for p in (c > 1e-4).nonzero().flatten()} | {0, npages - 1}
            maybe = {int(p) for p in (c.abs() <= 1e-4).nonzero().flatten()}
            assert sure_in <= got[b][s] <= sure_in | maybe


@pytest.mark.parametrize("seed_policy,per_q,alpha", [
    (TopK(32), False, 1.5), (TopK(24, per_query_head=True), False, 2.0), (TopK(32), True, 1.5),
    (Gaussian(), False, 1.5),
], ids=["topk", "topk-per-q-seed-union", "per-q", "gaussian-seed"])
def test_certified_select_and_certificate(seed_policy, per_q, alpha):
    cache, ids, q, sl = setup([300, 70, 6], 2, 2, 16, 8, torch.float32, seed=8, key_scale=2.0, slopes=True)
    pol = Certified(seed=seed_policy, per_query_head=per_q, window=1)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    if isinstance(seed_policy, TopK):
        # (a Gaussian seed may differ by a borderline page: tau_hat is rounded differently)
        ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
        assert page_sets(sel) == page_sets(ref)
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    # certified == full-cache attention
    full, _ = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, full) < 1e-5
    ub = RS.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    slack = RS.bound_slack(q, cache, ids, scale=0.3, slopes=sl)
    lay = RS.page_layout(cache, ids)
    c = K.certify(ub, sel, tau, alpha, lay.seq_len, page_size=8, slack=slack)
    assert c.all()
    # and the certificate agrees with the reference on an uncertified selection
    tk = K.select(TopK(16), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    _, ttau = K.attend(q, cache, ids, tk, alpha=alpha, scale=0.3, slopes=sl)
    for a in (alpha, 1.0):
        got = K.certify(ub, tk, ttau, a, lay.seq_len, page_size=8, slack=slack)
        want = RA.certify(ub, tk, ttau, a, lay.seq_len, page_size=8, slack=slack)
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_certified_topk_seed_one_query_head_per_kv_head(alpha):
    """MHA: the seed's bounds + slack come from the all-heads _keys_kernel."""
    cache, ids, q, sl = setup([260, 45], 3, 1, 24, 4, torch.float16, seed=13, key_scale=2.0, slopes=True)
    pol = Certified(seed=TopK(24), window=1)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert page_sets(sel) == page_sets(ref)
    out, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    full, _ = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, full) < TOL[torch.float16]


def test_decode_dispatches_to_kernels():
    """decode(backend="triton") runs these kernels and agrees with the reference."""
    cache, ids, q, sl = setup([120, 33], 2, 2, 16, 8, torch.float32, seed=9, slopes=True)
    for pol, alpha in [(Full(), 1.5), (TopK(32), 1.0), (Gaussian(), 2.0), (Certified(), 1.5)]:
        out, st = decode(q, cache, ids, pol, alpha=alpha, alibi_slopes=sl, backend="triton", return_stats=True)
        ref, rst = decode(q, cache, ids, pol, alpha=alpha, alibi_slopes=sl, backend="reference", return_stats=True)
        assert rel_err(out, ref) < 1e-4, pol
        if not isinstance(pol, Gaussian):
            assert torch.equal(st.certified.cpu(), rst.certified.cpu()), pol


def test_pdl_kernels_wait_first():
    """A kernel launched with programmatic dependent launch may start before
    its predecessor finishes: every kernel taking the PDL switch must call
    pdl_start(PDL) (the wait) before anything else, except the polling
    forms (_rowsel_kernel after the keys pass, the attention's split and
    finishing kernels after the selection), which, after nothing but their
    program ids, must poll (poll_start) with no whole-launch wait, and take
    pdl_start otherwise."""
    import inspect
    import re

    import triton

    pid = r"i_\w+ = tl\.program_id\(\d\)(\.to\(tl\.int64\))?"
    polling = {"_rowsel_kernel", "_split_kernel", "_finish_kernel", "_combine_kernel"}
    found = 0
    for name in ("topk", "attention", "gaussian", "certified"):
        mod = importlib.import_module(f"entmaxkv.kernels.{name}")
        for attr in dir(mod):
            fn = getattr(mod, attr)
            is_kernel = attr.endswith("_kernel") and isinstance(fn, triton.runtime.KernelInterface)
            if is_kernel and "PDL" in fn.arg_names:
                src = inspect.getsource(fn.fn)
                body = src.split('"""')[-1] if src.count('"""') >= 2 else src.split("):", 1)[1]
                lines = [ln.split("#")[0].strip() for ln in body.splitlines()]  # (no "#" in kernel strings)
                lines = [ln for ln in lines if ln]
                if attr in polling:
                    k = next(i for i, ln in enumerate(lines) if ln.startswith("if POLL"))
                    assert all(re.fullmatch(pid + r"|i_r, i_s = grid_ids\(ROWS_FIRST\)", ln) for ln in lines[:k]), \
                        (attr, lines[:k])
                    branch = lines[k + 1:lines.index("else:", k)]
                    j = next(i for i, ln in enumerate(branch) if ln.startswith("poll_start("))
                    assert all(re.fullmatch(pid, ln) for ln in branch[:j]), (attr, branch)
                    assert not any("gdc_wait" in ln for ln in branch), (attr, branch)
                    assert lines[lines.index("else:", k) + 1] == "pdl_start(PDL)", attr
                else:
                    assert lines[0] == "pdl_start(PDL)", (attr, lines[0])
                found += 1
    assert found == 18
