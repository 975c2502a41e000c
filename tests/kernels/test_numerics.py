"""Numerics of the attention kernels at the edges of the supported range
(entmaxkv.limits): decode with the Triton backend against a float64 truth
written here (bisection on the shifted form, independent of entmax.py).

Cases (fp32 / fp16 / bf16, GQA 1 / 2, pages 1 / 3 / 16, odd lengths):
alpha - 1 tiny (down to below limits.SOFTMAX_BELOW), scores ~1e8
(q x 1e8), alpha = 3 and 4 with exact ties and with near-uniform scores
(the support within ~n^(1-alpha) of the max), and alpha = 1.5 / 2 on
ordinary data. Small shapes: the kernels run on Triton's interpreter here.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from entmaxkv import Full, TopK, decode  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402
from entmaxkv.kernels import AttentionConfig, KernelConfig  # noqa: E402
from entmaxkv.limits import SOFTMAX_BELOW  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, rel_err  # noqa: E402
from entmaxkv.testing import alibi  # noqa: E402

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

THREE = KernelConfig(attention=AttentionConfig(finish=False))  # split, solve, V pass, combine


# ---------------------------------------------------------------------------
# the float64 truth
# ---------------------------------------------------------------------------


def _entmax64(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha-entmax of float64 scores s [..., n] over the last axis, by
    bisection on the shifted form: d = (alpha-1)(s - m) <= 0, p = [d - t]_+^beta
    with t in [-1, 0]; near alpha = 1 on r = t + 1 through log1p (so that r,
    ~(alpha-1) log n, keeps its digits). alpha = 1: softmax."""
    s = s.double()
    if alpha == 1.0:
        return torch.softmax(s, dim=-1)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    d = am1 * (s - s.max(dim=-1, keepdim=True).values)
    lo = torch.zeros(s.shape[:-1] + (1,), dtype=torch.float64)
    hi = torch.ones_like(lo)  # r in [0, 1]: f(0) >= 0 (the max alone gives 1), f(1) <= 0

    def probs(r):
        w = d - r
        on = w > -1.0
        return torch.where(on, torch.exp(beta * torch.log1p(torch.where(on, w, 0.0))), 0.0)

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        big = probs(mid).sum(-1, keepdim=True) > 1.0
        lo = torch.where(big, mid, lo)
        hi = torch.where(big, hi, mid)
    p = probs(0.5 * (lo + hi))
    return p / p.sum(-1, keepdim=True)  # (the bisection's last ulp)


def _truth(q, cache, ids, alpha, scale, slopes):
    """Full-cache attention [B, HQ, D] in float64 from the stored q, K, V."""
    B, HQ, D = q.shape
    H = cache.kv_heads
    out = torch.zeros(B, HQ, D, dtype=torch.float64)
    for b, seq in enumerate(ids.tolist()):
        k, v = cache.gather(seq)  # [n, H, D]
        n = k.shape[0]
        k, v = k.double().cpu(), v.double().cpu()
        for h in range(HQ):
            kv = h // (HQ // H)
            s = scale * (k[:, kv] @ q[b, h].double().cpu())
            if slopes is not None:
                s = s + float(slopes[h]) * (torch.arange(n, dtype=torch.float64) - (n - 1))
            out[b, h] = _entmax64(s, alpha) @ v[:, kv]
    return out


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


def _cache(k, v, lens, P, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    cache, slots = PagedKVCache.from_dense(k, v, list(lens), P, dtype=dtype, spare_pages=2, shuffle=True,
                                           generator=gen, device=DEV)
    return cache, torch.tensor(slots, dtype=torch.int32, device=DEV)


def _random(lens, G, P, dtype, seed, D=16, H=2):
    gen = torch.Generator().manual_seed(seed)
    n = max(lens)
    k = torch.randn(len(lens), n, H, D, generator=gen) * 1.5
    v = torch.randn(len(lens), n, H, D, generator=gen)
    q = torch.randn(len(lens), H * G, D, generator=gen) * 1.5
    cache, ids = _cache(k, v, lens, P, dtype, seed)
    return cache, ids, q


def _check(q, cache, ids, alpha, scale, slopes, dtype, policy=None, config=None, tol=None):
    q = q.to(dtype).to(DEV)
    policy = Full() if policy is None else policy
    out = decode(q, cache, ids, policy, alpha=alpha, scale=scale, alibi_slopes=slopes, backend="triton",
                 kernel_config=config)
    want = _truth(q, cache, ids, alpha, scale, slopes)
    err = rel_err(out.cpu(), want)
    assert torch.isfinite(out).all()
    assert err < (TOL[dtype] if tol is None else tol), (alpha, err)
    return out, want


# (dtype, page size, GQA group, ALiBi, policy, launch config)
LAYOUTS = [
    (torch.float32, 1, 1, False, "full", None),
    (torch.float16, 3, 2, True, "full", None),
    (torch.float32, 16, 2, True, "topk", None),
    (torch.float16, 16, 1, False, "full", "three"),
    (torch.bfloat16, 1, 2, False, "full", None),
]
LAYOUT_IDS = ["f32-p1-g1", "f16-p3-g2-alibi", "f32-p16-g2-alibi-topk", "f16-p16-g1-3launch", "bf16-p1-g2"]


def _layout(policy, config):
    return (TopK(10_000) if policy == "topk" else Full()), (THREE if config == "three" else None)


@pytest.mark.parametrize("dtype,P,G,use_alibi,policy,config", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("am1", [1e-10, 1e-9, 1e-7, 1e-4])
def test_alpha_near_one(am1, dtype, P, G, use_alibi, policy, config):
    """alpha = 1 + am1 matches the truth: below limits.SOFTMAX_BELOW it runs
    as softmax, above it through log1p in r = t + 1 (the float32 sums of p
    reached n once alpha - 1 <~ 1e-8 when built from 1 + d - r)."""
    assert (am1 < SOFTMAX_BELOW) == (am1 == 1e-10)
    cache, ids, q = _random([200, 37], G, P, dtype, seed=3)
    pol, cfg = _layout(policy, config)
    _check(q, cache, ids, 1.0 + am1, 0.3, alibi(2 * G).to(DEV) if use_alibi else None, dtype, pol, cfg)


@pytest.mark.parametrize("dtype,P,G,use_alibi,policy,config", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25, 4.0])
def test_huge_scores(alpha, dtype, P, G, use_alibi, policy, config):
    """|s| ~ 1e8 (q x 1e8, or the scale for float16, whose q cannot hold
    it): the probabilities come from s - m, exact near the max, so the
    output is the V row of the (unique) max as in the truth, not a sum of
    rounding noise."""
    cache, ids, q = _random([150, 29], G, P, dtype, seed=5)
    scale = 0.3
    if dtype == torch.float32:
        q = q * 1e8
    else:
        scale = scale * 1e8
    pol, cfg = _layout(policy, config)
    _check(q, cache, ids, alpha, scale, alibi(2 * G).to(DEV) if use_alibi else None, dtype, pol, cfg)


def _flat(lens, G, P, dtype, seed, spread, tie=False, D=16, H=2):
    """Scores 1/2 + j_t 2^-24 (j_t in 0..4; tie: every score 1/2), exact in
    float32 and float16 products: q = (2^-10, 1/2, 0, ...), k = (j 2^-14, 1,
    0, ...). At alpha = 4 the support of such a row spans ~n^-3 of shifted
    score, far below float32's resolution of (alpha-1) s ~ 1.5."""
    gen = torch.Generator().manual_seed(seed)
    n = max(lens)
    k = torch.zeros(len(lens), n, H, D)
    if not tie:
        k[..., 0] = torch.randint(0, spread, (len(lens), n, H), generator=gen).float() * 2.0 ** -14
    k[..., 1] = 1.0
    v = torch.randn(len(lens), n, H, D, generator=gen)
    q = torch.zeros(len(lens), H * G, D)
    q[..., 0] = 2.0 ** -10
    q[..., 1] = 0.5
    cache, ids = _cache(k, v, lens, P, dtype, seed)
    return cache, ids, q


@pytest.mark.parametrize("dtype,P,G,use_alibi,policy,config", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("alpha", [3.0, 4.0])
@pytest.mark.parametrize("kind", ["ties", "near-uniform"])
def test_large_alpha_flat_rows(kind, alpha, dtype, P, G, use_alibi, policy, config):
    """alpha = 3, 4 (above limits.FLOAT64_ABOVE: the solve and p in float64)
    on rows whose support lies within ~n^(1-alpha) of the max: exact ties
    (p = 1/n, the output the mean of V; float32 gave sums of p up to n) and
    near-uniform scores. No ALiBi here: it would break the exact scores."""
    cache, ids, q = _flat([300, 64], G, P, dtype, seed=7, spread=5, tie=kind == "ties")
    pol, cfg = _layout(policy, config)
    out, want = _check(q, cache, ids, alpha, 1.0, None, dtype, pol, cfg)
    if kind == "ties":
        k, v = cache.gather(int(ids[1]))
        mean = v.double().cpu().mean(0).repeat_interleave(G, dim=0)
        assert rel_err(want[1], mean) < 1e-12


@pytest.mark.parametrize("dtype,P,G,use_alibi,policy,config", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_default_alphas_unchanged(alpha, dtype, P, G, use_alibi, policy, config):
    """The fast paths (alpha = 1.5, 2) on ordinary data still match."""
    cache, ids, q = _random([230, 41], G, P, dtype, seed=11)
    pol, cfg = _layout(policy, config)
    _check(q, cache, ids, alpha, 0.3, alibi(2 * G).to(DEV) if use_alibi else None, dtype, pol, cfg)


def test_kernel_alpha_normalised_for_direct_callers():
    """The launch functions take alpha - 1 < SOFTMAX_BELOW as softmax, as
    decode does, and reject alpha < 1 naming it."""
    import entmaxkv.kernels as K

    cache, ids, q = _random([40], 1, 4, torch.float32, seed=2)
    q = q.to(DEV)
    soft, tau1 = K.dense_attend(q, cache, ids, alpha=1.0, scale=0.3)
    near, tau2 = K.dense_attend(q, cache, ids, alpha=1.0 + SOFTMAX_BELOW / 2, scale=0.3)
    assert torch.equal(soft, near) and torch.equal(tau1, tau2)
    with pytest.raises(ValueError, match="alpha"):
        K.dense_attend(q, cache, ids, alpha=0.5, scale=0.3)
    assert math.isfinite(float(tau1.max()))
