"""Top-k selection kernels (kernels/topk/: keys, chain, row selection) against the reference policy."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import TopK  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402
from entmaxkv.kernels import KernelConfig, TopKConfig  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, page_sets, rel_err  # noqa: E402
from entmaxkv.testing import random_case as case  # noqa: E402
from entmaxkv.types import Selection  # noqa: E402

tk = importlib.import_module("entmaxkv.kernels.topk.launch")
tp = importlib.import_module("entmaxkv.kernels.topk.plan")
TC = TopKConfig()

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _cfg(c: TopKConfig) -> KernelConfig:
    return KernelConfig(topk=c)


def _rowsel_calls(launches):
    """(cnt, nchk) of every _topk_rowsel_kernel launch: the keys pass's counters it
    polled (None: it did not poll) and the count it waited for."""
    return [(a[9] if k["POLL"] else None, a[17]) for n, a, k, _ in launches if n == "_topk_rowsel_kernel"]


# selection
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [
    TopK(24), TopK(64, sinks=1, window=2), TopK(40, per_query_head=True), TopK(16, sinks=3, window=1),
], ids=["k24", "k64-sinks-window", "k40-per-q", "k16-sinks3"])
@pytest.mark.parametrize("P,lens", [(4, [37, 1300, 5]), (8, [2100, 1, 333])], ids=["p4", "p8"])
@pytest.mark.parametrize("merge", ["regs", "loop"])
def test_topk_select_matches_reference(policy, P, lens, merge, launches):
    """lens with 1300/2100 tokens span several chunks: the merge kernel runs,
    with the row's candidates in registers or (merge_regs = 1) streamed."""
    c = TopKConfig(merge_regs=1 if merge == "loop" else TC.merge_regs)
    cache, ids, q, sl = case(lens, 2, 3, 16, P, torch.float16, seed=6, slopes=True)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=_cfg(c))
    merges = [k["ONE_TILE"] for n, _, k, _ in launches if n == "_topk_merge_kernel"]
    assert merges and all(one == (merge == "regs") for one in merges)
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert sel.pages.shape == ref.pages.shape
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("policy", [TopK(24), TopK(40, sinks=1, window=2)], ids=["k24", "k40-sinks-window"])
@pytest.mark.parametrize("dtype,H,D,P,slopes", [
    (torch.float16, 3, 24, 4, True), (torch.bfloat16, 5, 16, 8, False), (torch.float32, 2, 40, 1, True),
], ids=["f16-h3-alibi", "bf16-h5", "f32-h2-p1-alibi"])
@pytest.mark.parametrize("all_heads", [True, "rowsel", False], ids=["all-heads", "all-heads-rowsel", "per-head"])
def test_topk_one_query_head_per_kv_head(policy, dtype, H, D, P, slopes, all_heads, launches):
    """MHA (G = 1): _topk_keys_kernel scores every head of a page in one program
    (odd head counts pad to a power of two), then the chunked chain or
    (rowsel, forced sink / window pages among the keys) _topk_rowsel_kernel; the
    per-head path must agree."""
    c = TopKConfig(all_heads=bool(all_heads), rowsel=all_heads == "rowsel", rowsel_min_pages=0)
    cache, ids, q, sl = case([700, 3, 1100], H, 1, D, P, dtype, seed=9, slopes=slopes)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=_cfg(c))
    ran = launches.names()
    assert ("_topk_keys_kernel" in ran) == bool(all_heads) and ("_topk_rowsel_kernel" in ran) == (all_heads == "rowsel")
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert sel.pages.shape == ref.pages.shape
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("policy", [TopK(24), TopK(40, sinks=1, window=2)], ids=["k24", "k40-sinks-window"])
@pytest.mark.parametrize("dtype,H,G,D,P,slopes", [
    (torch.float16, 2, 2, 24, 4, True), (torch.bfloat16, 3, 3, 16, 8, False), (torch.float32, 1, 4, 40, 1, True),
], ids=["f16-h2-g2-alibi", "bf16-h3-g3", "f32-h1-g4-p1-alibi"])
@pytest.mark.parametrize("path", ["keys", "rowsel", "chain"])
def test_topk_gqa_keys_pass(policy, dtype, H, G, D, P, slopes, path, launches):
    """GQA with keys_gqa: _topk_keys_kernel ranks each page of a KV head by
    the largest bound of its G query heads (odd G, odd head counts), then
    the pre-filtered chain or _topk_rowsel_kernel; the per-head chunk chain
    (keys_gqa off) must agree, both equal to the reference."""
    c = TopKConfig(keys_gqa=path != "chain", rowsel=path == "rowsel", rowsel_min_pages=0)
    cache, ids, q, sl = case([700, 3, 1100], H, G, D, P, dtype, seed=G + 17, slopes=slopes)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=_cfg(c))
    ran = launches.names()
    assert ("_topk_keys_kernel" in ran) == (path != "chain") and ("_topk_rowsel_kernel" in ran) == (path == "rowsel")
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert sel.pages.shape == ref.pages.shape
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert page_sets(sel) == page_sets(ref)


def test_rowsel_dispatch(launches):
    """use_rowsel picks _topk_rowsel_kernel except for short rows with small
    budgets when rows >= SMs (the benchmark's 8 x 32k top-k 1024), and
    select_topk follows it, the pages right either way."""
    assert not tp.use_rowsel(TC, 64, 2048, 192, 132)  # 8 x 32k top-k 1024: the chunked chain
    assert tp.use_rowsel(TC, 256, 2048, 192, 132)  # top-k 4096
    assert tp.use_rowsel(TC, 64, 8192, 192, 132)  # 8 x 128k
    assert tp.use_rowsel(TC, 64, 2048, 24, 132)  # batch 1
    assert not tp.use_rowsel(TC, 1024, 2**17, 24, 132)  # wider than rowsel_max_w
    for lens, H, policy, want in [([700, 3], 1, TopK(24), True), ([700, 3, 1100], 2, TopK(24), False),
                                  ([700, 3, 1100], 2, TopK(300), True)]:
        launches.clear()
        cache, ids, q, _ = case(lens, H, 1, 16, 4, torch.float16, seed=H + len(lens))
        sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3)
        ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3)
        # 4 SMs on the interpreter: rows >= 4 with W <= 64 take the chain
        assert bool(_rowsel_calls(launches)) == want and ("_topk_merge_kernel" in launches.names()) != want
        assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
        assert page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("policy", [TopK(24), TopK(40, sinks=1, window=2), TopK(300)],
                         ids=["k24", "k40-sinks-window", "k300"])
@pytest.mark.parametrize("dtype,H,D,P,slopes,lens", [
    (torch.float16, 3, 24, 4, True, [700, 3, 1100]), (torch.bfloat16, 5, 16, 8, False, [1500, 2]),
    (torch.float32, 2, 40, 1, True, [37, 900, 1, 401]),
], ids=["f16-h3-b3-alibi", "bf16-h5-b2", "f32-h2-p1-b4-alibi"])
def test_topk_overlapped(policy, dtype, H, D, P, slopes, lens, launches):
    """The overlapped selection (overlap_needs_pdl off: on the interpreter
    there is no PDL, so the selection runs after the keys pass, but through
    the same code): _topk_keys_kernel in batch order raising a counter per batch
    row after each chunk, _topk_rowsel_kernel polling it and taking its rows'
    group maxima itself. Every batch row's counter must end at the number
    of chunks the selection waits for, and the pages must be the
    reference's (odd lengths, a sequence of one page, sinks / window, ALiBi)."""
    cfg = _cfg(TopKConfig(overlap_needs_pdl=False))
    cache, ids, q, sl = case(lens, H, 1, D, P, dtype, seed=len(lens) + H, slopes=slopes)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=cfg)
    calls = _rowsel_calls(launches)
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
    out, _ = K.attend(q, cache, ids, sel, alpha=1.5, scale=0.3, slopes=sl, config=cfg)  # (its rows polled)
    want, _ = RA.attend(q, cache, ids, ref, alpha=1.5, scale=0.3, slopes=sl)
    assert rel_err(out, want) < 1e-2


def test_topk_overlap_dispatch(launches):
    """use_overlap: batch >= 2, rows of at most overlap_max_keys slots,
    widths _topk_rowsel_kernel takes, PDL launches; select_topk follows it but
    never with the certified bounds (ub), and not on the interpreter (no
    PDL) unless overlap_needs_pdl is off."""
    assert tp.use_overlap(TC, 8, 64, 8192, True)  # 8 x 128k top-k 1024
    assert tp.use_overlap(TC, 8, 256, 32768, True)  # 8 x 512k top-k 4096
    assert not tp.use_overlap(TC, 1, 64, 8192, True)  # batch 1
    assert not tp.use_overlap(TC, 8, 64, 65536, True)  # 8 x 1M: rows too long for one program's maxima
    assert not tp.use_overlap(TC, 8, 1024, 8192, True)  # wider than rowsel_max_w
    assert not tp.use_overlap(TC, 8, 64, 8192, False)  # no PDL: nothing to overlap
    assert not tp.use_overlap(dataclasses.replace(TC, overlap=False), 8, 64, 8192, True)
    assert tp.use_overlap(dataclasses.replace(TC, overlap_needs_pdl=False), 8, 64, 8192, False)
    cache, ids, q, _ = case([700, 3, 1100], 2, 1, 16, 4, torch.float16, seed=3)
    ref = RP.select(TopK(300), q, cache, ids, alpha=1.5, scale=0.3)
    launches.clear()
    sel = K.select(TopK(300), q, cache, ids, alpha=1.5, scale=0.3)
    assert _rowsel_calls(launches) == [(None, 0)] and page_sets(sel) == page_sets(ref)  # the interpreter: no PDL
    forced = _cfg(TopKConfig(overlap_needs_pdl=False))
    launches.clear()
    ub = torch.empty(3, 2, cache.block_table.shape[1], dtype=torch.float32, device=DEV)
    sel = tk.select_topk(q, cache, ids, budget=300, scale=0.3, ub=ub, config=forced)
    calls = _rowsel_calls(launches)
    assert calls == [(None, 0)] and page_sets(sel) == page_sets(ref)  # the certified bounds: not overlapped
    launches.clear()
    sel = tk.select_topk(q, cache, ids, budget=300, scale=0.3, config=forced)
    calls = _rowsel_calls(launches)
    assert len(calls) == 1 and calls[0][0] is not None and page_sets(sel) == page_sets(ref)


@pytest.mark.parametrize("published", [True, False], ids=["published", "poll-gives-up"])
def test_rowsel_poll(published):
    """_topk_rowsel_kernel with counters (launch_rowsel's cnt) on a ready key
    table: waiting for counters already at nchk, or for counters that never
    get there (overlap_polls = 3: the poll gives up, and without PDL the
    keys were complete before the launch), it selects each row's k largest
    keys, taking the group maxima itself."""
    c = TopKConfig(overlap_polls=3)
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
                     lens.to(DEV), pages, counts, 0, 0, 9, P, c=c, cnt=cnt, nchk=nchk)
    for r, m in enumerate(n_pages):
        seq_len = int(lens[[0, 2][r // 2]])  # batch row b reads cache slot ids[b]; its two rows share it
        k_row = min(9, -(-seq_len // P))
        got = pages.view(4, 16)[r, :k_row].cpu().long()
        assert int(counts.view(4)[r]) == k_row and len(set(got.tolist())) == k_row
        want = torch.topk(keys[r, :m], min(k_row, m)).values
        assert torch.equal(torch.sort(keys[r, got]).values, torch.sort(want).values), r


def test_rowsel_publishes():
    """The _topk_rowsel_kernel path without the keys-pass overlap (batch 1, or
    rows fewer than SMs) publishes its rows too: _topk_gmax_kernel zeroes the
    Pending counters (garbage before), _topk_rowsel_kernel raises counters[0] to
    1 per row, and the attention launched next polls them, its split
    programs counting into counters[1]; the output equals the attention
    over the same pages without counters."""
    keys = torch.randint(-1000, 1000, (3 * 64,), dtype=torch.int32, device=DEV)
    ready = torch.full((2, 3), 7, dtype=torch.int32, device=DEV)
    opts = tk.launch_opts(keys.device, True)
    gmax, NKP, gs = tk.launch_gmax(keys, 3, 64, 16, 4, opts, TC, ready=ready)
    assert bool((ready == 0).all())
    assert torch.equal(gmax.view(3, NKP).cpu(), keys.view(3, NKP, gs).amax(dim=2).cpu())
    cache, ids, q, _ = case([700, 3, 1100], 2, 1, 16, 4, torch.float16, seed=5)
    sel = K.select(TopK(300), q, cache, ids, alpha=1.0, scale=0.3)
    counters = sel.pending.counters
    assert counters.shape == (2, 3, 2) and bool((counters[0] == 1).all()) and bool((counters[1] == 0).all())
    out, _ = K.attend(q, cache, ids, sel, alpha=1.0, scale=0.3)
    n = int(counters[1, 0, 0])
    assert n >= 1 and bool((counters[1] == n).all())  # every split program of every row counted in
    plain, _ = K.attend(q, cache, ids, Selection(sel.pages, sel.counts), alpha=1.0, scale=0.3)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("layout", ["iid", "clustered", "ties"])
@pytest.mark.parametrize("path", ["rowsel", "rowsel-cut", "chunks", "chunks-exact-lb", "no-prefilter"])
def test_topk_long_rows_prefilter(layout, path, launches):
    """Long MHA rows, small budget: more group maxima (_topk_gmax_kernel) than
    pages kept, so no page below the k-th largest group maximum lb is read
    past the maxima. rowsel: _topk_rowsel_kernel appends a row's keys >= lb to its
    candidate buffer; rowsel-cut: with 8 keys per step and 16 slots, so the
    buffer overflows and is cut to its k best (again and again when
    clustered or tied); chunks: _topk_lb_kernel, then _topk_chunk_kernel drops the
    pages below lb and bisects the chunks left with more than k (clustered:
    the best pages crowd into one chunk) and _topk_merge_kernel merges them
    (lb stopped early, at most lb_e maxima past k; exact-lb: bisected to the
    k-th maximum); no-prefilter: every chunk bisects. ties: 300 pages share the top bound,
    so which pages are kept is arbitrary but they must be k_row pages of the
    top rank."""
    c = TopKConfig(prefilter=path != "no-prefilter", rowsel=path.startswith("rowsel"), rowsel_min_pages=0,
                   rowsel_blk=8 if path == "rowsel-cut" else TC.rowsel_blk,
                   lb_nt=1 if path == "chunks-exact-lb" else TC.lb_nt,
                   lb_e=-1 if path == "chunks-exact-lb" else TC.lb_e)
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
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=0.25, config=_cfg(c))
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.25)
    ran = launches.names()
    assert ("_topk_rowsel_kernel" in ran) == path.startswith("rowsel")
    assert ("_topk_lb_kernel" in ran) == path.startswith("chunks") and ("_topk_gmax_kernel" in ran) == (path != "no-prefilter")
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
def test_topk_rowsel_key_table(order, groups):
    """_topk_gmax_kernel + _topk_rowsel_kernel on hand-made key tables against
    torch.topk: the kept keys of each row (3 rows of 1000 / 10 / 750 pages,
    6 or 9 pages kept) must be exactly the row's k largest (as a multiset:
    ties may be kept in any order), at distinct pages of the row. tight: 256
    groups per row, every listed group read in one tile (the usual case),
    cut in registers from below when at most rowsel_few keys >= lb are past
    the budget (buffer: never, through the candidate buffer and the search
    from above; from-below: whatever the excess, ties included), lb's search
    stopped as soon as no more than k maxima reach it (exact-lb: searched to
    the k-th maximum, rowsel_e = -1); no-lb: 4 groups, fewer than k, so lb cannot filter and every key is a
    candidate (more than fit the one tile's 512 slots: the step loop, into a
    2048-slot buffer, cut to its k best when full); cut: 64 groups of 16,
    no one-tile pass, 16-key steps into a 32-slot buffer, cut again and
    again (ascending: at nearly every step; equal: every key ties;
    late-ties: a key just above a cut's k-th key arrives after it, and a
    later cut's k-th key is below the first cut's)."""
    c = TopKConfig(gmax_groups={"no-lb": 4, "cut": 64}.get(groups, 256),
                   rowsel_few={"tight-buffer": -1, "tight-from-below": 10**6}.get(groups, 8),
                   rowsel_e=-1 if groups == "tight-exact-lb" else 0, rowsel_groups_per_page=0, rowsel_gs=4096,
                   rowsel_blk=8 if groups == "cut" else TC.rowsel_blk,
                   rowsel_one=16 if groups == "cut" else TC.rowsel_one)
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
                         lens.to(DEV), pages, counts, 0, 0, k_pages, P, c=c)
        for r, m in enumerate(n_pages):
            k_row = min(k_pages, m)
            assert int(counts[r, 0]) == k_row
            got = pages[r, 0, :k_row].cpu().long()
            assert len(set(got.tolist())) == k_row and int(got.min()) >= 0 and int(got.max()) < m
            want = torch.topk(keys[r, :m], k_row).values
            assert torch.equal(torch.sort(keys[r, got]).values, torch.sort(want).values), (r, order)


TK = importlib.import_module("entmaxkv.kernels.topk.search")


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
def test_topk_keys_pass_head_groups(H, hg, launches):
    """_topk_keys_kernel steps over (page block, head group): H = 6 and 12 read
    runs of 2 / 4 heads (3 groups), H = 5 one masked run of 8, HG = 1 one head
    per step; several programs per row (KCH = 8). Keys (the selection) and
    the certified upper bounds (u + slack) against the reference."""
    tune = {"BLOCK_M": 4, "KCH": 8}
    if hg is not None:
        tune["HG"] = hg
    cfg = _cfg(TopKConfig(keys_tune=tuple(tune.items())))
    cache, ids, q, sl = case([900, 3, 455], H, 1, 24, 4, torch.float16, seed=13, slopes=True)
    pol = TopK(32, sinks=1, window=1)
    M = cache.block_table.shape[1]
    ub = torch.full((3, H, M), float("nan"), device=DEV)
    sel = tk.select_topk(q, cache, ids, budget=32, sinks=1, window=1, scale=0.3, slopes=sl, ub=ub, config=cfg)
    keys = [k for n, _, k, _ in launches if n == "_topk_keys_kernel"]
    assert len(keys) == 1 and keys[0]["BLOCK_M"] == 4 and keys[0]["NSUB"] == 2
    assert keys[0]["HG"] == (hg if hg is not None else H & -H)
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
    cache, ids, q, sl = case([300, 77], 3, 1, 24, 4, torch.float16, seed=4, slopes=True)
    cache.k_min = cache.k_min.clone()
    cache.k_max = cache.k_max.clone()
    assert cache.k_max.data_ptr() - cache.k_min.data_ptr() != 24 * 2  # really unpacked
    pol = TopK(32, sinks=1)
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert page_sets(sel) == page_sets(ref)




# non-finite bounds
# ---------------------------------------------------------------------------

_NAN, _INF = float("nan"), float("inf")


def _non_finite_case(P, G, n_long, dtype=torch.float16, H=2, D=16, seed=3):
    """Four rows of KV head 0 with bad bounds (stored with check_finite=False):
    row 0 (n_long tokens, odd) NaN keys in five pages (page 0 and the last
    among them) and +inf in two others, row 1 NaN in query head 0 (its whole
    row of bounds NaN), row 2 three clean tokens, row 3 every key NaN.
    Returns (cache, ids int32 [4], q [4, H*G, D], lens)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n_long, n_long // 2 + 1, 3, 4 * P + 1]
    cache = PagedKVCache(sum(-(-n // P) for n in lens) + 2, P, H, D, max_seqs=4, dtype=dtype, device=DEV)
    seqs = []
    for b, n in enumerate(lens):
        k = torch.randn(n, H, D, generator=gen) * 1.5
        v = torch.randn(n, H, D, generator=gen)
        npg = -(-n // P)
        if b == 0:
            for pg in (0, 2, npg // 3, npg // 2, npg - 1):
                k[pg * P, 0, 3] = _NAN
            for pg in (1, npg // 4):
                k[pg * P + P - 1, 0, 5] = _INF  # (P = 1: 0 * inf, a NaN bound)
        if b == 3:
            k[:, 0, 7] = _NAN
        seqs.append(cache.allocate(k.to(DEV), v.to(DEV), check_finite=False))
    q = torch.randn(4, H * G, D, generator=gen) * 1.5
    q[0, :G, 5] = q[0, :G, 5].abs() + 0.5  # KV head 0's queries meet the +inf keys: +inf bounds
    q[1, 0, 2] = _NAN
    return cache, torch.tensor(seqs, dtype=torch.int32, device=DEV), q.to(dtype).to(DEV), lens


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("P,G,n_long,policy,path", [
    (1, 1, 301, TopK(6), "keys"), (1, 1, 301, TopK(6, sinks=1, window=2), "rowsel"),
    (16, 1, 16 * 37 + 5, TopK(16 * 5), "keys"), (16, 1, 16 * 37 + 5, TopK(16 * 40), "rowsel"),
    (1, 2, 301, TopK(6), "chain"), (16, 4, 16 * 37 + 5, TopK(16 * 6, sinks=2), "chain"),
    (1, 2, 301, TopK(8, per_query_head=True), "chain-no-prefilter"), (16, 2, 16 * 21 + 9, TopK(16 * 30), "chain"),
], ids=["p1-g1-keys", "p1-g1-rowsel-sinks-window", "p16-g1-keys", "p16-g1-rowsel-k40", "p1-g2-chain",
        "p16-g4-chain-sinks", "p1-g2-per-q-no-prefilter", "p16-g2-chain-k-over-pages"])
def test_topk_non_finite_bounds_match_reference(P, G, n_long, policy, path, launches):
    """NaN / +inf page bounds (NaN keys, +inf keys, NaN q): the kernels keep
    exactly the reference's pages (policies.topk_keep: NaN ranks after every
    finite page, the lowest pages first among NaN ones; +inf ranks below the
    forced pages), on each path (the keys pass with the chain or rowsel for
    one query head per KV head; the per-head chunk kernel for GQA, with the
    merge over several chunks, without the pre-filter), and every row keeps
    its last page (never empty). Before, a NaN's key bits sorted above the
    forced pages' (or below -inf) and +inf tied with them."""
    c = TopKConfig(all_heads=path in ("keys", "rowsel"), rowsel=path == "rowsel", rowsel_min_pages=0,
                   prefilter=path != "chain-no-prefilter")
    cache, ids, q, lens = _non_finite_case(P, G, n_long)
    sel = K.select(policy, q, cache, ids, alpha=1.5, scale=0.3, config=_cfg(c))
    ran = launches.names()
    assert ("_topk_keys_kernel" in ran) == (path in ("keys", "rowsel"))
    assert ("_topk_rowsel_kernel" in ran) == (path == "rowsel")
    ref = RP.select(policy, q, cache, ids, alpha=1.5, scale=0.3)
    ub = RS.quest_bounds(q, cache, ids, scale=0.3).cpu()
    assert bool(torch.isnan(ub).any()) and (P == 1 or bool(torch.isposinf(ub).any()))  # the case is what it says
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    got = page_sets(sel)
    assert got == page_sets(ref)
    for b, n in enumerate(lens):
        assert all((n + P - 1) // P - 1 in s for s in got[b]), b
