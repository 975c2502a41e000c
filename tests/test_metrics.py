"""Metrics: coverage, delta, rho, R on hand-checkable cases and Prop. 3.1."""
from __future__ import annotations

import torch

from entmaxkv import dense_attention
from entmaxkv.entmax import entmax
from entmaxkv.metrics import quality


def sparse_out(s, v, kept, alpha):
    p = entmax(s.masked_fill(~kept, float("-inf")), alpha, dim=-1)
    return torch.einsum("hn,nhd->hd", p, v)


def test_keep_all_is_exact():
    s = torch.randn(3, 50, dtype=torch.float64)
    v = torch.randn(50, 3, 4, dtype=torch.float64)
    p = entmax(s, 1.5, dim=-1)
    o = torch.einsum("hn,nhd->hd", p, v)
    kept = torch.ones(3, 50, dtype=torch.bool)
    qm = quality(p, o, kept, sparse_out(s, v, kept, 1.5))
    assert torch.all(qm.delta == 0) and torch.all(qm.rho == 1) and torch.all(qm.coverage == 1)
    assert torch.all(qm.R < 1e-12)


def test_dropping_support_and_bound():
    gen = torch.Generator().manual_seed(0)
    for alpha in (1.0, 1.5, 2.0):
        s = torch.randn(4, 200, generator=gen, dtype=torch.float64) * 3
        v = torch.randn(200, 4, 8, generator=gen, dtype=torch.float64)
        p = entmax(s, alpha, dim=-1)
        o = torch.einsum("hn,nhd->hd", p, v)
        kept = torch.rand(4, 200, generator=gen) < 0.5
        kept[:, 0] = True
        qm = quality(p, o, kept, sparse_out(s, v, kept, alpha))
        assert torch.allclose(qm.delta, (p * ~kept).sum(-1))
        sup = p > 0
        assert torch.allclose(qm.rho, (sup & kept).sum(-1).double() / sup.sum(-1))
        assert torch.allclose(qm.coverage, kept.double().mean(-1))
        # Prop. 3.1: ||o - o~|| <= 2 B delta, B = max ||v_j||
        B = v.norm(dim=-1).max()
        err = (o - sparse_out(s, v, kept, alpha)).norm(dim=-1)
        assert (err <= 2 * B * qm.delta + 1e-12).all()
        assert torch.allclose(qm.R, err / o.norm(dim=-1))


def test_dense_attention_gqa_and_alibi():
    q = torch.randn(4, 8, dtype=torch.float64)
    k = torch.randn(20, 2, 8, dtype=torch.float64)
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.0, 0.25, 0.0], dtype=torch.float64)
    out, p = dense_attention(q, k, v, alpha=1.5, scale=0.3, slopes=slopes, length=15)
    for h in range(4):
        s = (k[:15, h // 2] @ q[h]) * 0.3 + slopes[h] * (torch.arange(15) - 14)
        ph = entmax(s, 1.5)
        assert torch.allclose(p[h], ph)
        assert torch.allclose(out[h], ph @ v[:15, h // 2])
