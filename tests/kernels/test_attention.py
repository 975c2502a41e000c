"""Attention kernels (split, solve, accumulate, finish) against the reference attention."""
from __future__ import annotations

import importlib  # noqa: F401
import sys  # noqa: F401

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402,F401

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, Full, Gaussian, TopK, decode  # noqa: E402,F401
from entmaxkv import attention as RA  # noqa: E402,F401
from entmaxkv import policies as RP  # noqa: E402,F401
from entmaxkv import scoring as RS  # noqa: E402,F401
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, alibi, page_sets, random_cache, rel_err  # noqa: E402,F401
from entmaxkv.testing import random_case as case  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402,F401
from entmaxkv.gaussian import pooled_moments, solve_tau_hat  # noqa: E402,F401
from entmaxkv.types import Pending, Selection  # noqa: E402,F401

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

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
    cache, ids, q, sl = case([2900, 61], 2, G, 16, 8, torch.float32, seed=12, key_scale=0.05)
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
    cache, ids, q, _ = case([300, 40], 2, 1, 16, 4, torch.float32, seed=17, key_scale=0.005)
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
    cache, ids, q, _ = case([300, 40], 2, G, 16, 4, torch.float32, seed=17, key_scale=0.005)
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
    cache, ids, q, sl = case([1250, 77], 2, G, 16, 8, torch.float32, seed=21, key_scale=0.05, slopes=True)
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
    cache, ids, q, sl = case(lens, H, 1, 16, P, torch.float32, seed=9, slopes=True)
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
    cache, ids, q, _ = case([50, 17], 1, 2, 16, 8, torch.float32, seed=4)
    out, tau = K.dense_attend(q.double(), cache, ids, alpha=1.5, scale=0.25)
    full = RP.select(Full(), q, cache, ids, alpha=1.5, scale=0.25)
    ref, _ = RA.attend(q.double(), cache, ids, full, alpha=1.5, scale=0.25)
    assert out.dtype == torch.float64 and rel_err(out, ref) < 1e-5


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
    cache, ids, q, sl = case([300, 7, 1001], 2, G, 24, 8, torch.float16, seed=11 + G, slopes=True)
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
    for variant in ("between", "off", "wide"):
        sel = Selection(ref.pages, ref.counts, pending=Pending(ready, C.launch_count()))
        if variant == "between":
            K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
        monkeypatch.setattr(A, "POLL_READY", variant != "off")
        monkeypatch.setattr(A, "POLL_MAX_TOKENS", 199 if variant == "wide" else 200)
        seen.clear()
        again, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
        assert torch.equal(again, plain) and seen[0][:2] == ("_split_kernel", 0), variant
    monkeypatch.setattr(A, "POLL_READY", True)
    bad = Selection(ref.pages, ref.counts, pending=Pending(ready[:1], C.launch_count()))
    with pytest.raises(ValueError, match="pending"):
        K.attend(q, cache, ids, bad, alpha=alpha, scale=0.3)


