"""Tests of entmaxkv.cache.PagedKVCache: layout, writes, statistics, errors, cost."""
from __future__ import annotations

import copy
import math
import statistics
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entmaxkv.cache import CacheFullError, PagedKVCache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# Tolerance for the rounded k_mean / k_std copies against a float64 reference:
# a couple of units in the last place of the storage dtype.
ROUNDED_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# ----------------------------------------------------------------- helpers
def rand_kv(n, heads, dim, gen, dtype=torch.float32):
    k = torch.randn(n, heads, dim, generator=gen).to(dtype)
    v = torch.randn(n, heads, dim, generator=gen).to(dtype)
    return k, v


def reference_stats(keys: torch.Tensor, page_size: int):
    """Per-logical-page (min, max, mean, std) of ``keys`` [n, H, D], in float64.

    Padded with NaN to whole pages and reduced with NaN-aware ops; population
    std. Returns four [pages, H, D] float64 tensors.
    """
    n, H, D = keys.shape
    pages = math.ceil(n / page_size)
    x = torch.full((pages * page_size, H, D), float("nan"), dtype=torch.float64)
    x[:n] = keys.double()
    x = x.view(pages, page_size, H, D)
    pad = torch.isnan(x)
    kmin = torch.where(pad, math.inf, x).amin(dim=1)
    kmax = torch.where(pad, -math.inf, x).amax(dim=1)
    mean = x.nanmean(dim=1)
    std = ((x - mean[:, None]) ** 2).nanmean(dim=1).sqrt()
    return kmin, kmax, mean, std


def assert_stats_match(cache: PagedKVCache, seq: int):
    """Every page statistic of ``seq`` equals one recomputed from its keys."""
    keys, _ = cache.gather(seq)
    if keys.shape[0] == 0:
        return
    pages = cache.page_ids(seq).long()
    kmin, kmax, mean, std = reference_stats(keys, cache.page_size)
    # min/max are stored keys: exact.
    assert torch.equal(cache.k_min[pages], kmin.to(cache.dtype))
    assert torch.equal(cache.k_max[pages], kmax.to(cache.dtype))
    # float32 running state, tight.
    count = torch.tensor(
        [min(cache.page_size, keys.shape[0] - i * cache.page_size) for i in range(len(pages))],
        dtype=torch.float64,
    )[:, None, None]
    torch.testing.assert_close(cache._mean32[pages].double(), mean, rtol=1e-5, atol=1e-5)
    std32 = (cache._m2[pages].double() / count).sqrt()
    torch.testing.assert_close(std32, std, rtol=1e-5, atol=1e-5)
    # Rounded public copies.
    tol = ROUNDED_TOL[cache.dtype]
    torch.testing.assert_close(cache.k_mean[pages].double(), mean, rtol=tol, atol=tol)
    torch.testing.assert_close(cache.k_std[pages].double(), std, rtol=tol, atol=tol)


def assert_layout(cache: PagedKVCache, seq: int, k: torch.Tensor, v: torch.Tensor):
    """``seq`` holds exactly (k, v) (cast to the storage dtype), laid out per contract."""
    n, P = k.shape[0], cache.page_size
    k, v = k.to(cache.dtype), v.to(cache.dtype)
    assert cache.length(seq) == n
    assert int(cache.seq_lens[seq]) == n
    gk, gv = cache.gather(seq)
    assert gk.dtype == cache.dtype and gk.shape == k.shape and gk.is_contiguous()
    assert torch.equal(gk, k) and torch.equal(gv, v)
    npages = math.ceil(n / P)
    row = cache.block_table[seq]
    assert row.dtype == torch.int32
    assert torch.equal(cache.page_ids(seq), row[:npages])
    assert not row[npages:].any(), "unused block-table entries must be 0"
    j = torch.arange(n)
    phys = row.long()[j // P]
    # Token j lives at k_pages[block_table[s, j // P], :, j % P].
    assert torch.equal(cache.k_pages[phys, :, j % P], k)
    assert torch.equal(cache.v_pages[phys, :, j % P], v)


def snapshot(cache: PagedKVCache):
    tensors = {
        name: getattr(cache, name).clone()
        for name in ("k_pages", "v_pages", "k_min", "k_max", "k_mean", "k_std",
                     "_mean32", "_m2", "block_table", "seq_lens")
    }
    host = {
        "free_pages": cache.free_pages,
        "active": cache.active_seqs(),
        "lens": {s: cache.length(s) for s in cache.active_seqs()},
        "pages": {s: cache.page_ids(s).tolist() for s in cache.active_seqs()},
        "mirrors": copy.deepcopy((cache._free, cache._free_slots, cache._lens, cache._pages)),
    }
    return tensors, host


def assert_unchanged(cache: PagedKVCache, snap):
    tensors, host = snap
    for name, before in tensors.items():
        assert torch.equal(getattr(cache, name), before), f"{name} was modified"
    assert snapshot(cache)[1] == host


# -------------------------------------------------------------- round trip
@pytest.mark.parametrize("page_size", [1, 3, 8, 16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_gather_round_trip(dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    for heads, dim in [(1, 1), (2, 7), (3, 64), (4, 7)]:
        lens = [1, 7, page_size, page_size + 1, 2 * page_size - 1, 257]
        pages = sum(math.ceil(n / page_size) for n in lens)
        cache = PagedKVCache(pages, page_size, heads, dim, max_seqs=len(lens), dtype=dtype)
        data = {}
        for n in lens:
            s = cache.allocate()
            k, v = rand_kv(n, heads, dim, gen)  # fp32 input, cast on the way in
            cache.prefill(s, k, v)
            data[s] = (k, v)
        assert cache.free_pages == 0
        for s, (k, v) in data.items():
            assert_layout(cache, s, k, v)
            assert_stats_match(cache, s)


def test_tensor_shapes_and_properties():
    cache = PagedKVCache(11, 4, 3, 5, max_seqs=2, dtype=torch.bfloat16)
    assert cache.k_pages.shape == cache.v_pages.shape == (11, 3, 4, 5)
    for name in ("k_min", "k_max", "k_mean", "k_std"):
        t = getattr(cache, name)
        assert t.shape == (11, 3, 5) and t.dtype == torch.bfloat16
    assert cache._mean32.dtype == cache._m2.dtype == torch.float32
    assert cache.block_table.shape == (2, 11) and cache.block_table.dtype == torch.int32
    assert cache.seq_lens.shape == (2,) and cache.seq_lens.dtype == torch.int32
    assert (cache.num_pages, cache.page_size, cache.kv_heads, cache.head_dim) == (11, 4, 3, 5)
    assert (cache.max_seqs, cache.max_pages_per_seq, cache.free_pages) == (2, 11, 11)
    assert cache.dtype == torch.bfloat16 and cache.device == torch.device("cpu")
    assert PagedKVCache(11, 4, 3, 5, max_seqs=2, max_pages_per_seq=3).block_table.shape == (2, 3)
    assert cache.allocate() == 0 and cache.allocate() == 1
    assert cache.active_seqs() == [0, 1] and cache.length(1) == 0
    k0, v0 = cache.gather(1)
    assert k0.shape == v0.shape == (0, 3, 5)
    assert cache.page_ids(1).shape == (0,) and cache.page_ids(1).dtype == torch.int32


def test_extend_is_prefill_in_chunks():
    gen = torch.Generator().manual_seed(1)
    k, v = rand_kv(50, 2, 6, gen)
    one = PagedKVCache(8, 8, 2, 6, max_seqs=1, dtype=torch.float32)
    one.prefill(one.allocate(), k, v)
    chunked = PagedKVCache(8, 8, 2, 6, max_seqs=1, dtype=torch.float32)
    s = chunked.allocate()
    cuts = [0, 3, 3, 8, 13, 29, 30, 50]  # includes empty and page-aligned chunks
    for a, b in zip(cuts, cuts[1:]):
        chunked.extend(s, k[a:b], v[a:b])
    assert_layout(chunked, s, k, v)
    for name in ("k_pages", "v_pages", "k_min", "k_max", "k_mean", "k_std", "_mean32", "_m2"):
        assert torch.equal(getattr(one, name), getattr(chunked, name)), name


# ------------------------------------------------------------------ append
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_append_after_prefill_at_page_boundaries(page_size):
    P = page_size
    gen = torch.Generator().manual_seed(P)
    prefill_lens = sorted({0, 1, P - 1, P, P + 1, 2 * P - 1, 2 * P})
    n_append = P + 2  # crosses at least one boundary from every start
    for dtype in DTYPES:
        pages = sum(math.ceil((n + n_append) / P) for n in prefill_lens)
        cache = PagedKVCache(pages, P, 2, 5, max_seqs=len(prefill_lens), dtype=dtype)
        data = {}
        for n in prefill_lens:
            s = cache.allocate()
            data[s] = rand_kv(n, 2, 5, gen)
            cache.prefill(s, *data[s])
        seqs = list(data)
        for _ in range(n_append):
            k, v = rand_kv(len(seqs), 2, 5, gen)
            cache.append(seqs, k, v)
            for i, s in enumerate(seqs):
                data[s] = (torch.cat([data[s][0], k[i : i + 1]]), torch.cat([data[s][1], v[i : i + 1]]))
            for s in seqs:
                assert_layout(cache, s, *data[s])
                assert_stats_match(cache, s)
        assert cache.free_pages == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interleaved_appends_match_recomputed_stats(dtype):
    """Random interleaving of appends over several sequences; stats never drift."""
    gen = torch.Generator().manual_seed(7)
    P, H, D = 4, 3, 9
    cache = PagedKVCache(80, P, H, D, max_seqs=5, dtype=dtype)
    data = {}
    for n in [0, 3, 4, 9, 2]:
        s = cache.allocate()
        # Scaled and shifted keys so mean/std are not all ~0/~1.
        k, v = rand_kv(n, H, D, gen)
        data[s] = (k * 3 + 1, v)
        cache.prefill(s, *data[s])
    for step in range(60):
        size = int(torch.randint(1, 6, (1,), generator=gen))
        seqs = torch.randperm(5, generator=gen)[:size]  # a CPU int tensor
        k, v = rand_kv(size, H, D, gen)
        k = k * 3 + 1
        cache.append(seqs if step % 2 else seqs.tolist(), k, v)
        for i, s in enumerate(seqs.tolist()):
            data[s] = (torch.cat([data[s][0], k[i : i + 1]]), torch.cat([data[s][1], v[i : i + 1]]))
    for s in data:
        assert_layout(cache, s, *data[s])
        assert_stats_match(cache, s)


def test_first_token_of_a_reused_page_resets_stats():
    """A page freed with stale stats starts from scratch when reused by append."""
    cache = PagedKVCache(1, 4, 1, 2, max_seqs=1, dtype=torch.float32)
    s = cache.allocate()
    cache.prefill(s, torch.full((3, 1, 2), 100.0), torch.zeros(3, 1, 2))
    cache.free(s)
    s = cache.allocate()
    k = torch.tensor([[[1.0, -2.0]]])
    cache.append([s], k, k)
    assert torch.equal(cache.k_min[0], k[0]) and torch.equal(cache.k_max[0], k[0])
    assert torch.equal(cache.k_mean[0], k[0]) and not cache.k_std[0].any()
    assert_stats_match(cache, s)


# ------------------------------------------------------------ free / reuse
def test_free_then_reuse_pages_and_slots():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(6, 4, 2, 3, max_seqs=3, dtype=torch.float16)
    a, b = cache.allocate(), cache.allocate()
    data_a, data_b = rand_kv(9, 2, 3, gen), rand_kv(10, 2, 3, gen)
    cache.prefill(a, *data_a)
    cache.prefill(b, *data_b)
    assert cache.free_pages == 0
    pages_a = set(cache.page_ids(a).tolist())
    cache.free(a)
    assert cache.free_pages == 3 and cache.active_seqs() == [b]
    assert int(cache.seq_lens[a]) == 0 and not cache.block_table[a].any()
    with pytest.raises(ValueError, match="seq"):
        cache.free(a)  # double free
    with pytest.raises(ValueError, match="seq"):
        cache.length(a)
    c = cache.allocate()
    assert c == a  # lowest free slot is reused
    data_c = rand_kv(12, 2, 3, gen)
    cache.prefill(c, *data_c)
    assert set(cache.page_ids(c).tolist()) == pages_a
    assert_layout(cache, c, *data_c)
    assert_stats_match(cache, c)
    assert_layout(cache, b, *data_b)  # untouched by the free and the reuse
    assert_stats_match(cache, b)


def test_from_dense_random_block_tables():
    gen = torch.Generator().manual_seed(11)
    B, N, H, D, P = 4, 70, 2, 7, 8
    k, v = torch.randn(B, N, H, D, generator=gen), torch.randn(B, N, H, D, generator=gen)
    lens = [70, 1, 0, 33]
    cache, slots = PagedKVCache.from_dense(
        k, v, lens, P, dtype=torch.float16, spare_pages=5, generator=gen
    )
    used = sum(math.ceil(n / P) for n in lens)
    assert cache.num_pages == used + 5 and cache.free_pages == 5
    assert cache.dtype == torch.float16 and len(set(slots)) == B
    all_pages = []
    for b, s in enumerate(slots):
        assert_layout(cache, s, k[b, : lens[b]], v[b, : lens[b]])
        assert_stats_match(cache, s)
        all_pages += cache.page_ids(s).tolist()
    assert len(set(all_pages)) == used  # no page shared
    assert all_pages != sorted(all_pages), "shuffle=True must scatter the pages"
    plain, _ = PagedKVCache.from_dense(k, v, lens, P, dtype=torch.float16, shuffle=False)
    assert torch.cat([plain.page_ids(s) for s in slots]).tolist() == list(range(used))
    # Same generator seed, same block table.
    again, _ = PagedKVCache.from_dense(
        k, v, lens, P, dtype=torch.float16, spare_pages=5,
        generator=torch.Generator().manual_seed(11),
    )
    first, _ = PagedKVCache.from_dense(
        k, v, lens, P, dtype=torch.float16, spare_pages=5,
        generator=torch.Generator().manual_seed(11),
    )
    assert torch.equal(again.block_table, first.block_table)
    roomy, _ = PagedKVCache.from_dense(k, v, lens, P, spare_pages=1, max_seqs=6)
    assert roomy.max_seqs == 6 and roomy.allocate() == B and roomy.dtype == torch.float32


# -------------------------------------------------------- full pool, atomic
def test_full_pool_prefill_raises_and_changes_nothing():
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(5, 4, 2, 3, max_seqs=3, dtype=torch.bfloat16)
    a, b = cache.allocate(), cache.allocate()
    cache.prefill(a, *rand_kv(6, 2, 3, gen))  # 2 pages, last half full
    cache.prefill(b, *rand_kv(4, 2, 3, gen))  # 1 page, full
    snap = snapshot(cache)
    # a holds 6 tokens: 11 more need ceil(17/4) - 2 = 3 new pages, 2 are free.
    with pytest.raises(CacheFullError, match=r"needs 3 new pages but only 2 are free"):
        cache.prefill(a, *rand_kv(11, 2, 3, gen))
    assert_unchanged(cache, snap)
    c = cache.allocate()
    snap = snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.prefill(c, *rand_kv(9, 2, 3, gen))
    assert_unchanged(cache, snap)
    cache.prefill(a, *rand_kv(10, 2, 3, gen))  # exactly fits: 16 tokens, 4 pages
    assert cache.free_pages == 0


def test_full_pool_append_raises_and_changes_nothing():
    gen = torch.Generator().manual_seed(6)
    cache = PagedKVCache(3, 2, 1, 4, max_seqs=3, dtype=torch.float32)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    cache.prefill(a, *rand_kv(2, 1, 4, gen))  # full page
    cache.prefill(b, *rand_kv(1, 1, 4, gen))  # room for one more
    cache.prefill(c, *rand_kv(2, 1, 4, gen))  # full page
    assert cache.free_pages == 0
    snap = snapshot(cache)
    # b alone fits, but a and c each need a new page: the whole batch fails.
    with pytest.raises(CacheFullError, match=r"needs 2 new pages but only 0 are free"):
        cache.append([b, a, c], *rand_kv(3, 1, 4, gen))
    assert_unchanged(cache, snap)
    cache.append([b], *rand_kv(1, 1, 4, gen))
    assert cache.length(b) == 2


def test_max_pages_per_seq_raises_and_changes_nothing():
    gen = torch.Generator().manual_seed(8)
    cache = PagedKVCache(10, 4, 1, 2, max_seqs=2, max_pages_per_seq=2, dtype=torch.float16)
    s = cache.allocate()
    with pytest.raises(CacheFullError, match="max_pages_per_seq=2"):
        cache.prefill(s, *rand_kv(9, 1, 2, gen))
    cache.prefill(s, *rand_kv(8, 1, 2, gen))
    snap = snapshot(cache)
    with pytest.raises(CacheFullError, match="max_pages_per_seq=2"):
        cache.append([s], *rand_kv(1, 1, 2, gen))
    assert_unchanged(cache, snap)


def test_no_free_slot_raises():
    cache = PagedKVCache(4, 2, 1, 1, max_seqs=2)
    cache.allocate(), cache.allocate()
    snap = snapshot(cache)
    with pytest.raises(CacheFullError, match="max_seqs=2"):
        cache.allocate()
    assert_unchanged(cache, snap)
    assert issubclass(CacheFullError, RuntimeError)


# -------------------------------------------------------------- bad inputs
GOOD = dict(num_pages=4, page_size=2, kv_heads=1, head_dim=3, max_seqs=1)


@pytest.mark.parametrize(
    "name, value",
    [
        ("num_pages", 0),
        ("num_pages", 2.0),
        ("page_size", 0),
        ("page_size", 257),
        ("page_size", True),
        ("kv_heads", -1),
        ("head_dim", "8"),
        ("max_seqs", 0),
        ("max_pages_per_seq", 0),
        ("dtype", torch.float64),
        ("dtype", torch.int32),
        ("device", "not-a-device"),
    ],
)
def test_constructor_rejects_bad_arguments(name, value):
    kwargs = dict(GOOD, **{name: value})
    args = [kwargs.pop(a) for a in ("num_pages", "page_size", "kv_heads", "head_dim")]
    with pytest.raises(ValueError, match=name):
        PagedKVCache(*args, **kwargs)


def test_constructor_accepts_bounds():
    PagedKVCache(1, 1, 1, 1, max_seqs=1, dtype=torch.float32)
    PagedKVCache(1, 256, 1, 1, max_seqs=1, dtype=torch.bfloat16)


def _bad_write_cases():
    ok = torch.zeros(2, 1, 3)
    return [
        ("prefill", dict(seq=5), "seq"),  # out of range
        ("prefill", dict(seq=1), "seq"),  # in range, not allocated
        ("prefill", dict(seq=0.0), "seq"),
        ("prefill", dict(k=torch.zeros(2, 2, 3)), "k"),  # kv_heads
        ("prefill", dict(v=torch.zeros(2, 1, 4)), "v"),  # head_dim
        ("prefill", dict(k=torch.zeros(2, 3)), "k"),  # rank
        ("prefill", dict(v=torch.zeros(3, 1, 3)), "v"),  # token count differs
        ("prefill", dict(k=torch.zeros(2, 1, 3, dtype=torch.int64)), "k"),
        ("prefill", dict(v=[[0.0]]), "v"),
        ("prefill", dict(k=torch.zeros(2, 1, 3, device="meta")), "k"),  # device
        ("prefill", dict(k=torch.tensor([[[0.0, float("nan"), 0.0]]] * 2)), "k"),
        ("prefill", dict(v=torch.tensor([[[0.0, float("inf"), 0.0]]] * 2)), "v"),
        ("append", dict(seqs=[0, 0]), "seqs"),  # duplicates
        ("append", dict(seqs=[3]), "seqs"),
        ("append", dict(seqs=[1]), "seqs"),  # not allocated
        ("append", dict(seqs=torch.tensor([0.0])), "seqs"),
        ("append", dict(seqs=torch.tensor([0], device="meta")), "seqs"),
        ("append", dict(seqs=0), "seqs"),  # not a list
        ("append", dict(k=torch.zeros(2, 1, 3)), "k"),  # one token per seq
        ("append", dict(v=torch.zeros(1, 1, 2)), "v"),
        ("append", dict(v=torch.zeros(1, 1, 3, dtype=torch.int32)), "v"),
    ], ok


@pytest.mark.parametrize("case", range(len(_bad_write_cases()[0])))
def test_writes_reject_bad_inputs(case):
    method, override, name = _bad_write_cases()[0][case]
    cache = PagedKVCache(4, 2, 1, 3, max_seqs=2, dtype=torch.float32)
    s = cache.allocate()
    cache.prefill(s, torch.ones(3, 1, 3), torch.ones(3, 1, 3))
    snap = snapshot(cache)
    if method == "prefill":
        args = dict(seq=s, k=torch.zeros(2, 1, 3), v=torch.zeros(2, 1, 3))
        args.update(override)
        call = lambda: cache.prefill(args["seq"], args["k"], args["v"])  # noqa: E731
    else:
        args = dict(seqs=[s], k=torch.zeros(1, 1, 3), v=torch.zeros(1, 1, 3))
        args.update(override)
        call = lambda: cache.append(args["seqs"], args["k"], args["v"])  # noqa: E731
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()
    assert_unchanged(cache, snap)


def test_bad_sequence_ids_in_reads_and_free():
    cache = PagedKVCache(4, 2, 1, 3, max_seqs=2)
    for fn in (cache.free, cache.length, cache.gather, cache.page_ids):
        with pytest.raises(ValueError, match="seq"):
            fn(0)  # not allocated yet
        with pytest.raises(ValueError, match="seq"):
            fn(-1)


def test_from_dense_rejects_bad_arguments():
    k = torch.zeros(2, 5, 1, 3)
    with pytest.raises(ValueError, match="lens"):
        PagedKVCache.from_dense(k, k, [5], 2)
    with pytest.raises(ValueError, match=r"lens\[1\]"):
        PagedKVCache.from_dense(k, k, [5, 6], 2)
    with pytest.raises(ValueError, match="v"):
        PagedKVCache.from_dense(k, k[:, :4], [5, 4], 2)
    with pytest.raises(ValueError, match="spare_pages"):
        PagedKVCache.from_dense(k, k, [5, 4], 2, spare_pages=-1)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache.from_dense(k, k, [5, 4], 0)
    with pytest.raises(ValueError, match="max_seqs"):
        PagedKVCache.from_dense(k, k, [5, 4], 2, max_seqs=1)


# ------------------------------------------------ random programs (model check)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_programs_match_a_dense_model(data):
    P, H, D = 3, 2, 3
    cache = PagedKVCache(7, P, H, D, max_seqs=3, max_pages_per_seq=5, dtype=torch.float32)
    model = {}  # slot -> (k, v) held
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["allocate", "free", "prefill", "append"]))
        live = sorted(model)
        snap = snapshot(cache)
        try:
            if op == "allocate":
                model[cache.allocate()] = rand_kv(0, H, D, gen)
            elif op == "free" and live:
                s = data.draw(st.sampled_from(live))
                cache.free(s)
                del model[s]
            elif op == "prefill" and live:
                s = data.draw(st.sampled_from(live))
                k, v = rand_kv(data.draw(st.integers(0, 2 * P + 1)), H, D, gen)
                cache.prefill(s, k, v)
                model[s] = (torch.cat([model[s][0], k]), torch.cat([model[s][1], v]))
            elif op == "append" and live:
                seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
                k, v = rand_kv(len(seqs), H, D, gen)
                cache.append(seqs, k, v)
                for i, s in enumerate(seqs):
                    model[s] = (torch.cat([model[s][0], k[i : i + 1]]),
                                torch.cat([model[s][1], v[i : i + 1]]))
        except CacheFullError:
            assert_unchanged(cache, snap)
        assert cache.active_seqs() == sorted(model)
        used = sum(math.ceil(kv[0].shape[0] / P) for kv in model.values())
        assert cache.free_pages == cache.num_pages - used
        for s, kv in model.items():
            assert_layout(cache, s, *kv)
            assert_stats_match(cache, s)


# ------------------------------------------------------------------- cost
def test_append_cost_does_not_grow_with_length():
    """One append costs the same with 1k and 64k cached tokens (within 2x).

    Each sequence gets its own cache sized to it, so re-copying or re-scanning
    the cache, the sequence or its page list would all show up as a gap.
    """
    threads = torch.get_num_threads()
    # One thread: intra-op thread wake-ups cost milliseconds on a loaded
    # 2-core machine and would hide an O(n) copy behind the noise.
    torch.set_num_threads(1)
    try:
        med_short, med_long = _append_medians()
    finally:
        torch.set_num_threads(threads)
    assert med_long < 2 * med_short, (med_short, med_long)
    assert med_short < 2 * med_long, (med_short, med_long)


def _append_medians():
    """Median ns of one batch-1 fp32 append at 1k and at 64k cached tokens."""
    torch.manual_seed(0)
    P, H, D, steps, warmup = 16, 2, 64, 200, 30
    caches = {}
    for n in (1024, 65536):
        cache = PagedKVCache(n // P + (steps + warmup) // P + 2, P, H, D, max_seqs=1,
                             dtype=torch.float32)
        s = cache.allocate()
        cache.prefill(s, torch.randn(n, H, D), torch.randn(n, H, D), check_finite=False)
        caches[n] = (cache, s)
    k = torch.randn(1, H, D)
    times = {n: [] for n in caches}
    for i in range(warmup + steps):
        for n, (cache, s) in caches.items():  # interleaved: machine-load drift hits both
            t0 = time.perf_counter_ns()
            cache.append([s], k, k)
            t1 = time.perf_counter_ns()
            if i >= warmup:
                times[n].append(t1 - t0)
    for n, (cache, s) in caches.items():
        assert cache.length(s) == n + warmup + steps
    return statistics.median(times[1024]), statistics.median(times[65536])


# ------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_matches_cpu_without_host_sync(dtype):
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(3, 40, 2, 8, generator=gen), torch.randn(3, 40, 2, 8, generator=gen)
    lens = [40, 17, 5]
    caches = [
        PagedKVCache.from_dense(k.to(dev), v.to(dev), lens, 8, dtype=dtype, spare_pages=9,
                                max_seqs=4, generator=torch.Generator().manual_seed(1))
        for dev in ("cpu", "cuda")
    ]
    assert caches[1][0].device.type == "cuda" and caches[1][0].seq_lens.is_cuda
    # The shuffled block tables are identical (same generator seed).
    assert torch.equal(caches[0][0].block_table, caches[1][0].block_table.cpu())
    for step in range(12):
        kk, vv = rand_kv(3, 2, 8, gen)
        for cache, slots in caches:
            kk_d, vv_d = kk.to(cache.device), vv.to(cache.device)
            torch.cuda.set_sync_debug_mode("error")  # any host sync raises
            try:
                cache.append(torch.tensor(slots), kk_d, vv_d, check_finite=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    (cpu, slots), (gpu, _) = caches
    for cache in (cpu, gpu):
        kk, vv = rand_kv(20, 2, 8, torch.Generator().manual_seed(2))
        kk, vv = kk.to(cache.device), vv.to(cache.device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            cache.extend(slots[2], kk, vv, check_finite=False)
            tmp = cache.allocate()
            cache.prefill(tmp, kk[:3], vv[:3], check_finite=False)
            cache.free(tmp)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for name in ("k_pages", "v_pages", "k_min", "k_max", "block_table", "seq_lens"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    for name in ("_mean32", "_m2"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name))
    tol = ROUNDED_TOL[dtype]
    for name in ("k_mean", "k_std"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name), rtol=tol, atol=tol)
    # The sync detector is live: the finite checks of prefill and append do
    # synchronise (and fail before anything is written).
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            gpu.prefill(slots[1], kk, vv)
        with pytest.raises(RuntimeError):
            gpu.append(slots[1:], kk[:1], vv[:1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s in slots:
        assert torch.equal(gpu.gather(s)[0].cpu(), cpu.gather(s)[0])
