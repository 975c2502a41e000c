"""Key-sketch kernels (entmaxkv.kernels.sketch) against the reference (entmaxkv.sketch).

Every test draws fresh random inputs from its own seed. The properties that
matter beyond agreement with the reference: the written radii are never
below the float64-exact ones (the float32 slack covers the kernel's
rounding), and every page's bound is >= every valid token's score, on
random and adversarial keys.
"""
from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from entmaxkv import sketch as RS  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402
from entmaxkv.kernels import sketch as KS  # noqa: E402
from entmaxkv.kernels.write import write_kv  # noqa: E402
from entmaxkv.testing import DEVICE, alibi  # noqa: E402

# The interpreter evaluates both sides of tl.where (e.g. inf - inf on masked lanes).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

SCALE = 0.37


def _seed(*parts) -> int:
    """A fixed seed per parameter set (reproducible, unlike hash() of a str)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


def _case(lens, H, G, D, P, m, dtype, seed, *, keys=None, fit=None, slopes=False, sketch=None):
    """A cache holding ``lens`` tokens (scattered pages), a sketch under a
    basis fitted to the stored keys (or to ``fit`` [n, H, D]), queries,
    slopes and the slot mapping of every stored token with padding (-1)
    slots in between. The sketch starts zeroed: nothing is encoded yet."""
    gen = torch.Generator().manual_seed(seed)
    B, n = len(lens), max(lens)
    k = torch.randn(B, n, H, D, generator=gen) * 1.5 if keys is None else keys
    v = torch.randn(B, n, H, D, generator=gen)
    cache, rows = PagedKVCache.from_dense(k, v, list(lens), P, dtype=dtype, spare_pages=2, shuffle=True,
                                          generator=gen, device=DEVICE, max_seqs=B + 1)
    if sketch is None:
        stored = torch.cat([k[b, :lens[b]] for b in range(B)]).to(dtype)
        mean, basis, step = RS.fit_basis(stored if fit is None else fit, m)
        sketch = RS.KeySketch.empty(cache.num_pages, P, mean.to(DEVICE), basis.to(DEVICE), step.to(DEVICE))
    kv = dataclasses.replace(cache.layer(0), sketch=sketch)
    bt = cache.block_table.cpu().long()
    slots = [-1]
    for b, r in enumerate(rows):
        slots += [int(bt[r, j // P]) * P + j % P for j in range(lens[b])]
        slots.append(-1 - b)  # any negative slot is padding
    q = (torch.randn(B, H * G, D, generator=gen) * 1.5).to(dtype)
    sl = (alibi(H * G) * (1 + torch.rand(H * G, generator=gen))) if slopes else None
    return SimpleNamespace(
        cache=cache, kv=kv, sk=sketch, ids=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        lens=list(lens), slots=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        q=q.to(DEVICE), slopes=None if sl is None else sl.to(DEVICE), H=H, G=G, D=D, P=P, m=m)


def _valid(c):
    """(pages, rows) int64 of the stored tokens (the mapping without padding)."""
    s = c.slots[c.slots >= 0]
    return s // c.P, s % c.P


def _ref_sketch(c):
    """A copy of the case's sketch with the reference encoding of every stored token."""
    sk = dataclasses.replace(c.sk, codes=torch.zeros_like(c.sk.codes), radii=torch.zeros_like(c.sk.radii),
                             page_codes=torch.zeros_like(c.sk.page_codes),
                             page_radii=torch.zeros_like(c.sk.page_radii))
    pages, rows = _valid(c)
    RS.write_sketch(sk, c.kv.k_pages[pages, :, rows], pages, rows)
    return sk


def _exact_radii(sk, k, codes):
    """float64 radii a safe bound needs for keys k [T, H, D] and codes
    [T, H, m] (no rounding allowance): |z - c step| + defect |z|, |d - Q z|."""
    mu, Q, step = sk.mean.double(), sk.basis.double(), sk.step.double()
    d = k.double() - mu
    z = torch.einsum("thd,hdm->thm", d, Q)
    e_a = (z - codes.double() * step).norm(dim=-1) + sk.defect.double() * z.norm(dim=-1)
    e_b = (d - torch.einsum("thm,hdm->thd", z, Q)).norm(dim=-1)
    return torch.stack((e_a, e_b), -1)


def _max_scores(c, slopes):
    """float64 [B, HQ, M]: each page's largest exact score over its valid
    tokens, scale q.k + slope (j - pos_q) from the stored keys (-inf past the end)."""
    B, HQ = c.q.shape[:2]
    bt = c.cache.block_table.cpu().long()
    M = bt.shape[1]
    kp = c.kv.k_pages.cpu().double()
    sl = torch.zeros(HQ, dtype=torch.float64) if slopes is None else slopes.cpu().double()
    out = torch.full((B, HQ, M), float("-inf"), dtype=torch.float64)
    for b in range(B):
        r, n = int(c.ids[b]), c.lens[b]
        j = torch.arange(n)
        k = kp[bt[r, j // c.P], :, j % c.P]  # [n, H, D]
        kq = k.repeat_interleave(c.G, dim=1)  # [n, HQ, D]
        s = SCALE * torch.einsum("hd,nhd->hn", c.q[b].cpu().double(), kq) + sl[:, None] * (j - (n - 1))
        for i in range(-(-n // c.P)):
            out[b, :, i] = s[:, i * c.P:(i + 1) * c.P].amax(-1)
    return out


def _check_safe(bound, c, slopes):
    """Every page's bound is >= every valid token's score; -inf past the end."""
    best = _max_scores(c, slopes)
    valid = torch.isfinite(best)
    b = bound.cpu().double()
    assert torch.equal(b[~valid], best[~valid]), "pages past the end must be -inf"
    ok = b[valid] >= best[valid]
    assert bool(ok.all()), f"{int((~ok).sum())} unsafe page bounds, worst gap {float((best[valid] - b[valid]).max())}"


def _check_radii(c, ref=None):
    """Kernel codes/radii against the reference encoding and the exact radii."""
    ref = _ref_sketch(c) if ref is None else ref
    pages, rows = _valid(c)
    kc, rc = c.sk.codes[pages, :, rows], ref.codes[pages, :, rows]  # [T, H, m]
    diff = (kc.int() - rc.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    kr, rr = c.sk.radii[pages, :, rows].double(), ref.radii[pages, :, rows].double()  # [T, H, 2]
    k = c.kv.k_pages[pages, :, rows]
    exact = _exact_radii(c.sk, k, kc)
    assert bool((kr >= exact).all()), f"radius below exact by {float((exact - kr).max())}"
    same = (diff == 0).all(-1)[..., None].expand_as(kr)
    finite = torch.isfinite(rr)
    ulp = (torch.nextafter(rr.half(), torch.tensor(float("inf"), dtype=torch.float16, device=rr.device)).double() - rr)
    err = (kr - rr).abs()
    # one float16 step, plus what float32 rounding moves a radius by: the
    # cancellation in z - c step and d - Q z leaves an absolute error of a
    # few D u (|k| + |mu|), a fraction of the reference's slack (a radius
    # near 0 is all rounding)
    D, m = c.D, c.m
    slack = RS._encode_slack(D, m) * (k.double().norm(dim=-1) + c.sk.mean.double().norm(dim=-1))[..., None]
    tol = ulp + slack / 4
    sel = same & finite
    assert bool((err[sel] <= tol[sel]).all()), float((err - tol)[sel].max())

    assert torch.equal(torch.isinf(kr[same]), torch.isinf(rr[same]))


def _close(ub, ref):
    """Kernel bounds against the reference's: the same non-finite values
    (-inf past the end, NaN, +inf) and the finite ones within 1e-5 relative."""
    assert ub.dtype == torch.float32 and ub.shape == ref.shape
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ub), fin) and torch.equal(torch.isnan(ub), torch.isnan(ref))
    nan = torch.isnan(ref)
    assert torch.equal(ub[~fin & ~nan], ref[~fin & ~nan].float())
    if bool(fin.any()):
        assert float(((ub.double() - ref.double())[fin].abs() / ref[fin].double().abs().clamp(min=1.0)).max()) < 1e-5


def _same_half(a, b) -> bool:
    """float16 tensors equal bit for bit, NaN where NaN (whose payload is the backend's)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int16)[~na], b.view(torch.int16)[~nb])


def _check_summaries(c, slots, before):
    """Page summaries after writing ``slots``: on the pages written, the
    reference ``page_boxes`` of the kernel's own token sketches over rows
    0 .. last written row; elsewhere ``before`` (page_codes, page_radii)."""
    s = slots[slots >= 0]
    pages, rows = s // c.P, s % c.P
    touched, inv = torch.unique(pages, return_inverse=True)
    valid = torch.zeros_like(touched).scatter_reduce(0, inv, rows + 1, reduce="amax")
    box, rad = RS.page_boxes(c.sk.codes[touched], c.sk.radii[touched], valid)
    assert torch.equal(c.sk.page_codes[touched], box)
    assert _same_half(c.sk.page_radii[touched], rad)
    other = torch.ones(c.cache.num_pages, dtype=torch.bool, device=DEVICE)
    other[touched] = False
    assert torch.equal(c.sk.page_codes[other], before[0][other])
    assert _same_half(c.sk.page_radii[other], before[1][other])


@pytest.mark.parametrize("dtype,H,D,P,m", [
    (torch.float16, 2, 32, 4, 4), (torch.bfloat16, 1, 16, 16, 1), (torch.float32, 2, 16, 4, 16),
    (torch.float16, 1, 24, 16, 8),
], ids=["f16-d32-m4", "bf16-d16-m1", "f32-d16-m=d", "f16-d24-m8"])
def test_write_matches_reference(dtype, H, D, P, m):
    c = _case([5, 18, 11], H, 1, D, P, m, dtype, seed=_seed(dtype, D, m))
    KS.write_sketch(c.kv, c.slots)
    _check_radii(c)
    # padding and slots outside the mapping are never written: the spare pages stay zero
    touched = torch.zeros(c.cache.num_pages, c.P, dtype=torch.bool, device=DEVICE)
    pages, rows = _valid(c)
    touched[pages, rows] = True
    untouched = ~touched[:, None, :].expand(-1, H, -1)
    assert not bool(c.sk.codes[untouched].any()) and not bool(c.sk.radii[untouched].any())


def test_write_twice_same_bits():
    c = _case([9, 4], 2, 1, 16, 4, 8, torch.bfloat16, seed=7)
    KS.write_sketch(c.kv, c.slots.to(torch.int32))
    codes, radii = c.sk.codes.clone(), c.sk.radii.clone()
    pc, pr = c.sk.page_codes.clone(), c.sk.page_radii.clone()
    KS.write_sketch(c.kv, c.slots)
    assert torch.equal(c.sk.codes, codes)
    assert torch.equal(c.sk.radii.view(torch.int16), radii.view(torch.int16))
    assert torch.equal(c.sk.page_codes, pc) and torch.equal(c.sk.page_radii.view(torch.int16), pr.view(torch.int16))


def test_write_kv_writes_the_sketch():
    """The Triton cache write encodes the keys it stores (same mapping, padding skipped)."""
    c = _case([6, 3], 2, 1, 16, 4, 4, torch.float16, seed=11)
    gen = torch.Generator().manual_seed(12)
    T = c.slots.shape[0]
    k = (torch.randn(T, 2, 16, generator=gen) * 2).to(DEVICE)
    v = torch.randn(T, 2, 16, generator=gen).to(DEVICE)
    write_kv(c.kv, k, v, c.slots)
    pages, rows = _valid(c)
    keep = c.slots >= 0
    assert torch.equal(c.kv.k_pages[pages, :, rows], k[keep].to(torch.float16))
    _check_radii(c)
    codes, radii = c.sk.codes.clone(), c.sk.radii.clone()
    KS.write_sketch(c.kv, c.slots)
    assert torch.equal(c.sk.codes, codes) and torch.equal(c.sk.radii.view(torch.int16), radii.view(torch.int16))


@pytest.mark.parametrize("dtype,G,D,P,m,slopes", [
    (torch.float16, 1, 32, 4, 8, False), (torch.bfloat16, 2, 16, 16, 4, True),
    (torch.float32, 4, 16, 4, 16, True), (torch.float16, 4, 24, 16, 1, False),
], ids=["f16-g1-m8", "bf16-g2-m4-alibi", "f32-g4-m=d-alibi", "f16-g4-d24-m1"])
def test_bounds_match_reference_and_are_safe(dtype, G, D, P, m, slopes):
    c = _case([13, 2, 33, 0], 2, G, D, P, m, dtype, seed=_seed(dtype, G, m), slopes=slopes)
    KS.write_sketch(c.kv, c.slots)
    ub = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    ref = RS.sketch_bounds(c.q, c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes)
    assert ub.dtype == torch.float32 and ub.shape == ref.shape
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ub), fin) and torch.equal(ub[~fin], ref[~fin])
    assert float(((ub - ref)[fin].abs() / ref[fin].abs().clamp(min=1.0)).max()) < 1e-5
    _check_safe(ub, c, c.slopes)
    # float64 queries run as float32 terms, to the same bounds
    ub64 = KS.sketch_bounds(c.q.double(), c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes)
    assert float(((ub64 - ref)[fin].abs() / ref[fin].abs().clamp(min=1.0)).max()) < 1e-5


def _adversarial(kind, seed):
    """A case whose keys stress the float32 radii and the bound (see the ids)."""
    gen = torch.Generator().manual_seed(seed)
    lens, H, G, D, P, m, dtype = [10, 7], 1, 2, 32, 4, 4, torch.float32
    B, n = len(lens), max(lens)
    fit = None
    if kind == "offset":  # a large common offset: |mu| >> the keys' spread
        keys = 300.0 + torch.randn(B, n, H, D, generator=gen) * 0.05
        dtype = torch.float16
    elif kind == "near-basis":  # keys on an m-dim affine subspace: e_b is all rounding
        Q, _ = torch.linalg.qr(torch.randn(D, m, generator=gen, dtype=torch.float64))
        keys = (40.0 + torch.randn(B, n, H, m, generator=gen, dtype=torch.float64) @ Q.T * 5).float()
    elif kind == "clamp":  # keys far outside the fitted range: codes clamp at +-127
        keys = torch.randn(B, n, H, D, generator=gen)
        fit = keys[0, :4].reshape(-1, H, D) * 0.01
        keys[1, 3] *= 200.0
    elif kind == "d128":  # wide heads, large mean, keys far from it
        D, m = 128, 8
        keys = torch.randn(B, n, H, D, generator=gen) * 30 + torch.linspace(-500, 500, D)
        fit = torch.randn(64, H, D, generator=gen) + torch.linspace(-500, 500, D)
        keys[0, 2] = -keys[0, 2]
    else:
        raise AssertionError(kind)
    return _case(lens, H, G, D, P, m, dtype, seed, keys=keys, fit=fit, slopes=True)


@pytest.mark.parametrize("kind", ["offset", "near-basis", "clamp", "d128"])
def test_adversarial_keys_stay_safe(kind):
    c = _adversarial(kind, seed=_seed(kind))
    KS.write_sketch(c.kv, c.slots)
    pages, rows = _valid(c)
    if kind == "clamp":
        assert int(c.sk.codes[pages, :, rows].abs().max()) == RS.CODE_MAX
    _check_radii(c)
    ub = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    _check_safe(ub, c, c.slopes)
    ref = RS.sketch_bounds(c.q, c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ub), fin)
    assert float(((ub - ref)[fin].abs() / ref[fin].abs().clamp(min=1.0)).max()) < 1e-5


def _poke(c, b, j, h, value):
    """Overwrite stored key j of batch row b, KV head h (all of it) with ``value``."""
    r = int(c.ids[b])
    page = int(c.cache.block_table[r, j // c.P])
    c.kv.k_pages[page, h, j % c.P] = value
    return j // c.P


def test_huge_key_gives_inf_bound():
    c = _case([9, 6], 2, 2, 16, 4, 4, torch.float32, seed=21, slopes=True)
    i = _poke(c, 0, 5, 1, 3e6)  # finite in float32, radii far past float16's range
    KS.write_sketch(c.kv, c.slots)
    ref = _ref_sketch(c)
    assert torch.equal(torch.isinf(c.sk.radii), torch.isinf(ref.radii)) and bool(torch.isinf(c.sk.radii).any())
    ub = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    assert bool((ub[0, 2:4, i] == float("inf")).all())  # the query heads of KV head 1
    assert bool(torch.isfinite(ub[0, 0:2, i]).all()) and bool(torch.isfinite(ub[1, :, :2]).all())
    _check_safe(ub, c, c.slopes)


def test_nan_key_gives_nan_bound():
    c = _case([9, 6], 2, 2, 16, 4, 4, torch.float16, seed=22)
    i = _poke(c, 1, 4, 0, 0.5)
    r = int(c.ids[1])
    c.kv.k_pages[int(c.cache.block_table[r, i]), 0, 0, 3] = float("nan")  # token 4 of row 1
    KS.write_sketch(c.kv, c.slots)
    ref = _ref_sketch(c)
    assert torch.equal(torch.isnan(c.sk.radii), torch.isnan(ref.radii)) and int(torch.isnan(c.sk.radii).sum()) == 2
    assert torch.equal(c.sk.codes, ref.codes)  # the NaN key's codes are 0, as the reference's
    ub = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE)
    nan = torch.zeros_like(ub, dtype=torch.bool)
    nan[1, 0:2, i] = True
    assert torch.equal(torch.isnan(ub), nan)
    rb = RS.sketch_bounds(c.q, c.kv, c.ids.long(), scale=SCALE)
    assert torch.equal(torch.isnan(rb), nan)


def test_bad_arguments():
    c = _case([5, 3], 2, 2, 16, 4, 4, torch.float16, seed=31)
    KS.write_sketch(c.kv, c.slots)
    ok = dict(scale=SCALE)
    with pytest.raises(ValueError, match="^q:"):
        KS.sketch_bounds(c.q[:, :3], c.kv, c.ids, **ok)  # heads not a multiple of kv_heads
    with pytest.raises(ValueError, match="^q:"):
        KS.sketch_bounds(c.q[..., :8], c.kv, c.ids, **ok)
    with pytest.raises(ValueError, match="^q:"):
        KS.sketch_bounds(c.q.to(torch.int32), c.kv, c.ids, **ok)
    with pytest.raises(ValueError, match="^q:"):
        KS.sketch_bounds(c.q.to("meta"), c.kv, c.ids, **ok)
    with pytest.raises(ValueError, match="^seq_ids:"):
        KS.sketch_bounds(c.q, c.kv, c.ids.float(), **ok)
    with pytest.raises(ValueError, match="^seq_ids:"):
        KS.sketch_bounds(c.q, c.kv, c.ids[:1], **ok)
    with pytest.raises(ValueError, match="^scale:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, scale=0.0)
    with pytest.raises(ValueError, match="^slopes:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="^cache:.*sketch"):
        KS.sketch_bounds(c.q, c.cache.layer(0), c.ids, **ok)
    with pytest.raises(ValueError, match="^cache:.*position"):
        pos = torch.zeros(c.cache.max_seqs, 2, dtype=torch.int32, device=DEVICE)
        KS.sketch_bounds(c.q, dataclasses.replace(c.kv, positions=pos), c.ids, **ok)
    other = RS.KeySketch.empty(c.cache.num_pages + 1, c.P, c.sk.mean, c.sk.basis, c.sk.step)
    with pytest.raises(ValueError, match="^cache.sketch.codes:"):
        KS.sketch_bounds(c.q, dataclasses.replace(c.kv, sketch=other), c.ids, **ok)
    with pytest.raises(ValueError, match="^kv:.*sketch"):
        KS.write_sketch(c.cache.layer(0), c.slots)
    with pytest.raises(ValueError, match="^slot_mapping:"):
        KS.write_sketch(c.kv, c.slots.float())


def test_bounds_of_a_cache_object():
    """A PagedKVCache with sketches (``enable_sketches``) is taken as it is."""
    c = _case([7, 12], 2, 2, 16, 4, 4, torch.float16, seed=41, slopes=True)
    c.cache.enable_sketches(dims=4)
    ub = KS.sketch_bounds(c.q, c.cache, c.ids, scale=SCALE, slopes=c.slopes)
    ref = RS.sketch_bounds(c.q, c.cache, c.ids.long(), scale=SCALE, slopes=c.slopes)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ub), fin)
    assert float(((ub - ref)[fin].abs() / ref[fin].abs().clamp(min=1.0)).max()) < 1e-5
    _check_safe(ub, c, c.slopes)
    pb = KS.page_box_bounds(c.q, c.cache, c.ids, scale=SCALE, slopes=c.slopes)
    _close(pb, RS.page_box_bounds(c.q, c.cache, c.ids.long(), scale=SCALE, slopes=c.slopes))
    _check_safe(pb, c, c.slopes)


@pytest.mark.parametrize("dtype,G,seed_kind", [(torch.float16, 2, "topk"), (torch.float32, 1, "gaussian")])
def test_certified_with_sketches_matches_reference(dtype, G, seed_kind):
    """The Triton certified policy on a cache with sketches (and an ALiBi
    seed): certified, equal to Full, and it keeps exactly the reference's
    pages (same seeds, same safe bounds up to rounding far from the cut)."""
    from entmaxkv import Certified, Full, Gaussian, TopK, decode

    lens = [70, 33]
    cache, rows, q, slopes = _sketched_pair(_seed(str(dtype), G, seed_kind), G, dtype, lens=lens)
    seed = TopK(16) if seed_kind == "topk" else Gaussian(q_max=0.9)
    pol = Certified(seed=seed, alibi_seed=TopK(8), dense_above=1.0)
    kw = dict(alpha=1.5, alibi_slopes=slopes, return_stats=True)
    out, st = decode(q, cache, rows, pol, backend="triton", **kw)
    ref, st_ref = decode(q, cache, rows, pol, backend="reference", **kw)
    full = decode(q, cache, rows, Full(), backend="reference", alpha=1.5, alibi_slopes=slopes)
    assert st.certified.all() and st_ref.certified.all()
    assert torch.equal(st.tokens_read, st_ref.tokens_read)
    assert (st.tokens_read < torch.tensor(lens, device=DEVICE)[:, None]).any()  # the sketches left pages out
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), full.float(), atol=tol) and torch.allclose(ref.float(), full.float(), atol=tol)


def _sketched_pair(seed, G, dtype=torch.float16, lens=(70, 33), H=2, D=16, P=4):
    """A sketched cache from dense keys of low rank plus an offset, its
    rows, queries [len(lens), H * G, D] and ALiBi slopes on the heads of KV
    heads 1 .. H - 1 only."""
    gen = torch.Generator().manual_seed(seed)
    T = max(lens)
    basis = torch.randn(H, 3, D, generator=gen)
    keys = torch.einsum("bnhr,hrd->bnhd", torch.randn(len(lens), T, H, 3, generator=gen) * 2, basis) + 1.0
    vals = torch.randn(len(lens), T, H, D, generator=gen)
    cache, rows = PagedKVCache.from_dense(keys, vals, list(lens), P, dtype=dtype, spare_pages=2, generator=gen,
                                          device=DEVICE)
    cache.enable_sketches(dims=4)
    q = (torch.randn(len(lens), H * G, D, generator=gen) * 2).to(dtype).to(DEVICE)
    slopes = torch.tensor([0.0] * G + [0.4] * (H - 1) * G, device=DEVICE)
    return cache, rows, q, slopes


@pytest.mark.parametrize("case", ["per_query_head_seed", "sinks_window", "chain", "per_query_head", "no_alibi"])
def test_certified_sketch_seed_tables(case, launches):
    """The seeds' top-k key tables written by the summary-bound launch
    (one per seed, per KV head or per query head, each with its own forced
    pages) and selected by the row or the chunked chain give the
    reference's pages, certified and equal to Full."""
    from entmaxkv import Certified, Full, TopK, decode
    from entmaxkv.kernels.config import KernelConfig, TopKConfig

    cache, rows, q, slopes = _sketched_pair(_seed(case, 2, "torch.float16"), 2)
    config = KernelConfig(topk=TopKConfig(rowsel_min_pages=1))  # the row selection at any size
    seed, alibi_seed, per = TopK(16), TopK(8), False
    if case == "per_query_head_seed":
        seed, alibi_seed = TopK(16, per_query_head=True), TopK(8, per_query_head=True)
    elif case == "sinks_window":
        seed, alibi_seed = TopK(16, sinks=1, window=2), TopK(8, window=1)
    elif case == "chain":  # the lb / chunk / merge launches instead of the row selection
        config = KernelConfig(topk=TopKConfig(rowsel=False))
    elif case == "per_query_head":
        per = True
    pol = Certified(seed=seed, alibi_seed=None if case == "no_alibi" else alibi_seed, per_query_head=per,
                    dense_above=1.0)
    kw = dict(alpha=1.5, alibi_slopes=slopes, return_stats=True)
    out, st = decode(q, cache, rows, pol, backend="triton", kernel_config=config, **kw)
    ran = launches.names()
    # the seeds come from the summary launch's key tables: no Quest keys pass, no per-call query terms in torch
    assert "_sketch_box_kernel" in ran and "_topk_keys_kernel" not in ran and "_sketch_terms_kernel" in ran
    assert ("_topk_chunk_kernel" in ran) == (case == "chain") and ("_topk_rowsel_kernel" in ran) == (case != "chain")
    ref, st_ref = decode(q, cache, rows, pol, backend="reference", **kw)
    full = decode(q, cache, rows, Full(), backend="reference", alpha=1.5, alibi_slopes=slopes)
    assert st.certified.all() and st_ref.certified.all()
    assert torch.equal(st.tokens_read, st_ref.tokens_read)
    assert (st.tokens_read < torch.tensor([70, 33], device=DEVICE)[:, None]).any()
    assert torch.allclose(out.float(), full.float(), atol=2e-2) and torch.allclose(ref.float(), full.float(), atol=2e-2)


@pytest.mark.parametrize("dtype,G,D,m", [(torch.float16, 1, 16, 4), (torch.bfloat16, 3, 24, 5),
                                          (torch.float32, 4, 7, 7)])
def test_sketch_terms_match_reference(dtype, G, D, m):
    """The one-launch query terms equal ``sketch.query_terms`` (float64 in
    both: the float32 results agree to an ulp; the norms are rounded up)."""
    gen = torch.Generator().manual_seed(_seed("terms", str(dtype), G, D, m))
    H = 2
    keys = torch.randn(3, 40, H, D, generator=gen)
    cache, _ = PagedKVCache.from_dense(keys, torch.randn_like(keys), [40, 21, 9], 8, dtype=dtype, generator=gen,
                                       device=DEVICE)
    cache.enable_sketches(dims=m)
    q = (torch.randn(5, H * G, D + 3, generator=gen) * 3)[..., :D].to(dtype).to(DEVICE)  # strided rows
    got = KS.sketch_terms(q, cache.sketch, H)
    want = RS.query_terms(q, cache.sketch, H)
    assert got.shape == want.shape == (5, H * G, m + 4) and got.dtype == torch.float32
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=1e-30)
    assert bool(((got - want).abs() <= 2 * ulp + 1e-30).all()), float((got - want).abs().max())
    assert bool((got[..., m + 1:] >= want[..., m + 1:] - ulp[..., m + 1:]).all())  # still rounded up
    worse = want.clone()
    worse[0, 0, 0] += 1e-3 * (1 + worse[0, 0, 0].abs())
    assert not bool(((got - worse).abs() <= 2 * ulp + 1e-30).all())  # the comparison can fail


@pytest.mark.parametrize("per", [False, True])
def test_need_bounds_marks_what_the_reference_marks(per):
    """need_bounds = sketch_bounds over the pages the certified policy
    marks: valid, outside the seed, base bound clearing tau for some head
    of the mask row."""
    cache, rows, q, slopes = _sketched_pair(_seed("need", 2, "torch.float16"), 2, lens=(70, 41))
    ids = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    B, HQ = q.shape[:2]
    H = cache.kv_heads
    S = HQ if per else H
    M = cache.block_table.shape[1]
    gen = torch.Generator().manual_seed(_seed("need-mask", per))
    base = KS.page_box_bounds(q, cache, ids, scale=SCALE, slopes=slopes)
    seed = (torch.rand(B, S, M, generator=gen) < 0.3).to(torch.uint8).to(DEVICE)
    fin = torch.where(torch.isfinite(base), base, torch.zeros_like(base))
    tau = (0.5 * fin.amax(-1) + 0.5 * fin.mean(-1)) * 0.5  # some pages clear it, some do not
    got = KS.need_bounds(q, cache, ids, scale=SCALE, slopes=slopes, base=base, seed=seed, tau=tau, alpha=1.5,
                         terms=KS.sketch_terms(q, cache.sketch, H))
    clears = (0.5 * base > tau[..., None]).view(B, S, HQ // S, M).any(2)
    npages = (cache.seq_lens.index_select(0, ids.long()).long() + cache.page_size - 1) // cache.page_size
    valid = torch.arange(M, device=DEVICE)[None, :] < npages[:, None]
    need = clears & (seed == 0) & valid[:, None, :]
    want = KS.sketch_bounds(q, cache, ids, scale=SCALE, slopes=slopes, pages=need, base=base)
    assert bool(need.any()) and bool((~need & valid[:, None, :]).any())
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


# ---------------------------------------------------------------------------
# page summaries: written with the token sketches, bounded by page_box_bounds
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,H,P,m,nan", [
    (torch.float16, 2, 4, 4, False), (torch.bfloat16, 1, 16, 8, True), (torch.float32, 2, 4, 16, True),
], ids=["f16-p4-m4", "bf16-p16-m8-nan", "f32-p4-m16-nan"])
def test_page_summaries_match_reference(dtype, H, P, m, nan):
    """Written in chunks cut mid-page (a prefill, then small steps), with
    padding between sequences: every write refreshes the pages it touches
    from rows 0 .. its last row, bit for bit as ``sketch.page_boxes``, over
    stale summaries (a page's earlier owner), leaving the other pages alone."""
    c = _case([5, 18, 11, 0], H, 1, 16, P, m, dtype, seed=_seed("summary", dtype, P, m))
    if nan:
        i = _poke(c, 1, 6, 0, 0.5)
        c.kv.k_pages[int(c.cache.block_table[int(c.ids[1]), i]), 0, 6 % P, 2] = float("nan")
    c.sk.page_codes.fill_(55)
    c.sk.page_radii.fill_(7.0)
    start = (c.sk.page_codes.clone(), c.sk.page_radii.clone())
    T = c.slots.shape[0]
    cuts = [0, 4, 9, 10, 11, 23, T]
    for a, b in zip(cuts, cuts[1:]):
        before = (c.sk.page_codes.clone(), c.sk.page_radii.clone())
        KS.write_sketch(c.kv, c.slots[a:b])
        _check_summaries(c, c.slots[a:b], before)
    _check_summaries(c, c.slots, start)  # each page ends summarised over all its valid rows
    if nan:
        page = int(c.cache.block_table[int(c.ids[1]), i])
        assert bool(torch.isnan(c.sk.page_radii[page, 0]).all())
        assert int(torch.isnan(c.sk.page_radii).sum()) == 2
    # one write of the whole mapping gives the same bits
    pc, pr = c.sk.page_codes.clone(), c.sk.page_radii.clone()
    KS.write_sketch(c.kv, c.slots)
    assert torch.equal(c.sk.page_codes, pc) and torch.equal(c.sk.page_radii.view(torch.int16), pr.view(torch.int16))


@pytest.mark.parametrize("dtype,G,D,P,m,slopes", [
    (torch.float16, 1, 32, 4, 8, False), (torch.bfloat16, 2, 16, 16, 4, True),
    (torch.float32, 4, 16, 4, 16, True), (torch.float16, 4, 24, 16, 1, False),
], ids=["f16-g1-m8", "bf16-g2-m4-alibi", "f32-g4-m=d-alibi", "f16-g4-d24-m1"])
def test_box_bounds_match_reference_and_are_safe(dtype, G, D, P, m, slopes):
    c = _case([13, 2, 33, 0], 2, G, D, P, m, dtype, seed=_seed("box", dtype, G, m), slopes=slopes)
    KS.write_sketch(c.kv, c.slots)
    pb = KS.page_box_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    ref = RS.page_box_bounds(c.q, c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes)
    _close(pb, ref)
    _check_safe(pb, c, c.slopes)
    # the box holds every token's codes and radii: never below the token-sketch
    # bound, but for rounding where the two are the same number (a one-token
    # page; the GPU may contract the two kernels' products differently)
    tb = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    fin = torch.isfinite(tb)
    assert torch.equal(torch.isfinite(pb), fin)
    assert bool((pb[fin] >= tb[fin] - 1e-6 * tb[fin].abs().clamp(min=1.0)).all())
    assert bool((pb[fin] > tb[fin]).any())  # and looser somewhere
    # float64 queries run as float32 terms, to the same bounds
    _close(KS.page_box_bounds(c.q.double(), c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes), ref)


@pytest.mark.parametrize("per", ["kv_heads", "q_heads"])
def test_bounds_on_marked_pages(per):
    """sketch_bounds(pages=, base=) is torch.where(mark, min(base, bound),
    base); a page its group leaves unmarked is not bounded from its token
    sketches even when they would change the answer (NaN radii)."""
    c = _case([13, 2, 33, 0], 2, 2, 16, 4, 4, torch.float16, seed=_seed("marked", per), slopes=True)
    i = _poke(c, 0, 5, 0, 0.5)
    c.kv.k_pages[int(c.cache.block_table[int(c.ids[0]), i]), 0, 1, 3] = float("nan")  # a NaN token bound
    KS.write_sketch(c.kv, c.slots)
    full = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    box = KS.page_box_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    B, HQ, M = full.shape
    H, G = c.H, c.G
    S = H if per == "kv_heads" else HQ
    gen = torch.Generator().manual_seed(_seed("mask", per))
    mark = (torch.rand(B, S, M, generator=gen) < 0.4).to(DEVICE)
    mark[0, 0, i] = True  # the NaN wins over base there, as in torch.minimum
    base = box - 2.0 * torch.rand(B, HQ, M, generator=gen).to(DEVICE)  # below the token bound at times
    each = mark.repeat_interleave(HQ // S, dim=1)  # [B, HQ, M]
    fin = torch.isfinite(full)
    base[(each & fin).nonzero()[0].unbind()] = float("nan")  # and so does a NaN of base
    base[(~each & fin).nonzero()[0].unbind()] = float("nan")
    want = torch.where(each, torch.minimum(base, full), base)
    assert bool((each & (base < full)).any()) and bool((each & (base > full) & torch.isfinite(full)).any())
    # all marked, base = +inf: the plain bound
    inf = torch.full_like(base, float("inf"))
    ones = torch.ones(B, S, M, dtype=torch.bool, device=DEVICE)
    torch.testing.assert_close(KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes, pages=ones, base=inf),
                               full, rtol=0, atol=0, equal_nan=True)

    sel = mark if per == "kv_heads" else mark.to(torch.uint8)
    got = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes, pages=sel, base=base)
    assert bool(torch.isnan(want[0, 0, i])) and int(torch.isnan(want).sum()) >= 3
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # NaN radii on every page no head of its group marks: the answer there stays base
    group = each.view(B, H, G, M).any(2)  # [B, H, M]
    bt = c.cache.block_table.long()
    for b in range(B):
        for h in range(H):
            for j in range(-(-c.lens[b] // c.P)):
                if not bool(group[b, h, j]):
                    c.sk.radii[int(bt[int(c.ids[b]), j]), h] = float("nan")
    again = KS.sketch_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes, pages=sel, base=base)
    torch.testing.assert_close(again, want, rtol=0, atol=0, equal_nan=True)


def test_box_bounds_of_nan_and_huge_keys():
    """A NaN key makes its page's box bound NaN, a radius past float16 +inf, as the reference."""
    c = _case([9, 6], 2, 2, 16, 4, 4, torch.float32, seed=23, slopes=True)
    i = _poke(c, 1, 4, 0, 0.5)
    c.kv.k_pages[int(c.cache.block_table[int(c.ids[1]), i]), 0, 0, 3] = float("nan")
    j = _poke(c, 0, 5, 1, 3e6)
    KS.write_sketch(c.kv, c.slots)
    pb = KS.page_box_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=c.slopes)
    ref = RS.page_box_bounds(c.q, c.kv, c.ids.long(), scale=SCALE, slopes=c.slopes)
    _close(pb, ref)
    nan = torch.zeros_like(pb, dtype=torch.bool)
    nan[1, 0:2, i] = True
    assert torch.equal(torch.isnan(pb), nan)
    assert bool((pb[0, 2:4, j] == float("inf")).all())


def test_box_bounds_bad_arguments():
    c = _case([5, 3], 2, 2, 16, 4, 4, torch.float16, seed=32)
    KS.write_sketch(c.kv, c.slots)
    ok = dict(scale=SCALE)
    with pytest.raises(ValueError, match="^q:"):
        KS.page_box_bounds(c.q[:, :3], c.kv, c.ids, **ok)
    with pytest.raises(ValueError, match="^seq_ids:"):
        KS.page_box_bounds(c.q, c.kv, c.ids[:1], **ok)
    with pytest.raises(ValueError, match="^scale:"):
        KS.page_box_bounds(c.q, c.kv, c.ids, scale=-1.0)
    with pytest.raises(ValueError, match="^slopes:"):
        KS.page_box_bounds(c.q, c.kv, c.ids, scale=SCALE, slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="^cache:.*sketch"):
        KS.page_box_bounds(c.q, c.cache.layer(0), c.ids, **ok)
    with pytest.raises(ValueError, match="^cache:.*position"):
        pos = torch.zeros(c.cache.max_seqs, 2, dtype=torch.int32, device=DEVICE)
        KS.page_box_bounds(c.q, dataclasses.replace(c.kv, positions=pos), c.ids, **ok)
    bad = dataclasses.replace(c.sk, page_codes=c.sk.page_codes[:, :, :1])
    with pytest.raises(ValueError, match="^cache.sketch.page_codes:"):
        KS.page_box_bounds(c.q, dataclasses.replace(c.kv, sketch=bad), c.ids, **ok)
    bad = dataclasses.replace(c.sk, page_radii=c.sk.page_radii.float())
    with pytest.raises(ValueError, match="^cache.sketch.page_radii:"):
        KS.page_box_bounds(c.q, dataclasses.replace(c.kv, sketch=bad), c.ids, **ok)
    # the page mask of sketch_bounds
    B, HQ, M = c.q.shape[0], c.q.shape[1], c.cache.block_table.shape[1]
    mark = torch.ones(B, 2, M, dtype=torch.bool, device=DEVICE)
    base = torch.zeros(B, HQ, M, device=DEVICE)
    with pytest.raises(ValueError, match="^base:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=mark, **ok)  # base is required with pages
    with pytest.raises(ValueError, match="^base:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, base=base, **ok)  # and only taken with them
    with pytest.raises(ValueError, match="^base:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=mark, base=base.half(), **ok)
    with pytest.raises(ValueError, match="^base:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=mark, base=base[:, :, :1], **ok)
    with pytest.raises(ValueError, match="^pages:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=mark.float(), base=base, **ok)
    with pytest.raises(ValueError, match="^pages:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=torch.ones(B, 3, M, dtype=torch.bool, device=DEVICE), base=base,
                         **ok)  # S neither kv_heads nor q_heads
    with pytest.raises(ValueError, match="^pages:"):
        KS.sketch_bounds(c.q, c.kv, c.ids, pages=mark[:, :, :1], base=base, **ok)
