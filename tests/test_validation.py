"""Bad input raises ValueError naming the problem."""
from __future__ import annotations

import pytest
import torch

from entmaxkv import Certified, Gaussian, TopK, decode
from entmaxkv.testing import random_cache


@pytest.fixture()
def small():
    cache, slots, _, _ = random_cache([20, 9], 2, 8, 4, seed=0)
    return cache, slots, torch.randn(2, 4, 8)


@pytest.mark.parametrize("mutate,match", [
    (lambda q: q[0], "q"),
    (lambda q: q[..., :7], "head_dim"),
    (lambda q: q[:, :3], "q_heads"),
    (lambda q: q.to(torch.int32), "floating"),
    (lambda q: q.masked_fill(torch.zeros_like(q, dtype=torch.bool).index_fill_(2, torch.tensor([1]), True), float("nan")), "NaN"),
])
def test_bad_queries(small, mutate, match):
    cache, slots, q = small
    with pytest.raises(ValueError, match=match):
        decode(mutate(q), cache, slots)


def test_bad_sequences(small):
    cache, slots, q = small
    with pytest.raises(ValueError, match="seq_ids"):
        decode(q, cache, [slots[0], 99])
    with pytest.raises(ValueError, match="seq_ids"):
        decode(q, cache, [slots[0]])
    cache.free(slots[1])
    with pytest.raises(ValueError, match="not allocated"):
        decode(q, cache, slots)
    empty = cache.allocate()
    with pytest.raises(ValueError, match="empty"):
        decode(q, cache, [slots[0], empty])
    with pytest.raises(ValueError, match="seq_ids"):
        decode(q, cache, torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(alpha=0.5), "alpha"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(scale=-1.0), "scale"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    (dict(alibi_slopes=torch.full((4,), float("nan"))), "alibi_slopes"),
    (dict(out=torch.empty(2, 4, 7)), "out"),
    (dict(backend="cuda-magic"), "backend"),
    (dict(policy=TopK(budget=2)), "budget"),
    (dict(policy=Gaussian(q_max=1.5)), "q_max"),
    (dict(policy=Gaussian(margin=-1.0)), "margin"),
    (dict(policy=TopK(64, sinks=-1)), "sinks"),
    (dict(policy="topk"), "policy"),
    (dict(policy=Gaussian(), alpha=1.0), "alpha > 1"),
    (dict(policy=Certified(), alpha=1.0), "alpha > 1"),
])
def test_bad_arguments(small, kwargs, match):
    cache, slots, q = small
    with pytest.raises(ValueError, match=match):
        decode(q, cache, slots, **kwargs)


def test_wrong_cache_type(small):
    _, slots, q = small
    with pytest.raises(ValueError, match="cache"):
        decode(q, object(), slots)
