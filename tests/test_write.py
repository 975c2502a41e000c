"""The graph-safe cache write: ``PagedKVCache.reserve`` + ``write`` (and
``ops.write_kv``) against today's ``append`` / ``prefill``, on the reference
and on the Triton kernel (interpreter here)."""
from __future__ import annotations

import pytest
import torch

from entmaxkv import CacheFullError, PagedKVCache
from entmaxkv import ops
from entmaxkv.layout import PagedKV, split_packed
from entmaxkv.testing import assert_same_state, cache_state

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    pytest.importorskip("triton") is None, reason="needs triton"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _twins(P, dtype, layers=1, pages=48, H=2, D=5):
    """Two empty caches of the same shape (one for append, one for reserve + write)."""
    return [PagedKVCache(pages, P, H, D, max_seqs=4, max_pages_per_seq=pages, dtype=dtype, num_layers=layers)
            for _ in range(2)]


def _kv(gen, layers, n, H=2, D=5, scale=3.0):
    shape = (n, H, D) if layers == 1 else (layers, n, H, D)
    return torch.randn(*shape, generator=gen) * scale, torch.randn(*shape, generator=gen)


def _write_all(cache, k, v, slots, backend):
    if cache.num_layers == 1:
        cache.write(k, v, slots, backend=backend)
    else:
        for i in range(cache.num_layers):
            cache.write(k[i], v[i], slots, layer=i, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("P", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reserve_write_equals_append(dtype, P, layers, backend):
    """Bit for bit: pages, statistics, Welford state, block table, lengths and
    host mirrors, across page boundaries, a freed sequence and its pages reused."""
    gen = torch.Generator().manual_seed(P * 7 + layers)
    a, b = _twins(P, dtype, layers)
    for n in (2 * P + 1, P, 1):
        k, v = _kv(gen, layers, n)
        for c in (a, b):
            c.allocate(k, v)
    for step in range(2 * P + 3):
        if step == P:  # free the middle sequence; a new one takes its pages
            k, v = _kv(gen, layers, 2)
            for c in (a, b):
                c.free(1)
                assert c.allocate(k, v) == 1
        seqs = [2, 0, 1] if step % 2 else [0, 1, 2]
        k, v = _kv(gen, layers, 3)
        a.append(seqs, k, v)
        _write_all(b, k, v, b.reserve(seqs), backend)
        assert_same_state(cache_state(a), cache_state(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reserve_full_pool_leaves_cache_intact(backend):
    """A reserve that does not fit raises CacheFullError before any write:
    every sequence, page, statistic and host mirror is as it was."""
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(6, 4, 2, 5, max_seqs=3, max_pages_per_seq=4, dtype=torch.float16)
    for n in (8, 7):
        cache.allocate(*_kv(gen, 1, n))
    before = cache_state(cache)
    with pytest.raises(CacheFullError, match="reserve of 9 tokens"):
        cache.reserve([0, 1], [1, 8])  # 1 + 2 new pages, 2 free
    with pytest.raises(CacheFullError, match="max_pages_per_seq"):
        cache.reserve([0], 9)  # 17 tokens: 5 pages > 4
    assert_same_state(cache_state(cache), before)
    slots = cache.reserve([0, 1], [1, 1])  # fits: one new page (seq 0), seq 1's page has room
    assert slots.tolist() == [cache._pages[0][2] * 4, cache._pages[1][1] * 4 + 3] and cache._pages[0][2] == 4
    _write_all(cache, *_kv(gen, 1, 2), slots, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("P", [3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_chunks_equal_prefill(dtype, P, backend):
    """A prompt written in chunks through the slot mapping (pages filled by
    several tokens at once, a chunk starting mid-page, two sequences in one
    mapping) equals prefill: the same pages and min/max, the moments to
    float32 rounding (a sum in another order)."""
    gen = torch.Generator().manual_seed(11)
    a, b = _twins(P, dtype)
    n0, n1 = 5 * P + 2, 2 * P + 1
    k0, v0 = _kv(gen, 1, n0)
    k1, v1 = _kv(gen, 1, n1)
    for c in (a, b):
        c.allocate()
        c.allocate()
    a.prefill(0, k0, v0)
    a.prefill(1, k1, v1)
    cut0, cut1 = P + 1, 2
    first = b.reserve([0, 1], [cut0, cut1])
    _write_all(b, torch.cat((k0[:cut0], k1[:cut1])), torch.cat((v0[:cut0], v1[:cut1])), first, backend)
    rest = b.reserve([1, 0], [n1 - cut1, n0 - cut0])
    _write_all(b, torch.cat((k1[cut1:], k0[cut0:])), torch.cat((v1[cut1:], v0[cut0:])), rest, backend)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    la, lb = a.layer(), b.layer()
    for s in (0, 1):
        assert all(torch.equal(x, y) for x, y in zip(a.gather(s), b.gather(s)))
        pa, pb = a.page_ids(s).long(), b.page_ids(s).long()  # the same logical pages
        assert torch.equal(la.k_bounds[pa], lb.k_bounds[pb])
        assert torch.allclose(la.welford[pa], lb.welford[pb], rtol=1e-5, atol=1e-5)
        assert torch.allclose(la.k_moments[pa].float(), lb.k_moments[pb].float(), rtol=tol, atol=tol)
    assert a.seq_lens.tolist() == b.seq_lens.tolist() and a.free_pages == b.free_pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_skips_padding(backend):
    """Slots < 0 are padding: the write equals the one without them."""
    gen = torch.Generator().manual_seed(5)
    a, b = _twins(4, torch.float16)
    for c in (a, b):
        c.allocate(*_kv(torch.Generator().manual_seed(1), 1, 6))
        c.allocate(*_kv(torch.Generator().manual_seed(2), 1, 3))
    k, v = _kv(gen, 1, 2)
    _write_all(a, k, v, a.reserve([0, 1]), backend)
    slots = b.reserve([0, 1])
    pad = torch.tensor([-1], dtype=torch.int64)
    kp = torch.cat((k[:1], torch.randn(1, 2, 5), k[1:]))
    vp = torch.cat((v[:1], torch.randn(1, 2, 5), v[1:]))
    _write_all(b, kp, vp, torch.cat((slots[:1], pad, slots[1:])), backend)
    assert_same_state(cache_state(a), cache_state(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_under_autograd_and_inference_mode(backend):
    """Keys that require grad are stored detached; a cache built in inference
    mode is written outside it, and inside it too."""
    gen = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        cache = PagedKVCache(8, 4, 2, 5, max_seqs=2, dtype=torch.float32)
    ref = PagedKVCache(8, 4, 2, 5, max_seqs=2, dtype=torch.float32)
    for c in (cache, ref):
        c.allocate()
    k, v = _kv(gen, 1, 3)
    kg, vg = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
    _write_all(cache, kg * 1.0, vg * 1.0, cache.reserve([0], 3), backend)
    with torch.inference_mode():
        k2, v2 = _kv(gen, 1, 2)
        _write_all(cache, k2, v2, cache.reserve([0], 2), backend)
    ref.prefill(0, k, v)
    ref.append([0], k2[:1], v2[:1])
    ref.append([0], k2[1:], v2[1:])
    assert not any(t.requires_grad or t.is_inference() for t in cache.state_tensors().values())
    sa, sb = cache_state(ref), cache_state(cache)
    for name in ("layer0.k_pages", "layer0.v_pages", "layer0.k_bounds", "seq_lens", "block_table"):
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_packed_buffers(backend):
    """A PagedKV over strided views of one packed [N, H, P, 2D] buffer gets
    exactly what separate contiguous buffers get."""
    gen = torch.Generator().manual_seed(9)
    N, H, P, D = 12, 2, 4, 6
    packed = torch.zeros(N, H, P, 2 * D, dtype=torch.float16)
    kp, vp = split_packed(packed)
    strided = PagedKV.from_buffers(kp, vp)
    plain = PagedKV.from_buffers(torch.zeros(N, H, P, D, dtype=torch.float16),
                                 torch.zeros(N, H, P, D, dtype=torch.float16))
    slots = torch.tensor([4 * 3 + 0, 4 * 3 + 1, 4 * 3 + 2, 4 * 7 + 0, 4 * 3 + 3, 4 * 7 + 1])
    for chunk in (slice(0, 4), slice(4, 6)):  # a page of 3 tokens, then one token into each of two pages
        k = torch.randn(6, H, D, generator=gen)[chunk]
        v = torch.randn(6, H, D, generator=gen)[chunk]
        for kv in (strided, plain):
            ops.write_kv(kv, k, v, slots[chunk], backend=backend)
    for name in ("k_pages", "v_pages", "k_bounds", "k_moments", "welford"):
        assert torch.equal(getattr(strided, name), getattr(plain, name)), name
    assert torch.equal(packed[..., :D], plain.k_pages) and torch.equal(packed[..., D:], plain.v_pages)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("P", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_stats_in_pages(dtype, P, backend):
    """Pages that hold their own statistics (``stats_in_pages``, an engine's
    opaque page buffer sized by ``row_width``, inside a larger allocation)
    get exactly what separate buffers get, bytes of other pages untouched."""
    from entmaxkv.layout import row_width, stats_in_pages

    gen = torch.Generator().manual_seed(P)
    N, H, D = 9, 2, 6
    C = row_width(P, D, dtype)
    raw = torch.randn(3 * N * H * P * C + 8).to(dtype)  # another tenant's bytes around ours
    pages = raw[4:4 + N * H * P * C].view(N, H, P, C)
    pages.zero_()
    before = raw.clone()
    inside = stats_in_pages(pages, D)
    plain = PagedKV.from_buffers(torch.zeros(N, H, P, D, dtype=dtype), torch.zeros(N, H, P, D, dtype=dtype))
    slots = torch.randperm(N * P, generator=gen)[:1].tolist()
    page = slots[0] // P
    run = [page * P + r for r in range(P)]  # a whole page, then one token at a time into another
    other = (page + 1) % N
    for chunk in (run, [other * P], [other * P + 1] if P > 1 else [((page + 2) % N) * P]):
        idx = torch.tensor(chunk)
        k, v = torch.randn(len(chunk), H, D, generator=gen) * 3, torch.randn(len(chunk), H, D, generator=gen)
        for kv in (inside, plain):
            ops.write_kv(kv, k, v, idx, backend=backend)
    for name in ("k_pages", "v_pages", "k_bounds", "k_moments", "welford"):
        assert torch.equal(getattr(inside, name), getattr(plain, name)), name
    assert torch.equal(raw[:4], before[:4]) and torch.equal(raw[4 + N * H * P * C:], before[4 + N * H * P * C:])


def test_stats_in_pages_validation():
    from entmaxkv.layout import row_width, stats_in_pages

    C = row_width(4, 6, torch.float16)
    with pytest.raises(ValueError, match="pages:"):
        stats_in_pages(torch.zeros(3, 2, 4, C - 1, dtype=torch.float16), 6)  # too narrow
    with pytest.raises(ValueError, match="pages:"):
        stats_in_pages(torch.zeros(3, 2, C, 4, dtype=torch.float16).transpose(2, 3), 6)  # rows not contiguous
    with pytest.raises(ValueError, match="pages:"):
        stats_in_pages(torch.zeros(3, 2, 4, C, dtype=torch.float64), 6)
    with pytest.raises(ValueError, match="pages:"):  # float32 words would straddle 4-byte boundaries
        stats_in_pages(torch.zeros(3 * 2 * 4 * C + 1, dtype=torch.float16)[1:].view(3, 2, 4, C), 6)
    with pytest.raises(ValueError, match="head_dim"):
        row_width(4, 5, torch.float16)
    with pytest.raises(ValueError, match="page_size"):
        row_width(0, 6, torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        row_width(4, 6, torch.int8)
    assert row_width(16, 128, torch.float16) == 2 * 128 + 64  # statistics: 25% on top of K and V


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_nonfinite_key_recomputes_page(backend):
    """A NaN key (no check on this path) leaves the page's min/max NaN-aware
    and its mean/M2 recomputed from the rows, as append(check_finite=False) does."""
    gen = torch.Generator().manual_seed(12)
    a, b = _twins(4, torch.float32)
    for c in (a, b):
        c.allocate(*_kv(torch.Generator().manual_seed(4), 1, 6))
    k, v = _kv(gen, 1, 1)
    k[0, 1, 2] = float("nan")
    a.append([0], k, v, check_finite=False)
    _write_all(b, k, v, b.reserve([0]), backend)
    k2, v2 = _kv(gen, 1, 1)
    a.append([0], k2, v2, check_finite=False)
    _write_all(b, k2, v2, b.reserve([0]), backend)
    sa, sb = cache_state(a), cache_state(b)
    for name in ("layer0.k_pages", "layer0.k_bounds", "layer0.welford", "layer0.k_moments"):
        assert torch.allclose(sa[name], sb[name], rtol=1e-6, atol=1e-6, equal_nan=True), name


def test_refresh_stats_equals_prefill():
    """Statistics rebuilt from pages someone else filled equal the cache's own."""
    gen = torch.Generator().manual_seed(13)
    cache = PagedKVCache(20, 4, 2, 5, max_seqs=3, max_pages_per_seq=8, dtype=torch.bfloat16)
    for n in (9, 16, 3):
        cache.allocate(*_kv(gen, 1, n))
    lay = cache.layer()
    wrapped = PagedKV.from_buffers(lay.k_pages.clone(), lay.v_pages.clone(), cache.block_table, cache.seq_lens)
    ops.refresh_stats(wrapped)
    used = torch.tensor(sorted(p for s in range(3) for p in cache._pages[s]))
    for name in ("k_bounds", "k_moments"):
        assert torch.equal(getattr(wrapped, name)[used], getattr(lay, name)[used]), name
    assert torch.allclose(wrapped.welford[used], lay.welford[used], rtol=1e-6, atol=1e-6)


def test_write_validation():
    kv = PagedKV.from_buffers(torch.zeros(4, 2, 4, 5), torch.zeros(4, 2, 4, 5))
    k = torch.zeros(2, 2, 5)
    good = torch.tensor([0, 1])
    cases = [
        (dict(kv="x"), "kv: expected a layout.PagedKV"),
        (dict(k=torch.zeros(2, 3, 5)), r"k: expected a \[tokens, 2, 5\]"),
        (dict(v=torch.zeros(2, 2, 5, dtype=torch.int32)), "v: expected a floating tensor"),
        (dict(slots=good.float()), "slot_mapping: expected an int32/int64 tensor"),
        (dict(slots=torch.tensor([0])), "slot_mapping: expected one slot per token"),
        (dict(slots=torch.tensor([0, 16])), "slot 16 is past the last slot 15"),
        (dict(kv=PagedKV(kv.k_pages, kv.v_pages, kv.k_bounds, kv.k_moments)), "welford: expected a torch.float32"),
    ]
    for change, msg in cases:
        args = dict(kv=kv, k=k, v=k, slots=good) | change
        with pytest.raises(ValueError, match=msg):
            ops.write_kv(args["kv"], args["k"], args["v"], args["slots"])
    cache = PagedKVCache(4, 4, 2, 5, max_seqs=2)
    cache.allocate()
    with pytest.raises(ValueError, match="counts: expected 1 counts"):
        cache.reserve([0], [1, 2])
    with pytest.raises(ValueError, match="counts must be a non-negative int"):
        cache.reserve([0], -1)
    with pytest.raises(ValueError, match="layer: expected an int in 0..0"):
        cache.write(k, k, good, layer=1)
    with pytest.raises(ValueError, match="kv_pages: expected a"):
        split_packed(torch.zeros(4, 2, 4, 5))
