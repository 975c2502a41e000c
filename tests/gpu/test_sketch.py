"""Key sketches on the GPU: the kernels against the reference at long
contexts, and the certified step with sketches against Full.

- the write kernel's codes / radii equal ``sketch.encode`` of the stored
  keys (codes within one step on rare ties, radii never below the
  reference's by more than one float16 step) on 3 dtypes;
- ``kernels.sketch.sketch_bounds`` equals the reference and bounds every
  page's true maximum score;
- Certified (with and without an ALiBi seed) over a cache with sketches is
  certified, keeps the reference's pages and equals Full, eager and inside
  a captured CUDA graph, on structured keys and on i.i.d. keys.

``python -m pytest -m gpu tests/gpu/test_sketch.py`` on the device.
"""
from __future__ import annotations

import pytest
import torch

from entmaxkv import Certified, Full, PagedKVCache, TopK, decode
from entmaxkv import sketch as RS
from entmaxkv.testing import gpu_quick

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N = 16384 if gpu_quick() else 131072


def cache_of(kind, dtype, n=N, B=2, H=4, D=32, P=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "structured":
        basis = torch.randn(H, 4, D, generator=gen)
        k = torch.einsum("bnhr,hrd->bnhd", torch.randn(B, n, H, 4, generator=gen) * 3, basis) + 1.0
        k = k + 0.3 * torch.randn(B, n, H, D, generator=gen)
    else:
        k = torch.randn(B, n, H, D, generator=gen)
    v = torch.randn(B, n, H, D, generator=gen)
    cache, slots = PagedKVCache.from_dense(k.cuda(), v.cuda(), [n, n - 77], P, dtype=dtype, spare_pages=4,
                                           generator=gen, device="cuda")
    cache.enable_sketches(8)
    return cache, slots


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_kernel_matches_reference(dtype):
    from entmaxkv.kernels.sketch import write_sketch

    cache, slots = cache_of("structured", dtype, n=4096)
    sk = cache.sketch
    ref_codes, ref_radii = sk.codes.clone(), sk.radii.clone()  # enable_sketches encodes with the reference
    sk.codes.zero_()
    sk.radii.zero_()
    P = cache.page_size
    mapping = torch.cat([cache.page_ids(s).long()[:, None] * P + torch.arange(P, device="cuda")
                         for s in slots]).flatten()
    write_sketch(cache.layer(0), mapping)
    page, row = mapping // P, mapping % P  # compare the rows written (spare pages stay zero)
    got_c, want_c = sk.codes[page, :, row].int(), ref_codes[page, :, row].int()
    assert (got_c - want_c).abs().max() <= 1
    assert (got_c != want_c).float().mean() < 0.01
    # radii: never below the exact ones for the codes the kernel chose (float64,
    # no allowance), and close to the reference's (one float16 step plus the allowance)
    k = cache.k_pages[page, :, row].double()  # [T, H, D]
    d = k - sk.mean.double()
    z = torch.einsum("thd,hdm->thm", d, sk.basis.double())
    exact_a = (z - got_c.double() * sk.step.double()).norm(dim=-1) + sk.defect.double() * z.norm(dim=-1)
    exact_b = (d - torch.einsum("thm,hdm->thd", z, sk.basis.double())).norm(dim=-1)
    got_r, want_r = sk.radii[page, :, row].double(), ref_radii[page, :, row].double()
    assert (got_r[..., 0] >= exact_a).all() and (got_r[..., 1] >= exact_b).all()
    slack = RS._encode_slack(k.shape[-1], sk.dims) * (k.norm(dim=-1) + sk.mean.double().norm(dim=-1))
    up = torch.nextafter(want_r, torch.full_like(want_r, float("inf")))
    assert ((want_r - got_r).abs() <= (up - want_r) + slack[..., None]).all()


@pytest.mark.parametrize("alibi", [False, True])
def test_bounds_match_reference_and_are_safe(alibi):
    from entmaxkv.kernels.sketch import sketch_bounds

    cache, slots = cache_of("structured", torch.float16)
    ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 32, device="cuda", dtype=torch.float16) * 2
    slopes = torch.linspace(0.0, 0.3, 8, device="cuda") if alibi else None
    ub = sketch_bounds(q, cache, ids, scale=32 ** -0.5, slopes=slopes)
    ref = RS.sketch_bounds(q, cache, ids.long(), scale=32 ** -0.5, slopes=slopes)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ub), fin)
    assert float(((ub - ref)[fin].abs() / ref[fin].abs().clamp(min=1)).max()) < 1e-5
    P = cache.page_size
    for b, s in enumerate(slots):
        k, _ = cache.gather(s)
        n = k.shape[0]
        sc = (32 ** -0.5) * torch.einsum("hd,nhd->hn", q[b].double(), k.double().repeat_interleave(2, 1))
        if slopes is not None:
            sc = sc + slopes.double()[:, None] * (torch.arange(n, device="cuda") - (n - 1)).double()
        pad = torch.full((8, -(-n // P) * P), float("-inf"), dtype=torch.float64, device="cuda")
        pad[:, :n] = sc
        page_max = pad.view(8, -1, P).amax(-1)
        assert (ub[b, :, : page_max.shape[1]].double() >= page_max).all()


@pytest.mark.parametrize("kind", ["structured", "iid"])
def test_certified_with_sketches_equals_full(kind):
    cache, slots = cache_of(kind, torch.float16)
    q = torch.randn(2, 8, 32, device="cuda", dtype=torch.float16) * 2
    slopes = torch.tensor([0.0] * 4 + [0.25] * 4, device="cuda")
    full = decode(q, cache, slots, Full(), alpha=1.5, alibi_slopes=slopes)
    for pol in (Certified(seed=TopK(1024), dense_above=1.0),
                Certified(seed=TopK(1024), alibi_seed=TopK(256), dense_above=1.0)):
        out, st = decode(q, cache, slots, pol, alpha=1.5, alibi_slopes=slopes, return_stats=True)
        _, st_ref = decode(q.float(), cache, slots, pol, alpha=1.5, alibi_slopes=slopes, return_stats=True,
                           backend="reference")
        assert st.certified.all()
        assert torch.allclose(out.float(), full.float(), atol=2e-3)
        assert (st.tokens_read - st_ref.tokens_read).abs().max() <= 4 * cache.page_size  # pages at the cut
        g = torch.cuda.CUDAGraph()
        res = torch.empty_like(out)
        ids = torch.tensor(slots, dtype=torch.int32, device="cuda")  # made before the capture
        decode(q, cache, ids, pol, alpha=1.5, alibi_slopes=slopes, out=res, check_finite=False)  # warm
        with torch.cuda.graph(g):
            decode(q, cache, ids, pol, alpha=1.5, alibi_slopes=slopes, out=res, check_finite=False)
        res.zero_()
        g.replay()
        assert torch.allclose(res.float(), full.float(), atol=2e-3)
