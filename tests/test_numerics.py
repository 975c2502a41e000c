"""The numeric range of docs/limits.md, checked against float64 (or mpmath) truths.

One test per failure of the numerics part of issue 37 (the reference path):
alpha next to 1, huge scores in decode, large alpha in float32, exact ties at
large alpha, rows whose (alpha-1) x overflows float32, the alpha range and the
ALiBi position limit.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, TopK, decode
from entmaxkv.cache import PagedKVCache
from entmaxkv.entmax import entmax, entmax_threshold
from entmaxkv.limits import ALPHA_MAX, POSITION_MAX, SOFTMAX_BELOW, check_alpha, effective_alpha
from entmaxkv.policies import check_policy
from entmaxkv.testing import random_cache


def _bisect_entmax64(x: torch.Tensor, alpha: float, iters: int = 200) -> torch.Tensor:
    """Independent truth: float64 bisection on tau in shifted coordinates, last dim.

    Solves sum_i [(alpha-1)(x_i - max) - t]_+^(1/(alpha-1)) = 1 for t in
    [-1, 0] by halving (no Newton, no log-threshold), then builds p.
    """
    x = x.double()
    g = alpha - 1.0
    d = (x - x.amax(-1, keepdim=True)) * g
    lo = torch.full(x.shape[:-1] + (1,), -1.0, dtype=torch.float64)
    hi = torch.zeros_like(lo)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        mass = (d - mid).clamp_min(0).pow(1.0 / g).sum(-1, keepdim=True)
        lo = torch.where(mass > 1, mid, lo)
        hi = torch.where(mass > 1, hi, mid)
    return (d - 0.5 * (lo + hi)).clamp_min(0).pow(1.0 / g)


def _mp_entmax(row, alpha: float, dps: int = 50):
    """mpmath truth for one row (list of floats): bisection on tau at ``dps`` digits."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(dps):
        g = mpmath.mpf(alpha) - 1
        xs = [mpmath.mpf(float(v)) for v in row]
        top = max(xs)
        d = [g * (v - top) for v in xs]
        lo, hi = mpmath.mpf(-1), mpmath.mpf(0)
        for _ in range(4 * dps):
            mid = (lo + hi) / 2
            mass = mpmath.fsum(mpmath.power(v - mid, 1 / g) for v in d if v > mid)
            lo, hi = (mid, hi) if mass > 1 else (lo, mid)
        t = (lo + hi) / 2
        return [float(mpmath.power(v - t, 1 / g)) if v > t else 0.0 for v in d]


def _softmax_attention64(q, k, v, scale):
    """float64 softmax attention of one row: q [HQ, D], k/v [n, H, D]."""
    HQ, H = q.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(HQ // H, dim=1)
    vv = v.double().repeat_interleave(HQ // H, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), kk) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)


# ---------------------------------------------------------------- alpha next to 1


def test_alpha_next_to_one_decode_is_an_average():
    """alpha = 1 + 1e-12 runs as softmax: the output is an average of V, not their sum."""
    cache, slots, k, v = random_cache([300], 2, 8, 16, seed=3)
    q = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(4))
    out = decode(q, cache, slots, Full(), alpha=1.0 + 1e-12)
    ref = _softmax_attention64(q[0], k[0], v[0], 8 ** -0.5)
    assert (out[0].double() - ref).abs().max().item() <= 1e-5
    assert effective_alpha(1.0 + 1e-12) == 1.0


@pytest.mark.parametrize("gap", [1e-8, 1e-6, 1e-4, 2.0 * SOFTMAX_BELOW])
def test_alpha_next_to_one_float32_sums_to_one(gap):
    """alpha - 1 ~ 1e-8 in float32: p sums to 1 and matches softmax (its limit)."""
    x = torch.randn(8, 5000, generator=torch.Generator().manual_seed(1)) * 3
    p = entmax(x, 1.0 + gap).double()
    assert (p.sum(-1) - 1).abs().max().item() <= 1e-5
    ref = torch.softmax(x.double(), -1)  # entmax - softmax = O(gap x^2)
    assert (p - ref).abs().max().item() <= 1e-6 + 50 * gap


# ---------------------------------------------------------------- huge scores in decode


@pytest.mark.parametrize("alpha", [1.5, 1.25, 2.0])
def test_huge_scores_decode_matches_entmax(alpha):
    """q x 1e8 (|scores| ~ 4e7): decode equals entmax() on the same scores."""
    cache, slots, k, v = random_cache([200], 1, 8, 16, seed=5)
    q = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(6)) * 1e8
    out = decode(q, cache, slots, Full(), alpha=alpha, check_finite=True)
    s = torch.einsum("hd,nd->hn", q[0], k[0, :, 0]) * 8 ** -0.5
    assert s.abs().max().item() > 1e7
    ref = entmax(s, alpha) @ v[0, :, 0]
    assert (out[0] - ref).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- large alpha in float32


def test_alpha_max_float32_matches_mpmath_truth():
    """alpha = 4 in float32 matches a 50-digit truth to float32 tolerance."""
    x = torch.randn(3, 400, generator=torch.Generator().manual_seed(7)) * 4
    p = entmax(x, ALPHA_MAX).double()
    for r in range(x.shape[0]):
        truth = torch.tensor(_mp_entmax(x[r].tolist(), ALPHA_MAX), dtype=torch.float64)
        assert (p[r] - truth).abs().max().item() <= 1e-6


@pytest.mark.parametrize("alpha", [2.5, 3.0, ALPHA_MAX])
def test_large_alpha_float32_matches_float64_bisection(alpha):
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(8)) * 10
    p = entmax(x, alpha).double()
    truth = _bisect_entmax64(x, alpha)
    assert (p - truth).abs().max().item() <= 1e-6


def test_two_float32_solves_agree():
    """A certified top-k and Full (two solves over different kept sets) agree at alpha = 4."""
    cache, slots, _, _ = random_cache([1024], 1, 16, 16, seed=9, key_scale=3.0)
    q = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(10)) * 3
    full = decode(q, cache, slots, Full(), alpha=ALPHA_MAX)
    cert, stats = decode(q, cache, slots, Certified(seed=TopK(64)), alpha=ALPHA_MAX, return_stats=True)
    assert bool(stats.certified.all())
    assert (cert - full).abs().max().item() <= 1e-6


# ---------------------------------------------------------------- ties, overflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_ties_at_large_alpha_sum_to_one(dtype):
    """alpha = 4, 1e5 identical scores: every p = 1/n, summing to 1 (not to n)."""
    n = 100_000
    x = torch.full((2, n), 0.75, dtype=dtype)
    p = entmax(x, ALPHA_MAX).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (p.sum(-1) - 1).abs().max().item() <= tol
    assert (p / (1.0 / n) - 1).abs().max().item() <= tol


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0, ALPHA_MAX])
def test_huge_finite_rows_are_not_zeros(alpha):
    """|(alpha-1) x| > float32 max with finite x: the shift comes first, p sums to 1."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, big * 0.999999, 0.5 * big, -big]], dtype=torch.float32)
    p = entmax(x, alpha).double()
    assert torch.isfinite(p).all()
    assert abs(p.sum().item() - 1) <= 1e-5
    # The two top entries differ by 1e-6 big ~ 3e32 >> 1: only the max is kept.
    assert p[0, 0].item() == 1.0
    tau, support = entmax_threshold(x, alpha)
    assert support.item() == 1


# ---------------------------------------------------------------- the alpha range


@pytest.mark.parametrize("bad", [0.999, 4.0001, 5.0, 8.0, 20.0, math.inf, math.nan, True, "2", np.bool_(False)])
def test_alpha_outside_the_range_raises(bad):
    x = torch.randn(2, 5)
    for call in (
        lambda: entmax(x, bad),
        lambda: entmax_threshold(x, bad),
        lambda: check_alpha(bad),
        lambda: check_policy(TopK(64), alpha=bad, page_size=16),
    ):
        with pytest.raises(ValueError, match=r"alpha.*\[1, 4\]"):
            call()
    cache, slots, _, _ = random_cache([20], 1, 8, 4, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        decode(torch.randn(1, 1, 8), cache, slots, alpha=bad)


@pytest.mark.parametrize("good", [np.float32(1.5), np.float64(2.0), np.int64(2), np.int32(1), 4, 1.0])
def test_numpy_and_int_alpha_accepted(good):
    x = torch.randn(2, 5)
    assert torch.allclose(entmax(x, good), entmax(x, float(good)))
    cache, slots, _, _ = random_cache([20], 1, 8, 4, seed=0)
    q = torch.randn(1, 1, 8)
    assert torch.equal(decode(q, cache, slots, alpha=good), decode(q, cache, slots, alpha=float(good)))


@pytest.mark.parametrize("policy", [Gaussian(), Certified(seed=Gaussian()), Certified()])
def test_entmax_policies_refuse_effective_softmax(policy):
    """Gaussian and Certified need alpha > 1: alpha - 1 below SOFTMAX_BELOW runs as softmax."""
    for alpha in (1.0, 1.0 + SOFTMAX_BELOW / 2):
        with pytest.raises(ValueError, match="^alpha"):
            check_policy(policy, alpha=alpha, page_size=16)


# ---------------------------------------------------------------- ALiBi positions


def test_alibi_cache_capacity_limit():
    """ALiBi positions are float32: a cache of more than 2^24 tokens per sequence is refused."""
    P = 16
    cache = PagedKVCache(4, P, 1, 8, max_seqs=1, max_pages_per_seq=POSITION_MAX // P + 1, dtype=torch.float32)
    seq = cache.allocate(torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    q = torch.randn(1, 2, 8)
    slopes = torch.tensor([0.5, 0.0])
    with pytest.raises(ValueError, match="alibi_slopes.*2\\^24|alibi_slopes.*16777216"):
        decode(q, cache, [seq], alibi_slopes=slopes)
    decode(q, cache, [seq])  # without ALiBi the same cache is fine
    ok = PagedKVCache(4, P, 1, 8, max_seqs=1, max_pages_per_seq=POSITION_MAX // P, dtype=torch.float32)
    s2 = ok.allocate(torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    decode(q, ok, [s2], alibi_slopes=slopes)
