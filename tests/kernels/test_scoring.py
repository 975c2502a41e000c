"""Scoring kernels (Quest bounds, Gaussian page statistics) against the reference."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.testing import random_case as case, rel_err  # noqa: E402

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("dtype,G,slopes", [
    (torch.float32, 1, False), (torch.float16, 3, True), (torch.bfloat16, 4, True), (torch.float16, 2, False),
], ids=["f32-g1", "f16-g3-alibi", "bf16-g4-alibi", "f16-g2"])
def test_scoring_matches_reference(dtype, G, slopes):
    cache, ids, q, sl = case([37, 130, 5], 2, G, 24, 8, dtype, seed=1, slopes=slopes)
    ub = K.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    rub = RS.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    fin = torch.isfinite(rub)
    assert torch.equal(torch.isfinite(ub), fin)
    assert rel_err(ub[fin], rub[fin]) < 1e-6
    mu, sg, n = K.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    rmu, rsg, rn = RS.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    assert rel_err(mu, rmu) < 1e-6 and rel_err(sg, rsg) < 1e-6 and torch.equal(n, rn.float())

