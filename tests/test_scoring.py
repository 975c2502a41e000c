"""Quest bounds and Gaussian page statistics against brute force."""
from __future__ import annotations


import pytest
import torch

from entmaxkv.scoring import gaussian_stats, page_layout, quest_bounds
from entmaxkv.testing import alibi, random_cache


def token_scores(q, k, n, scale, slopes):
    """float64 [HQ, n] exact scores of one row over a contiguous cache."""
    HQ = q.shape[0]
    G = HQ // k.shape[1]
    s = torch.einsum("hd,nhd->hn", q.double(), k[:n].double().repeat_interleave(G, dim=1)) * scale
    if slopes is not None:
        s = s + slopes.double()[:, None] * (torch.arange(n) - (n - 1)).double()[None, :]
    return s


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("use_alibi", [False, True])
def test_quest_bound_is_safe_and_masked(page_size, use_alibi):
    lens = [3, 61, 100]
    HQ, H, D = 6, 2, 12
    cache, slots, k, v = random_cache(lens, H, D, page_size, seed=page_size)
    q = torch.randn(3, HQ, D, dtype=torch.float64)
    slopes = None
    if use_alibi:  # include negative slopes: the bound must handle both ends
        slopes = alibi(HQ) * torch.tensor([1, -1, 1, -1, 1, -1.0])
    ids = torch.tensor(slots, dtype=torch.int32)
    ub = quest_bounds(q, cache, ids, scale=0.4, slopes=slopes)
    M = cache.max_pages_per_seq
    assert ub.shape == (3, HQ, M) and ub.dtype == torch.float64
    for b, n in enumerate(lens):
        s = token_scores(q[b], k[b], n, 0.4, slopes)
        pages = -(-n // page_size)
        for p in range(pages):
            tok = s[:, p * page_size:(p + 1) * page_size]
            assert (ub[b, :, p] >= tok.max(-1).values - 1e-12).all()
            if page_size == 1:  # a one-token box is the token itself: tight
                assert torch.allclose(ub[b, :, p], tok[:, 0], atol=1e-12)
        assert torch.isneginf(ub[b, :, pages:]).all()


@pytest.mark.parametrize("use_alibi", [False, True])
def test_gaussian_stats_match_page_moments(use_alibi):
    lens = [45, 16]
    HQ, H, D, P = 4, 2, 10, 8
    cache, slots, k, v = random_cache(lens, H, D, P, seed=9)
    q = torch.randn(2, HQ, D, dtype=torch.float64)
    slopes = alibi(HQ) if use_alibi else None
    ids = torch.tensor(slots, dtype=torch.int32)
    mu, sigma, n_tok = gaussian_stats(q, cache, ids, scale=0.5, slopes=slopes)
    G = HQ // H
    for b, n in enumerate(lens):
        s = token_scores(q[b], k[b], n, 0.5, slopes)
        for p in range(-(-n // P)):
            lo, hi = p * P, min((p + 1) * P, n)
            assert n_tok[b, p] == hi - lo
            # the mean of the scores is linear in k and in position, so only
            # the float32 rounding of the stored k_mean separates the two:
            # ~1e-7 of |q . k_mean|, far below one position of the smallest
            # ALiBi slope (2^-8 here); a relative test fails at means near 0
            assert torch.allclose(mu[b, :, p], s[:, lo:hi].mean(-1), rtol=0, atol=1e-5)
            # sigma: diagonal model sum_i q_i^2 var_i (+ positional variance)
            kp = k[b, lo:hi].double().repeat_interleave(G, dim=1)  # [n, HQ, D]
            var = (q[b].double() ** 2 * kp.var(0, unbiased=False)).sum(-1) * 0.25
            if slopes is not None:
                m = hi - lo
                var = var + slopes.double() ** 2 * (m * m - 1) / 12
            assert torch.allclose(sigma[b, :, p], var.sqrt(), atol=1e-6)
        assert (n_tok[b, -(-n // P):] == 0).all()


def test_layout_positions():
    cache, slots, _, _ = random_cache([10, 33], 1, 4, 8, seed=1)
    lay = page_layout(cache, torch.tensor(slots, dtype=torch.int32))
    assert lay.seq_len.tolist() == [10, 33]
    assert lay.num_pages.tolist() == [2, 5]
    assert lay.n_tok[0, :3].tolist() == [8, 2, 0]
    assert lay.pos_q.tolist() == [9, 32]
