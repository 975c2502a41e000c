"""Atomic writes and non-finite data in entmaxkv.cache.PagedKVCache.

Every write either completes or leaves the cache bit-identical to its state
before the call (``entmaxkv.testing.cache_state`` / ``assert_same_state``):
under autograd, across inference-mode boundaries, on a full pool, on
non-finite data and on failures injected into the torch calls a write makes.
Non-finite keys/values are rejected after the cast to the storage dtype
unless the caller opts out, and a page whose running statistics are not
finite has them recomputed from its rows. Appends of finite data stay
bit-identical to the incremental float32 update, re-implemented here.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entmaxkv.cache import CacheFullError, PagedKVCache
from entmaxkv.testing import InjectedFailure, assert_same_state, cache_state, inject_failure

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
STATE_TENSORS = ("k_pages", "v_pages", "k_bounds", "k_moments", "_mean32", "_m2",
                 "block_table", "seq_lens")


def kv(n, H, D, seed, scale=1.0, shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=gen) * scale + shift,
            torch.randn(n, H, D, generator=gen))


def new_seq(cache, k, v, **kw):
    """allocate() then prefill (the two-step way, as callers wrote it before)."""
    s = cache.allocate()
    cache.prefill(s, k, v, **kw)
    return s


def busy_cache(dtype=torch.float32, P=4, H=2, D=3):
    """Three sequences: 6 tokens (last page half full), 4 (page full), 0; 5 pages free."""
    cache = PagedKVCache(8, P, H, D, max_seqs=4, dtype=dtype)
    for i, n in enumerate((6, 4, 0)):
        new_seq(cache, *kv(n, H, D, seed=i, scale=2.0, shift=0.5))
    return cache


def assert_plain_tensors(cache):
    """No state tensor requires grad, has a graph or is an inference tensor."""
    for name in STATE_TENSORS:
        t = getattr(cache, name)
        assert not t.requires_grad and t.grad_fn is None and not t.is_inference(), name


def page_counts(cache, seq):
    n, P = cache.length(seq), cache.page_size
    return torch.tensor([min(P, n - i * P) for i in range(math.ceil(n / P))], dtype=torch.int64)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_equal_nan(a, b):
    """Equal values, NaN where the other is NaN (any NaN bits)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_stats_are_recompute(cache, seq, *, exact_pages=None):
    """The statistics of ``seq``'s pages equal ``_recompute_stats`` of their rows.

    min/max are exact always; the float32 state is exact on ``exact_pages``
    (logical indices: pages whose statistics had to be recomputed) and
    within float32 rounding elsewhere.
    """
    pages = cache.page_ids(seq).long()
    count = page_counts(cache, seq)
    rmin, rmax, rmean, rm2 = cache._recompute_stats(pages, count)
    assert_equal_nan(cache.k_min[pages], rmin)
    assert_equal_nan(cache.k_max[pages], rmax)
    exact = list(exact_pages or [])
    for got, want in ((cache._mean32[pages], rmean), (cache._m2[pages], rm2)):
        assert_equal_nan(got[exact], want[exact])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    # the root in float64, rounded once: the correctly rounded float32 root (stats.moments)
    std = torch.sqrt((cache._m2[pages].clamp_min(0) / count[:, None, None].float()).double()).float()
    assert torch.equal(bits(cache.k_mean[pages]), bits(cache._mean32[pages].to(cache.dtype)))
    assert torch.equal(bits(cache.k_std[pages]), bits(std.to(cache.dtype)))


# ------------------------------------------------------------- autograd
def test_writes_under_autograd_store_detached_values():
    """K/V that require grad (a model run without no_grad) are stored as values.

    Before, the in-place write onto a leaf raised halfway, with the lengths
    advanced and only part of the statistics written.
    """
    H, D = 2, 3
    w = torch.randn(D, D, requires_grad=True)
    k, v = kv(7, H, D, seed=1)
    k_graph, v_graph = k @ w, v @ w  # non-leaf tensors with a graph
    k_leaf = k.clone().requires_grad_(True)
    got = PagedKVCache(8, 4, H, D, max_seqs=3, dtype=torch.float16)
    ref = PagedKVCache(8, 4, H, D, max_seqs=3, dtype=torch.float16)
    for cache, grad in ((got, True), (ref, False)):
        kk = k_graph if grad else k_graph.detach()
        vv = v_graph if grad else v_graph.detach()
        kl = k_leaf if grad else k_leaf.detach()
        a = new_seq(cache, kk[:5], vv[:5])
        b = new_seq(cache, kl[:3], kl[:3])
        cache.append([a, b], kk[5:7], kl[5:7])
        cache.extend(a, kl[:2], vv[:2], check_finite=False)
        cache.allocate(kl[2:4], kk[3:5])  # allocate-and-prefill
    assert_same_state(cache_state(got), cache_state(ref))
    assert_plain_tensors(got)
    # The caller's graph is intact and was not extended by the cache.
    (k_graph.sum() + v_graph.sum()).backward()
    assert w.grad is not None and k_leaf.grad is None


# ------------------------------------------------------- inference mode
@pytest.mark.parametrize("built_inside", [True, False], ids=["built-inside", "built-outside"])
def test_writes_across_inference_mode_boundaries(built_inside):
    """A cache built under torch.inference_mode() is written outside it, and
    the reverse, with inputs made on either side.

    Before, building inside and writing outside raised after the host length
    had advanced (host 3, device 0: a decode then returned zeros).
    """
    H, D = 1, 3
    with torch.inference_mode():
        k_inf, v_inf = kv(9, H, D, seed=2)
    k_out, v_out = kv(9, H, D, seed=2)

    def build():
        return PagedKVCache(6, 2, H, D, max_seqs=2, dtype=torch.float32)

    if built_inside:
        with torch.inference_mode():
            cache = build()
    else:
        cache = build()
    ref = build()
    assert_plain_tensors(cache)
    steps = [
        lambda c, kk, vv: new_seq(c, kk[:3], vv[:3]),
        lambda c, kk, vv: c.append([0], kk[3:4], vv[3:4]),
        lambda c, kk, vv: c.extend(0, kk[4:6], vv[4:6]),
        lambda c, kk, vv: new_seq(c, kk[6:7], vv[6:7]),
        lambda c, kk, vv: c.append([1, 0], kk[7:9], vv[7:9]),
        lambda c, kk, vv: c.free(0),
        lambda c, kk, vv: new_seq(c, kk[:5], vv[:5]),
    ]
    for i, step in enumerate(steps):
        inside = i % 2 == (0 if built_inside else 1)  # alternate, starting on the other side
        data = (k_inf, v_inf) if i % 3 == 0 else (k_out, v_out)
        if inside:
            with torch.inference_mode():
                step(cache, *data)
        else:
            step(cache, *data)
        step(ref, k_out, v_out)
        assert cache.seq_lens.tolist() == [cache._lens[s] for s in range(2)]
        assert_same_state(cache_state(cache), cache_state(ref))
    assert_plain_tensors(cache)


# ------------------------------------------------------------ full pool
def test_allocate_with_tokens_is_atomic():
    """allocate(k, v) claims a slot only if its prefill succeeds.

    Before, allocate() + a prefill longer than the whole pool raised
    CacheFullError and left the slot allocated.
    """
    cache = busy_cache()
    before = cache_state(cache)
    with pytest.raises(CacheFullError, match="needs 6 new pages but only 5 are free"):
        cache.allocate(*kv(21, 2, 3, seed=3))  # longer than the 5 free pages
    assert_same_state(before, cache_state(cache))
    with pytest.raises(ValueError, match=r"\bk\[2\].*token 2"):
        cache.allocate(torch.tensor([[[0.0, 1.0, 2.0]] * 2] * 2 + [[[0.0, math.nan, 0.0]] * 2]),
                       torch.zeros(3, 2, 3))
    assert_same_state(before, cache_state(cache))
    with pytest.raises(ValueError, match=r"\bv\b"):
        cache.allocate(torch.zeros(2, 2, 3), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match=r"\bv\b"):
        cache.allocate(torch.zeros(2, 2, 3))  # k without v
    with pytest.raises(ValueError, match=r"\bk\b"):
        cache.allocate(v=torch.zeros(2, 2, 3))
    assert_same_state(before, cache_state(cache))
    # Success: the lowest free slot, as allocate() + prefill would give.
    twin = busy_cache()
    k, v = kv(9, 2, 3, seed=4)
    s = cache.allocate(k, v)
    t = twin.allocate()
    twin.prefill(t, k, v)
    assert s == t == 3
    assert_same_state(cache_state(cache), cache_state(twin))
    # That was the last slot: now no slot is free and nothing is claimed.
    before = cache_state(cache)
    with pytest.raises(CacheFullError, match="max_seqs=4"):
        cache.allocate(k[:1], v[:1])
    assert_same_state(before, cache_state(cache))


def test_allocate_with_zero_tokens_claims_an_empty_slot():
    cache = busy_cache()
    s = cache.allocate(torch.zeros(0, 2, 3), torch.zeros(0, 2, 3))
    assert s == 3 and cache.length(s) == 0 and cache.active_seqs() == [0, 1, 2, 3]


def test_from_dense_validates_before_building():
    k = torch.zeros(2, 9, 1, 3)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        PagedKVCache.from_dense(k, k, [9, 2], 4, max_pages_per_seq=2)  # 9 tokens need 3 pages
    with pytest.raises(ValueError, match=r"\bdtype\b"):
        PagedKVCache.from_dense(k.double(), k.double(), [9, 2], 4)  # float64 is no storage dtype
    with pytest.raises(ValueError, match=r"\bk\b"):
        PagedKVCache.from_dense(k.long(), k.long(), [9, 2], 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="lens"):
        PagedKVCache.from_dense(k, k, None, 4)
    with pytest.raises(ValueError, match="generator"):
        PagedKVCache.from_dense(k, k, [9, 2], 4, generator=0)
    with pytest.raises(ValueError, match="shuffle"):
        PagedKVCache.from_dense(k, k, [9, 2], 4, shuffle="yes")
    bad = torch.zeros(2, 9, 1, 3)
    bad[1, 1, 0, 1] = 1e5  # finite, but inf in float16
    with pytest.raises(ValueError, match=r"k\[1\] \(token 1 of the prefill, position 1 of sequence 1\)"):
        PagedKVCache.from_dense(bad, k, [9, 2], 4, dtype=torch.float16)
    # numpy integers are ints.
    cache, slots = PagedKVCache.from_dense(k, k, np.array([9, 2]), np.int64(4),
                                           spare_pages=np.int32(1), max_seqs=np.int64(3))
    assert [cache.length(s) for s in slots] == [9, 2] and cache.free_pages == 1


def test_decode_session_failed_prefill_leaves_its_slots_empty():
    from entmaxkv.model.generate import DecodeSession
    from entmaxkv.model.lm import ModelConfig, TransformerLM
    from entmaxkv.policies import Full

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48)).eval()
    x = torch.randint(0, 256, (2, 13))
    sess = DecodeSession(model, 2, 12, page_size=4, copies=2)
    layer2 = sess.caches[2]

    def broken(*args, **kwargs):
        raise RuntimeError("layer 2 failed")

    layer2.prefill = broken  # layers 0 and 1 are written first
    with pytest.raises(RuntimeError, match="layer 2 failed"):
        sess.prefill(x[:, :8])
    del layer2.prefill
    for cache in sess.caches:
        assert cache.active_seqs() == [0, 1, 2, 3] and cache.free_pages == cache.num_pages
        assert all(cache.length(s) == 0 for s in range(4)) and not cache.seq_lens.any()
    with pytest.raises(ValueError, match="max_len"):
        sess.prefill(x)  # 13 tokens, longer than the session's 12: refused before any write
    for cache in sess.caches:
        assert cache.free_pages == cache.num_pages and not cache.seq_lens.any()
    # The session still works and matches a fresh one.
    fresh = DecodeSession(model, 2, 12, page_size=4, copies=2)
    assert torch.equal(sess.prefill(x[:, :8]), fresh.prefill(x[:, :8]))
    assert torch.equal(sess.step(x[:, 8], Full()), fresh.step(x[:, 8], Full()))


# ------------------------------------------------------ injected failures
def _poison(c):
    """Store an inf key in sequence 0's last page, opting out of the check."""
    k = torch.zeros(1, 2, 3)
    k[0, 1, 2] = math.inf
    c.append([0], k, torch.zeros(1, 2, 3), check_finite=False)


def _write_cases():
    """(name, set-up, write) triples; both run on a fresh busy_cache(), the
    set-up outside the injected failures."""
    k6, v6 = kv(6, 2, 3, seed=5, scale=3.0)
    k3, v3 = kv(3, 2, 3, seed=6, scale=3.0)
    nothing = lambda c: None  # noqa: E731
    return [
        ("prefill-spanning-pages", nothing, lambda c: c.prefill(0, k6, v6)),
        ("prefill-empty-seq", nothing, lambda c: c.prefill(2, k6[:5], v6[:5])),
        ("append-batch", nothing, lambda c: c.append([1, 0, 2], k3, v3)),
        ("append-unchecked", nothing, lambda c: c.append([2, 1, 0], k3, v3, check_finite=False)),
        ("append-poisoned-page", _poison, lambda c: c.append([0, 1], k3[:2], v3[:2])),
        ("allocate-prefill", nothing, lambda c: c.allocate(k6, v6)),
        ("free", nothing, lambda c: c.free(0)),
    ]


_FAULTS = [
    (torch.Tensor, "__setitem__", False),
    (torch.Tensor, "__setitem__", True),  # fails after its write
    (torch.Tensor, "__getitem__", False),
    (torch.Tensor, "to", False),
    (torch.Tensor, "detach", False),
    (torch.Tensor, "clone", False),
    (torch.Tensor, "tolist", False),
    (torch, "where", False),
    (torch, "stack", False),
    (torch, "tensor", False),
    (torch, "zeros", False),
]
_CASE_IDS = [name for name, _, _ in _write_cases()]


def _prepared(setup):
    cache = busy_cache()
    setup(cache)
    return cache


@pytest.mark.parametrize("case", range(len(_CASE_IDS)), ids=_CASE_IDS)
def test_injected_failures_leave_the_cache_unchanged(case):
    """A failure at each call of each listed torch op inside a write leaves
    the cache bit-identical to before; the same write then succeeds and gives
    what it gives on a cache that never saw a failure."""
    name, setup, write = _write_cases()[case]
    clean = _prepared(setup)
    write(clean)
    done = cache_state(clean)
    fired = 0
    for owner, op, after in _FAULTS:
        for n in range(1, 1000):
            cache = _prepared(setup)
            before = cache_state(cache)
            raised = False
            with inject_failure(owner, op, on_call=n, after=after) as counter:
                try:
                    write(cache)
                except InjectedFailure:
                    raised = True
            if not counter.fired:  # the write made fewer than n calls of op
                assert_same_state(cache_state(cache), done)
                break
            assert raised, f"{name}: the failure in call {n} of {op} was swallowed"
            fired += 1
            try:
                assert_same_state(before, cache_state(cache))
            except AssertionError as err:
                raise AssertionError(f"{name}: failure in call {n} of {op} (after={after}): {err}")
            write(cache)  # the cache is still usable
            assert_same_state(cache_state(cache), done)
        else:
            raise AssertionError(f"{name}: {op} still called after 1000 calls")
    assert fired >= 5  # the injections did reach the write


# ------------------------------------------------------------ non-finite
def _nonfinite_cases():
    """(storage dtype, argument, value): each value is not finite once cast."""
    return [
        (torch.float16, "k", 1e5),  # finite in float32, inf in float16
        (torch.float16, "v", -7e4),
        (torch.bfloat16, "k", math.nan),
        (torch.float32, "v", math.inf),
        (torch.float32, "k", 1e39),  # given in float64: inf in float32
    ]


@pytest.mark.parametrize("case", range(len(_nonfinite_cases())))
@pytest.mark.parametrize("method", ["prefill", "append", "allocate"])
def test_nonfinite_writes_are_rejected_after_the_cast(method, case):
    """NaN/inf, or a finite value the storage dtype cannot hold, raises a
    ValueError naming the argument, the sequence and the token, and changes
    nothing. Before, prefill checked before the cast (so 1e5 was stored as
    inf in float16) and append did not check at all."""
    dtype, arg, value = _nonfinite_cases()[case]
    H, D = 2, 3
    cache = PagedKVCache(8, 4, H, D, max_seqs=4, dtype=dtype)
    for n in (5, 2):
        new_seq(cache, *kv(n, H, D, seed=n))
    before = cache_state(cache)
    n = 3
    k, v = kv(n, H, D, seed=9)
    k, v = k.double(), v.double()
    (k if arg == "k" else v)[1, 1, 2] = value
    if method == "prefill":
        call, where = lambda **kw: cache.prefill(1, k, v, **kw), "position 3 of sequence 1"
    elif method == "append":
        call, where = lambda **kw: cache.append([1, 2, 0], k, v, **kw), "sequence 2, token 0"
        new_seq(cache, k[:0], v[:0])
        before = cache_state(cache)
    else:
        call, where = lambda **kw: cache.allocate(k, v, **kw), "position 1 of sequence 2"
    for check in (None, True):
        with pytest.raises(ValueError, match=rf"\b{arg}\[1\] \(.*{where}\).*{dtype}"):
            call(check_finite=check)
        assert_same_state(before, cache_state(cache))
    # Opted out, it is stored as cast.
    call(check_finite=False)
    k_stored, v_stored = cache.gather(1 if method == "prefill" else 2)
    got = (k_stored if arg == "k" else v_stored)[-1 if method == "append" else -2]
    assert not bool(torch.isfinite(got).all())


def test_check_finite_must_be_none_or_bool():
    cache = busy_cache()
    before = cache_state(cache)
    k, v = kv(1, 2, 3, seed=0)
    for bad in ("yes", 1, 0.0):
        for call in (lambda: cache.prefill(0, k, v, check_finite=bad),
                     lambda: cache.append([0], k, v, check_finite=bad),
                     lambda: cache.allocate(k, v, check_finite=bad)):
            with pytest.raises(ValueError, match="check_finite"):
                call()
    assert_same_state(before, cache_state(cache))
    cache.append([0], k, v, check_finite=np.bool_(True))
    cache.append([0], k, v, check_finite=np.bool_(False))


def _poisoned(dtype, value, *, check_after):
    """A sequence whose first page holds one non-finite key coordinate (stored
    with check_finite=False), then more finite appends over three pages."""
    P, H, D = 4, 2, 3
    cache = PagedKVCache(6, P, H, D, max_seqs=2, dtype=dtype)
    s = new_seq(cache, *kv(2, H, D, seed=1, scale=2.0, shift=1.0))
    bad = torch.zeros(1, H, D)
    bad[0, 1, 2] = value
    cache.append([s], bad, torch.zeros(1, H, D), check_finite=False)
    for i in range(7):  # fills page 0 (row 3), then pages 1 and 2
        cache.append([s], *kv(1, H, D, seed=10 + i, scale=2.0), check_finite=check_after)
    return cache, s


@pytest.mark.parametrize("check_after", [None, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_poisoned_page_statistics_equal_a_recompute(dtype, value, check_after):
    """After more finite appends, a page holding a non-finite key has exactly
    the statistics a from-scratch recompute of its rows gives. Before, the
    running mean went from inf to NaN at the next append (inf - inf)."""
    cache, s = _poisoned(dtype, value, check_after=check_after)
    assert cache.length(s) == 10
    assert_stats_are_recompute(cache, s, exact_pages=[0])
    assert not bool(torch.isfinite(cache._m2[cache.page_ids(s).long()[0]]).all())
    # The other pages are clean.
    assert bool(torch.isfinite(cache._welford[cache.page_ids(s).long()[1:]]).all())


def test_overflowing_running_statistics_are_recomputed():
    """Finite float32 keys whose running update overflows (delta = -6e38) get
    the recomputed state: mean 0 (exact), not the running -inf."""
    cache = PagedKVCache(2, 4, 1, 1, max_seqs=1, dtype=torch.float32)
    s = cache.allocate()
    cache.append([s], torch.full((1, 1, 1), 3e38), torch.zeros(1, 1, 1))
    cache.append([s], torch.full((1, 1, 1), -3e38), torch.zeros(1, 1, 1))
    assert float(cache._mean32[0, 0, 0]) == 0.0 and float(cache.k_mean[0, 0, 0]) == 0.0
    assert_stats_are_recompute(cache, s, exact_pages=[0])


@pytest.mark.parametrize("reuse", ["append", "prefill"])
def test_freed_and_reused_poisoned_page_gets_clean_statistics(reuse):
    cache, s = _poisoned(torch.float16, math.nan, check_after=False)
    poisoned = int(cache.page_ids(s)[0])
    cache.free(s)
    t = cache.allocate()
    if reuse == "append":
        for i in range(3):
            cache.append([t], *kv(1, 2, 3, seed=30 + i))
    else:
        cache.prefill(t, *kv(3, 2, 3, seed=30))
    assert poisoned in cache.page_ids(t).tolist()
    assert bool(torch.isfinite(cache._welford[cache.page_ids(t).long()]).all())
    assert bool(torch.isfinite(cache.k_bounds[cache.page_ids(t).long()]).all())
    assert_stats_are_recompute(cache, t)


# ---------------------------------------------- bit-identical appends
class RunningPage:
    """An independent float32 model of one page's incremental statistics."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.rows = []

    def push(self, key):
        """key [H, D] in the storage dtype (first row resets the page)."""
        x = key.float()
        if not self.rows:
            self.kmin, self.kmax = key.clone(), key.clone()
            self.mean, self.m2 = torch.zeros_like(x), torch.zeros_like(x)
        else:
            self.kmin, self.kmax = torch.minimum(self.kmin, key), torch.maximum(self.kmax, key)
        self.rows.append(key)
        count = float(len(self.rows))
        delta = x - self.mean
        self.mean = self.mean + delta / count
        self.m2 = self.m2 + delta * (x - self.mean)
        self.std = torch.sqrt((torch.clamp(self.m2, min=0.0) / count).double()).float()  # correctly rounded

    def assert_matches(self, cache, page):
        got = (cache.k_min[page], cache.k_max[page], cache._mean32[page], cache._m2[page],
               cache.k_mean[page], cache.k_std[page])
        want = (self.kmin, self.kmax, self.mean, self.m2, self.mean.to(self.dtype),
                self.std.to(self.dtype))
        for name, a, b in zip(("k_min", "k_max", "mean32", "m2", "k_mean", "k_std"), got, want):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), (page, name)
        rows = torch.stack(self.rows)  # [n, H, D]
        assert torch.equal(bits(cache.k_pages[page, :, : len(self.rows)]), bits(rows.transpose(0, 1)))


@pytest.mark.parametrize("check", [None, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_appends_are_bit_identical_to_the_running_update(dtype, page_size, check):
    """Pages and statistics after appends of finite data equal, bit for bit, a
    per-token float32 Welford update (the cache's arithmetic), across page
    boundaries and on freed and reused pages."""
    P, H, D = page_size, 2, 5
    gen = torch.Generator().manual_seed(P)
    cache = PagedKVCache(3 * math.ceil(3 * P / P) + 6, P, H, D, max_seqs=3, dtype=dtype)
    model = {}  # physical page -> RunningPage

    def append(seqs):
        k = (torch.randn(len(seqs), H, D, generator=gen) * 4 + 2).to(dtype)
        cache.append(seqs, k, torch.randn(len(seqs), H, D, generator=gen), check_finite=check)
        for i, s in enumerate(seqs):
            n = cache.length(s)
            page = int(cache.page_ids(s)[(n - 1) // P])
            if (n - 1) % P == 0:
                model[page] = RunningPage(dtype)
            model[page].push(k[i])

    seqs = [cache.allocate() for _ in range(3)]
    for step in range(2 * P + 3):
        append([s for s in seqs if (step + s) % 3 or step % 2])
        for s in seqs:
            for page in cache.page_ids(s).tolist():
                model[page].assert_matches(cache, page)
    cache.free(seqs[1])  # its pages go back and are reused below
    freed = set(model) - {p for s in (seqs[0], seqs[2]) for p in cache.page_ids(s).tolist()}
    seqs[1] = cache.allocate()
    for step in range(P + 2):
        append([seqs[1], seqs[2]] if step % 2 else [seqs[1]])
    reused = freed & set(cache.page_ids(seqs[1]).tolist())
    assert reused
    for s in seqs:
        for page in cache.page_ids(s).tolist():
            model[page].assert_matches(cache, page)


# --------------------------------------------------- argument validation
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only build or machine")
def test_unavailable_cuda_device_is_a_value_error():
    with pytest.raises(ValueError, match=r"\bdevice\b.*CUDA is not available"):
        PagedKVCache(4, 2, 1, 3, max_seqs=1, device="cuda")


def test_unavailable_devices_are_value_errors():
    for device in ("cuda:1000", "not-a-device", None, 3.5):
        with pytest.raises(ValueError, match=r"\bdevice\b"):
            PagedKVCache(4, 2, 1, 3, max_seqs=1, device=device)
    assert PagedKVCache(4, 2, 1, 3, max_seqs=1, device="meta").device.type == "meta"


def test_default_max_pages_per_seq_error_names_what_was_passed():
    with pytest.raises(ValueError, match=r"num_pages \* page_size .* pass max_pages_per_seq"):
        PagedKVCache(2**24, 256, 1, 1, max_seqs=1, device="meta")
    with pytest.raises(ValueError, match=r"max_pages_per_seq must be in 1\.\.8388607"):
        PagedKVCache(2**24, 256, 1, 1, max_seqs=1, max_pages_per_seq=2**24, device="meta")


def test_numpy_integers_are_ints_and_floats_are_not():
    cache = PagedKVCache(np.int64(6), np.int32(2), np.int16(1), np.uint8(3),
                         max_seqs=np.int64(3), max_pages_per_seq=np.int8(3))
    assert (cache.num_pages, cache.page_size, cache.max_seqs, cache.max_pages_per_seq) == (6, 2, 3, 3)
    s = cache.allocate()
    cache.prefill(np.int64(s), torch.zeros(3, 1, 3), torch.zeros(3, 1, 3))
    cache.append(np.array([s]), torch.zeros(1, 1, 3), torch.zeros(1, 1, 3))
    cache.append([np.int32(s)], torch.zeros(1, 1, 3), torch.zeros(1, 1, 3))
    assert cache.length(np.int64(s)) == 5 and cache.page_ids(np.int16(s)).tolist() == [0, 1, 2]
    for name in ("num_pages", "page_size", "kv_heads", "head_dim", "max_seqs", "max_pages_per_seq"):
        kwargs = dict(num_pages=6, page_size=2, kv_heads=1, head_dim=3, max_seqs=3)
        kwargs[name] = np.float64(2.0)
        with pytest.raises(ValueError, match=name):
            PagedKVCache(**kwargs)
    with pytest.raises(ValueError, match="seq"):
        cache.prefill(np.float64(s), torch.zeros(1, 1, 3), torch.zeros(1, 1, 3))
    cache.free(np.int64(s))


def _named_argument_cases():
    k, v = torch.zeros(1, 1, 3), torch.zeros(1, 1, 3)
    return [
        ("seqs", lambda c: c.append(None, k, v)),
        ("seqs", lambda c: c.append([None], k, v)),
        ("seqs", lambda c: c.append("0", k, v)),
        ("seq", lambda c: c.prefill(None, k, v)),
        ("seq", lambda c: c.free(None)),
        ("seq", lambda c: c.length("0")),
        ("seq", lambda c: c.gather(None)),
        ("seq", lambda c: c.page_ids(1.0)),
        ("k", lambda c: c.prefill(0, None, v)),
        ("v", lambda c: c.prefill(0, k, None)),
        ("k", lambda c: c.append([0], None, v)),
        ("v", lambda c: c.append([0], k, "v")),
        ("k", lambda c: c.allocate(torch.zeros(1, 2, 3), v)),
        ("v", lambda c: c.allocate(k, torch.zeros(1, 1, 3, dtype=torch.int64))),
        ("check_finite", lambda c: c.prefill(0, k, v, check_finite="no")),
        ("check_finite", lambda c: c.append([0], k, v, check_finite=2)),
        ("check_finite", lambda c: c.allocate(check_finite=[])),
    ]


@pytest.mark.parametrize("case", range(len(_named_argument_cases())))
def test_every_bad_argument_is_a_value_error_naming_it(case):
    name, call = _named_argument_cases()[case]
    cache = PagedKVCache(4, 2, 1, 3, max_seqs=2, dtype=torch.float32)
    new_seq(cache, torch.ones(3, 1, 3), torch.ones(3, 1, 3))
    before = cache_state(cache)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call(cache)
    assert_same_state(before, cache_state(cache))


def test_cache_state_helpers_see_every_difference():
    """assert_same_state fails on a change to any piece of state."""
    base = busy_cache()
    changes = [
        lambda c: c.k_pages.view(-1)[7].add_(1),
        lambda c: c.v_pages.view(-1)[-1].add_(1),
        lambda c: c.k_min[3, 0, 0].add_(1),
        lambda c: c.k_std[5, 1, 2].add_(1),
        lambda c: c._m2[0, 0, 0].add_(1),
        lambda c: c._mean32[7, 1, 1].add_(1),
        lambda c: c.block_table[2, 1].add_(1),
        lambda c: c.seq_lens[3].add_(1),
        lambda c: c.k_moments.view(-1)[0].neg_(),  # -0.0 vs 0.0: bits differ
        lambda c: c._free.reverse(),
        lambda c: c._free_slots.append(9),
        lambda c: c._active.__setitem__(3, True),
        lambda c: c._lens.__setitem__(2, 1),
        lambda c: c._pages[2].append(7),
        lambda c: c.k_pages.requires_grad_(True),
    ]
    for i, change in enumerate(changes):
        cache = busy_cache()
        assert_same_state(cache_state(base), cache_state(cache))
        change(cache)
        with pytest.raises(AssertionError):
            assert_same_state(cache_state(base), cache_state(cache))


# ------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_graph_capture_skips_the_default_check(dtype):
    """check_finite=None does not synchronise while a CUDA graph is captured
    (so append can be captured), and the replayed appends equal eager ones."""
    P, H, D, B = 4, 2, 8, 3
    gen = torch.Generator().manual_seed(3)
    k0, v0 = torch.randn(B, 6, H, D, generator=gen), torch.randn(B, 6, H, D, generator=gen)

    def build():
        return PagedKVCache.from_dense(k0.cuda(), v0.cuda(), [6, 3, 4], P, dtype=dtype,
                                       spare_pages=8, max_seqs=B, shuffle=False)

    graphed, slots = build()
    eager, _ = build()
    for cache in (graphed, eager):  # eager warm-up (also of the pinned-memory pool)
        cache.append(slots, k0[:, 0].cuda(), v0[:, 0].cuda())
    k_in = torch.zeros(B, H, D, device="cuda")
    v_in = torch.zeros(B, H, D, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run; the host plan is fixed here
        graphed.append(slots, k_in, v_in)
    k1, v1 = torch.randn(B, H, D, generator=gen), torch.randn(B, H, D, generator=gen)
    k_in.copy_(k1.cuda())
    v_in.copy_(v1.cuda())
    graph.replay()
    eager.append(slots, k1.cuda(), v1.cuda())
    torch.cuda.synchronize()
    assert_same_state(cache_state(graphed), cache_state(eager))
