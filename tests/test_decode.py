"""decode() through pages equals dense attention over the gathered cache."""
from __future__ import annotations

import math

import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, TopK, decode, dense_attention
from entmaxkv.testing import alibi, random_cache, rel_err

ALPHAS = [1.0, 1.5, 2.0, 1.25]


def dense_reference(q, k, v, lens, alpha, slopes=None, scale=None):
    """Per row: attention over the first lens[b] tokens of the contiguous cache."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return torch.stack([
        dense_attention(q[b].double(), k[b], v[b], alpha=alpha, scale=scale, slopes=slopes, length=n)[0]
        for b, n in enumerate(lens)
    ])


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 6])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_full_policy_matches_dense(page_size, group, alpha):
    """Random block tables (shuffled pages, spare pages), odd lengths, GQA."""
    seed = page_size * 100 + group * 10 + int(alpha * 4)
    lens = [1, 37, 130, 2 * page_size + 3]
    H, D = 2, 24
    cache, slots, k, v = random_cache(lens, H, D, page_size, seed=seed)
    q = torch.randn(len(lens), H * group, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = decode(q, cache, slots, Full(), alpha=alpha)
    ref = dense_reference(q, k, v, lens, alpha)
    assert out.dtype == torch.float64
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_low_precision_storage(dtype, alpha):
    lens = [50, 113]
    cache, slots, k, v = random_cache(lens, 2, 32, 8, dtype=dtype, seed=3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = decode(q, cache, slots, Full(), alpha=alpha)
    assert out.dtype == dtype
    ref = dense_reference(q.double(), k, v, lens, alpha)
    # fp32 math over stored values; only the output rounding is low precision.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_alibi_and_scale(alpha):
    lens = [77, 40]
    HQ = 6
    cache, slots, k, v = random_cache(lens, 3, 16, 8, seed=5)
    q = torch.randn(2, HQ, 16, dtype=torch.float64)
    slopes = alibi(HQ)
    out = decode(q, cache, slots, Full(), alpha=alpha, alibi_slopes=slopes, scale=0.3)
    ref = dense_reference(q, k, v, lens, alpha, slopes=slopes, scale=0.3)
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("policy", [
    TopK(64), TopK(32, sinks=1, window=2), Gaussian(), Gaussian(pooled=True, margin=0.1),
    Certified(), Certified(seed=Gaussian()), TopK(48, per_query_head=True), Certified(per_query_head=True),
])
def test_every_policy_runs_and_out_param(policy):
    lens = [200, 91]
    cache, slots, _, _ = random_cache(lens, 2, 16, 8, seed=7)
    q = torch.randn(2, 4, 16)
    out = torch.full((2, 4, 16), float("nan"))
    res, stats = decode(q, cache, slots, policy, alpha=1.5, out=out, return_stats=True)
    assert res is out
    assert torch.isfinite(out).all()
    for t in (stats.pages_read, stats.tokens_read, stats.coverage, stats.tau, stats.certified):
        assert t.shape == (2, 4)
    assert (stats.coverage > 0).all() and (stats.coverage <= 1).all()
    n_pages = torch.tensor([-(-n // 8) for n in lens])[:, None]
    assert (stats.pages_read <= n_pages).all()


def test_certified_output_equals_full_in_float64():
    """Certified selection gives the full-cache result to rounding, always."""
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        lens = [int(torch.randint(20, 400, (1,), generator=gen)) for _ in range(3)]
        cache, slots, k, v = random_cache(lens, 2, 16, 8, seed=seed, key_scale=2.0)
        q = torch.randn(3, 6, 16, generator=gen, dtype=torch.float64) * 2
        slopes = alibi(6) if seed % 2 else None
        for alpha in (1.5, 2.0, 1.25, 3.0):
            pol = Certified(seed=TopK(16))
            out, stats = decode(q, cache, slots, pol, alpha=alpha, alibi_slopes=slopes, return_stats=True)
            ref = dense_reference(q, k, v, lens, alpha, slopes=slopes)
            assert rel_err(out, ref) <= 1e-6, (seed, alpha)
            assert bool(stats.certified.all())


def test_selection_with_support_is_exact_and_certified():
    """Whenever the kept set contains the true support, R <= 1e-6 and the
    certificate says so; when it misses support, the certificate is False."""
    torch.manual_seed(0)
    lens = [300]
    cache, slots, k, v = random_cache(lens, 1, 8, 4, seed=11)
    hits = misses = 0
    for trial in range(40):
        q = torch.randn(1, 1, 8, dtype=torch.float64) * 3
        ref_out, p = dense_attention(q[0], k[0], v[0], alpha=1.5, scale=8 ** -0.5, length=300)
        out, stats = decode(q, cache, slots, TopK(16 * (1 + trial % 4)), alpha=1.5, return_stats=True)
        support_pages = set((p[0] > 0).nonzero().flatten().div(4, rounding_mode="floor").tolist())
        from entmaxkv.backend import REFERENCE
        from entmaxkv.step import run_step
        sel, _, _, _ = run_step(REFERENCE, TopK(16 * (1 + trial % 4)), q, cache,
                                torch.tensor(slots, dtype=torch.int32), 1.5, 8 ** -0.5, None)
        kept = set(sel.pages[0, 0, : int(sel.counts[0, 0])].tolist())
        if support_pages <= kept:
            hits += 1
            assert rel_err(out[0], ref_out) <= 1e-6
        else:
            misses += 1
            assert not bool(stats.certified[0, 0])
    assert hits > 0 and misses > 0


def test_sequence_of_one_token():
    cache, slots, k, v = random_cache([1, 1], 1, 4, 16, seed=2)
    q = torch.randn(2, 2, 4)
    for alpha in (1.0, 1.5):
        out = decode(q, cache, slots, TopK(16), alpha=alpha)
        # one token: the output is its value exactly
        assert rel_err(out, v[:, 0, 0][:, None, :].expand(2, 2, 4)) < 1e-6
