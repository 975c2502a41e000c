"""Per-token key sketches (entmaxkv.sketch, reference): the bound is safe on
every page, the writes keep the sketches current, and the certified policy
with sketches still equals full-cache attention while reading less."""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entmaxkv import Certified, Full, PagedKVCache, TopK, decode
from entmaxkv.policies import certified_parts, make_policy
from entmaxkv.scoring import page_layout
from entmaxkv.scoring import quest_bounds
from entmaxkv.sketch import (KeySketch, bytes_per_token, encode, fit_basis, page_box_bounds, page_boxes,
                             sketch_bounds)
from entmaxkv.testing import assert_same_state, cache_state
from entmaxkv.write import write_kv

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def structured_keys(gen, n, H, D, *, rank=4, offset=2.0, noise=0.3):
    """Keys near a rank-``rank`` subspace around a common offset (what
    trained models' keys look like), float32 [n, H, D]."""
    basis = torch.randn(H, D, rank, generator=gen)
    coef = torch.randn(n, H, rank, generator=gen) * 3
    return torch.einsum("hdr,nhr->nhd", basis, coef) + noise * torch.randn(n, H, D, generator=gen) + offset


def build(gen, *, H=2, D=32, P=16, lens=(300, 77), dtype=torch.float16, dims=8, kind="structured"):
    cache = PagedKVCache(sum(-(-n // P) for n in lens) + 4, P, H, D, max_seqs=len(lens), dtype=dtype)
    make = {
        "structured": lambda n: structured_keys(gen, n, H, D),
        "iid": lambda n: torch.randn(n, H, D, generator=gen),
        "offset": lambda n: torch.randn(n, H, D, generator=gen) * 0.5 + 40.0,
    }[kind]
    slots = [cache.allocate(make(n), torch.randn(n, H, D, generator=gen)) for n in lens]
    cache.enable_sketches(dims)
    return cache, slots


def page_max_scores(q, cache, slots, scale, slopes):
    """float64 [B, HQ, M]: each page's largest exact score (-inf past the end)."""
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    M = cache.max_pages_per_seq
    out = torch.full((B, HQ, M), float("-inf"), dtype=torch.float64)
    for b, s in enumerate(slots):
        k, _ = cache.gather(s)
        n = k.shape[0]
        kk = k.double().repeat_interleave(HQ // H, dim=1)
        sc = scale * torch.einsum("hd,nhd->hn", q[b].double(), kk)
        if slopes is not None:
            sc = sc + slopes.double()[:, None] * (torch.arange(n) - (n - 1)).double()
        pad = torch.full((HQ, -(-n // P) * P), float("-inf"), dtype=torch.float64)
        pad[:, :n] = sc
        out[b, :, : pad.shape[1] // P] = pad.view(HQ, -1, P).amax(-1)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["structured", "iid", "offset"])
@pytest.mark.parametrize("G,alibi", [(1, False), (2, True), (4, True)])
def test_bound_holds_on_every_page(dtype, kind, G, alibi):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), kind, G)).encode()))
    cache, slots = build(gen, dtype=dtype, kind=kind, P=8, lens=(91, 40, 1))
    HQ, D = cache.kv_heads * G, cache.head_dim
    q = (torch.randn(len(slots), HQ, D, generator=gen) * 3).to(dtype)
    slopes = torch.rand(HQ, generator=gen) * 0.2 if alibi else None
    scale = D ** -0.5
    ids = torch.tensor(slots)
    sb = sketch_bounds(q, cache, ids, scale=scale, slopes=slopes).double()
    pb = page_box_bounds(q, cache, ids, scale=scale, slopes=slopes).double()
    true = page_max_scores(q, cache, slots, scale, slopes)
    valid = torch.isfinite(true)
    assert (sb[valid] >= true[valid]).all()
    # the page summary is the looser bound (equal ones may round apart by an ulp)
    assert (pb[valid] >= sb[valid] - 1e-6 * sb[valid].abs().clamp(min=1)).all()
    assert torch.equal(torch.isinf(sb) & (sb < 0), ~valid)  # -inf exactly past the end
    assert torch.equal(torch.isinf(pb) & (pb < 0), ~valid)


def test_sketch_is_tighter_than_the_box_on_structured_keys():
    gen = torch.Generator().manual_seed(1)
    cache, slots = build(gen)
    q = torch.randn(2, 4, 32, generator=gen) * 2
    ids = torch.tensor(slots)
    sb = sketch_bounds(q, cache, ids, scale=32 ** -0.5)
    qb = quest_bounds(q, cache, ids, scale=32 ** -0.5)
    true = page_max_scores(q, cache, slots, 32 ** -0.5, None)
    valid = torch.isfinite(true)
    assert (sb.double() - true)[valid].mean() < 0.2 * (qb.double() - true)[valid].mean()


def test_adversarial_keys_stay_safe():
    """Codes clamped at +-127 (a key far outside the fitted range), radii
    beyond float16 (+inf bound) and a NaN key (NaN bound)."""
    gen = torch.Generator().manual_seed(2)
    H, D, P = 2, 16, 4
    cache = PagedKVCache(16, P, H, D, max_seqs=1, dtype=torch.float32)
    s = cache.allocate(torch.randn(9, H, D, generator=gen), torch.randn(9, H, D, generator=gen))
    cache.enable_sketches(4)
    far = torch.randn(1, H, D, generator=gen) * 500
    huge = torch.full((1, H, D), 3e5)
    cache.append([s], far, torch.zeros(1, H, D))
    cache.append([s], huge, torch.zeros(1, H, D), check_finite=False)
    assert int(cache.sketch.codes.abs().max()) == 127
    q = torch.randn(1, 2 * H, D, generator=gen)
    ids = torch.tensor([s])
    sb = sketch_bounds(q, cache, ids, scale=0.25)
    true = page_max_scores(q, cache, [s], 0.25, None)
    assert (sb.double()[:, :, :3] >= true[:, :, :3]).all()
    assert torch.isinf(sb[0, :, 2]).all() and (sb[0, :, 2] > 0).all()  # the page holding the huge key
    pb = page_box_bounds(q, cache, ids, scale=0.25)
    assert (pb.double()[:, :, :3] >= true[:, :, :3]).all() and torch.isinf(pb[0, :, 2]).all()
    cache.append([s], torch.full((1, H, D), float("nan")), torch.zeros(1, H, D), check_finite=False)
    assert torch.isnan(sketch_bounds(q, cache, ids, scale=0.25)[0, :, 2]).all()  # same page: NaN wins
    assert torch.isnan(page_box_bounds(q, cache, ids, scale=0.25)[0, :, 2]).all()


def test_every_write_path_keeps_the_sketches_current():
    """append, prefill (into a partly filled page), allocate and the
    slot-mapping write all leave codes and radii equal to encode() of the
    stored keys, on every valid row."""
    gen = torch.Generator().manual_seed(3)
    H, D, P = 2, 16, 4
    cache = PagedKVCache(32, P, H, D, max_seqs=3, dtype=torch.bfloat16)
    a = cache.allocate(torch.randn(6, H, D, generator=gen), torch.randn(6, H, D, generator=gen))
    cache.enable_sketches(3)
    cache.append([a], torch.randn(1, H, D, generator=gen), torch.randn(1, H, D, generator=gen))
    cache.prefill(a, torch.randn(9, H, D, generator=gen), torch.randn(9, H, D, generator=gen))
    b = cache.allocate(torch.randn(5, H, D, generator=gen), torch.randn(5, H, D, generator=gen))
    slots = cache.reserve([a, b], 1)
    mapping = torch.cat([slots.long(), torch.tensor([-1])])  # a padding token, skipped
    write_kv(cache.layer(0), torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen), mapping)
    sk = cache.sketch
    for s in (a, b):
        pages = cache.page_ids(s).long()
        n = cache.length(s)
        k = cache.k_pages[pages].permute(0, 2, 1, 3).reshape(-1, H, D)[:n]
        codes, radii = encode(sk, k)
        got_c = sk.codes[pages].permute(0, 2, 1, 3).reshape(-1, H, 3)[:n]
        got_r = sk.radii[pages].permute(0, 2, 1, 3).reshape(-1, H, 2)[:n]
        assert torch.equal(got_c, codes) and torch.equal(got_r, radii)
        valid = (n - torch.arange(len(pages)) * P).clamp(0, P)
        box, rad = page_boxes(sk.codes[pages], sk.radii[pages], valid)
        assert torch.equal(sk.page_codes[pages], box) and torch.equal(sk.page_radii[pages], rad)
        flat = codes.view(-1, H, 3).to(torch.int16)
        assert torch.equal(sk.page_codes[pages[0], :, 0], flat[:P].amin(0).to(torch.int8))  # min over page 0
    assert {"layer0.sketch.codes", "layer0.sketch.page_radii"} <= set(cache.state_tensors())


def test_failed_write_leaves_the_sketches_unchanged():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(4, 4, 1, 16, max_seqs=1, dtype=torch.float16)
    s = cache.allocate(torch.randn(5, 1, 16, generator=gen), torch.randn(5, 1, 16, generator=gen))
    cache.enable_sketches(2)
    before = cache_state(cache)
    with pytest.raises(ValueError):
        cache.append([s], torch.full((1, 1, 16), float("inf")), torch.zeros(1, 1, 16))
    assert_same_state(cache_state(cache), before)
    assert torch.equal(before["layer0.sketch.radii"], cache.sketch.radii)


@pytest.mark.parametrize("dtype", DTYPES)
def test_certified_with_sketches_equals_full_and_reads_less(dtype):
    gen = torch.Generator().manual_seed(5)
    cache, slots = build(gen, dtype=dtype, lens=(600, 333))
    q = (torch.randn(2, 4, 32, generator=gen) * 2).to(dtype)
    slopes = torch.tensor([0.0, 0.0, 0.2, 0.3])
    kw = dict(alpha=1.5, alibi_slopes=slopes, backend="reference")
    full = decode(q, cache, slots, Full(), **kw)
    pol = Certified(seed=TopK(64), alibi_seed=TopK(16))
    out, st = decode(q, cache, slots, pol, return_stats=True, **kw)
    assert st.certified.all()
    assert torch.allclose(out.float(), full.float(), atol=2e-3 if dtype == torch.float32 else 2e-2)
    plain = dataclasses.replace(cache.layer(0), sketch=None)
    bare = PagedKVCache.__new__(PagedKVCache)
    bare.__dict__.update(cache.__dict__)
    bare._layers, bare.sketch = (plain,), None
    _, st0 = decode(q, bare, slots, pol, return_stats=True, **kw)
    assert st0.certified.all()
    assert st.tokens_read.sum() < 0.8 * st0.tokens_read.sum()
    # token sketches were read only outside the seed, where the page summary did not rule the page out
    ids = torch.tensor(slots)
    lay = page_layout(cache, ids)
    parts = certified_parts(pol, q, cache, ids, lay, cache.kv_heads, alpha=1.5, scale=32 ** -0.5, slopes=slopes)
    assert not (parts.sketched & parts.seed).any()
    assert 0 < int(parts.sketched.sum()) < int((lay.valid[:, None, :] & ~parts.seed).sum())


def test_alibi_seed_only_on_alibi_heads():
    """The smaller seed applies to the KV group whose heads all have slopes."""
    gen = torch.Generator().manual_seed(6)
    cache, slots = build(gen, lens=(700,))
    q = torch.randn(1, 4, 32, generator=gen).half()
    slopes = torch.tensor([0.0, 0.0, 0.5, 0.5])
    big = Certified(seed=TopK(256), dense_above=1.0)
    both = Certified(seed=TopK(256), alibi_seed=TopK(16), dense_above=1.0)
    kw = dict(alpha=1.5, alibi_slopes=slopes, backend="reference", return_stats=True)
    _, st_big = decode(q, cache, slots, big, **kw)
    _, st_both = decode(q, cache, slots, both, **kw)
    assert st_both.certified.all() and st_big.certified.all()
    assert torch.equal(st_both.tokens_read[:, :2], st_big.tokens_read[:, :2])
    assert (st_both.tokens_read[:, 2:] <= st_big.tokens_read[:, 2:]).all()


SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_property_certified_with_sketches_is_exact(data):
    """Random caches, dims, GQA, ALiBi, alpha: certified heads equal Full."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    H = data.draw(st.sampled_from([1, 2]))
    G = data.draw(st.sampled_from([1, 2, 4]))
    D = data.draw(st.sampled_from([16, 24, 32]))
    P = data.draw(st.sampled_from([1, 4, 16]))
    dims = data.draw(st.integers(1, D))
    dtype = data.draw(st.sampled_from(DTYPES))
    kind = data.draw(st.sampled_from(["structured", "iid", "offset"]))
    lens = tuple(data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=3)))
    alpha = data.draw(st.sampled_from([1.25, 1.5, 2.0, 3.0]))
    cache, slots = build(gen, H=H, D=D, P=P, lens=lens, dtype=dtype, dims=dims, kind=kind)
    HQ = H * G
    q = (torch.randn(len(slots), HQ, D, generator=gen) * data.draw(st.sampled_from([0.5, 2.0, 8.0]))).to(dtype)
    slopes = torch.rand(HQ, generator=gen) * 0.5 if data.draw(st.booleans()) else None
    kw = dict(alpha=alpha, alibi_slopes=slopes, backend="reference")
    full = decode(q.double(), cache, slots, Full(), **kw)
    out, st_ = decode(q, cache, slots, Certified(seed=TopK(max(P, 16))), return_stats=True, **kw)
    vmax = max(float(cache.v_pages.abs().max()), 1e-6)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype] * vmax
    err = (out.double() - full).abs().amax(-1)
    assert torch.isfinite(out).all()
    assert st_.certified.all()  # the policy's augmentation always proves its selection
    assert (err <= tol).all()


def test_fit_and_enable_are_checked():
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache(8, 4, 2, 16, max_seqs=1)
    with pytest.raises(ValueError, match="bases"):
        cache.enable_sketches(4)  # nothing stored to fit
    s = cache.allocate(torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen))
    for bad in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="dims"):
            cache.enable_sketches(bad)
    mean, basis, step = fit_basis(torch.randn(50, 2, 16, generator=gen), 4)
    with pytest.raises(ValueError, match="bases"):
        cache.enable_sketches(4, bases=[(mean, basis, step), (mean, basis, step)])  # one layer only
    with pytest.raises(ValueError, match="bases"):
        cache.enable_sketches(3, bases=[(mean, basis, step)])  # dims differ
    with pytest.raises(ValueError, match="basis"):
        cache.enable_sketches(4, bases=[(mean, basis * 2, step)])  # not orthonormal
    with pytest.raises(ValueError, match="step"):
        cache.enable_sketches(4, bases=[(mean, basis, -step)])
    with pytest.raises(ValueError, match="keys"):
        fit_basis(torch.randn(4, 16), 2)
    assert cache.sketch is None
    cache.enable_sketches(4, bases=[(mean, basis, step)])
    assert isinstance(cache.sketch, KeySketch) and cache.layer(0).sketch is cache.sketch
    assert cache.length(s) == 5 and bytes_per_token(8) == 12


def test_policy_fields_are_checked():
    with pytest.raises(ValueError, match="alibi_seed"):
        Certified(alibi_seed=Full())
    with pytest.raises(ValueError, match="alibi_seed_budget"):
        make_policy("certified", alibi_seed_budget=0)
    assert make_policy("certified", budget=512, alibi_seed_budget=128).alibi_seed == TopK(128)
    gen = torch.Generator().manual_seed(8)
    cache = PagedKVCache(8, 16, 1, 16, max_seqs=1)
    s = cache.allocate(torch.randn(20, 1, 16, generator=gen), torch.randn(20, 1, 16, generator=gen))
    with pytest.raises(ValueError, match="alibi_seed.budget"):
        decode(torch.randn(1, 1, 16), cache, [s], Certified(alibi_seed=TopK(8)), alpha=1.5)
