"""Selection policies against brute-force definitions (docs/spec.md §5)."""
from __future__ import annotations


import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, TopK, dense_attention
from entmaxkv.attention import selection_mask
from entmaxkv.gaussian import normal_icdf, solve_tau_hat
from entmaxkv.policies import select
from entmaxkv.scoring import gaussian_stats, quest_bounds
from entmaxkv.testing import alibi, random_cache

P = 8


def setup(lens=(250, 97, 8), HQ=6, H=2, D=16, seed=0, dtype=torch.float32):
    cache, slots, k, v = random_cache(list(lens), H, D, P, seed=seed, key_scale=1.5)
    q = torch.randn(len(lens), HQ, D, generator=torch.Generator().manual_seed(seed + 1)) * 1.5
    ids = torch.tensor(slots, dtype=torch.int32)
    return cache, ids, q.to(dtype), k, v, list(lens)


def page_sets(sel, b, s):
    return set(sel.pages[b, s, : int(sel.counts[b, s])].tolist())


def test_full_selects_every_valid_page():
    cache, ids, q, _, _, lens = setup()
    sel = select(Full(), q, cache, ids, alpha=1.5, scale=0.25)
    for b, n in enumerate(lens):
        for s in range(2):
            assert page_sets(sel, b, s) == set(range(-(-n // P)))


@pytest.mark.parametrize("per_q", [False, True])
@pytest.mark.parametrize("sinks,window", [(0, 0), (2, 3)])
def test_topk_matches_brute_force(per_q, sinks, window):
    cache, ids, q, _, _, lens = setup(seed=3)
    pol = TopK(64, sinks=sinks, window=window, per_query_head=per_q)
    sel = select(pol, q, cache, ids, alpha=1.5, scale=0.25)
    ub = quest_bounds(q, cache, ids, scale=0.25)
    S = 6 if per_q else 2
    assert sel.pages.shape[1] == S
    for b, n in enumerate(lens):
        npages = -(-n // P)
        forced = {npages - 1} | set(range(min(sinks, npages))) | set(range(max(npages - window, 0), npages))
        for s in range(S):
            heads = [s] if per_q else list(range(s * 3, s * 3 + 3))
            rank = ub[b, heads, :npages].max(0).values
            budget = max(64 // P, len(forced))
            order = [int(i) for i in rank.argsort(descending=True) if int(i) not in forced]
            expect = forced | set(order[: max(budget - len(forced), 0)])
            expect = {p for p in expect if p < npages}
            assert page_sets(sel, b, s) == expect


def test_gaussian_matches_definition():
    cache, ids, q, _, _, lens = setup(seed=5)
    alpha = 1.5
    pol = Gaussian(q_max=0.99, margin=0.05)
    sel = select(pol, q, cache, ids, alpha=alpha, scale=0.25)
    mu, sigma, n = gaussian_stats(q, cache, ids, scale=0.25)
    tau_hat = solve_tau_hat(mu, sigma, n[:, None, :].expand_as(mu), alpha)
    assert torch.allclose(sel.tau_hat, tau_hat.float())
    z = normal_icdf(torch.tensor(0.99, dtype=mu.dtype) ** (1.0 / n.clamp(min=1)))
    keep = (alpha - 1) * (mu + z[:, None, :] * sigma) > tau_hat[..., None] - 0.05
    for b, nn in enumerate(lens):
        npages = -(-nn // P)
        for s in range(2):
            expect = {int(p) for p in keep[b, s * 3:(s + 1) * 3, :npages].any(0).nonzero().flatten()}
            expect |= {npages - 1}
            assert page_sets(sel, b, s) == expect


def test_gaussian_recalls_support_on_gaussian_keys():
    """On i.i.d. Gaussian keys (the model's own assumption): tau_hat lands
    near the exact tau, the selection keeps most support tokens while
    reading part of the cache, and a margin trades coverage for recall."""
    from entmaxkv.entmax import entmax_threshold
    alpha, n = 1.5, 4000
    recalls = []
    for seed in range(4):
        cache, slots, k, v = random_cache([n], 1, 32, P, seed=seed, key_scale=1.5)
        q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(seed + 1)) * 1.5
        ids = torch.tensor(slots, dtype=torch.int32)
        s = torch.einsum("hd,nd->hn", q[0].double(), k[0, :n, 0].double()) * 32 ** -0.5
        tau, _ = entmax_threshold(s, alpha)
        sup = ((alpha - 1) * s > tau[:, None]).any(0)
        spread = ((alpha - 1) * s).std(-1)
        coverages = []
        for margin in (0.0, 0.25, 0.5):
            sel = select(Gaussian(margin=margin), q, cache, ids, alpha=alpha, scale=32 ** -0.5)
            assert ((sel.tau_hat[0].double() - tau).abs() < 0.35 * spread).all()
            kept = selection_mask(sel, cache.max_pages_per_seq)[0, 0].repeat_interleave(P)[:n]
            recall = float((sup & kept).sum() / sup.sum())
            coverages.append(float(kept.float().mean()))
            if margin == 0.0:
                recalls.append(recall)
            if margin == 0.5:
                assert recall == 1.0
        assert coverages[0] < coverages[1] < coverages[2] < 1.0
        assert coverages[0] < 0.8
    assert sum(recalls) / len(recalls) >= 0.9


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
@pytest.mark.parametrize("seed_policy", [TopK(8), TopK(32), Gaussian(q_max=0.5)])
def test_certified_contains_support(alpha, seed_policy):
    cache, ids, q, k, v, lens = setup(seed=int(alpha * 10))
    slopes = alibi(6)
    sel = select(Certified(seed=seed_policy), q.double(), cache, ids, alpha=alpha, scale=0.25, slopes=slopes)
    mask = selection_mask(sel, cache.max_pages_per_seq)
    for b, n in enumerate(lens):
        _, p = dense_attention(q[b].double(), k[b], v[b], alpha=alpha, scale=0.25, slopes=slopes, length=n)
        for h in range(6):
            pages = set((p[h] > 0).nonzero().flatten().div(P, rounding_mode="floor").tolist())
            kept = set(mask[b, h // 3].nonzero().flatten().tolist())
            assert pages <= kept
