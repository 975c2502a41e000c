"""Certified selection and the certificate kernels, and decode through the kernels."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, Full, Gaussian, TopK, decode  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.testing import KERNEL_TOL as TOL, page_sets, rel_err  # noqa: E402
from entmaxkv.testing import random_case as case  # noqa: E402

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("seed_policy,per_q,alpha", [
    (TopK(32), False, 1.5), (TopK(24, per_query_head=True), False, 2.0), (TopK(32), True, 1.5),
    (Gaussian(), False, 1.5),
], ids=["topk", "topk-per-q-seed-union", "per-q", "gaussian-seed"])
def test_certified_select_and_certificate(seed_policy, per_q, alpha):
    cache, ids, q, sl = case([300, 70, 6], 2, 2, 16, 8, torch.float32, seed=8, key_scale=2.0, slopes=True)
    pol = Certified(seed=seed_policy, per_query_head=per_q, window=1)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    if isinstance(seed_policy, TopK):
        # (a Gaussian seed may differ by a borderline page: tau_hat is rounded differently)
        ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
        assert page_sets(sel) == page_sets(ref)
    out, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    # certified == full-cache attention
    full, _ = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, full) < 1e-5
    ub = RS.quest_bounds(q, cache, ids, scale=0.3, slopes=sl)
    slack = RS.bound_slack(q, cache, ids, scale=0.3, slopes=sl)
    lay = RS.page_layout(cache, ids)
    c = K.certify(ub, sel, tau, alpha, lay.seq_len, page_size=8, slack=slack)
    assert c.all()
    # and the certificate agrees with the reference on an uncertified selection
    tk = K.select(TopK(16), q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    _, ttau = K.attend(q, cache, ids, tk, alpha=alpha, scale=0.3, slopes=sl)
    for a in (alpha, 1.0):
        got = K.certify(ub, tk, ttau, a, lay.seq_len, page_size=8, slack=slack)
        want = RA.certify(ub, tk, ttau, a, lay.seq_len, page_size=8, slack=slack)
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_certified_topk_seed_one_query_head_per_kv_head(alpha):
    """MHA: the seed's bounds + slack come from the all-heads _topk_keys_kernel."""
    cache, ids, q, sl = case([260, 45], 3, 1, 24, 4, torch.float16, seed=13, key_scale=2.0, slopes=True)
    pol = Certified(seed=TopK(24), window=1)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert page_sets(sel) == page_sets(ref)
    out, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=0.3, slopes=sl)
    full, _ = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, full) < TOL[torch.float16]


def test_decode_dispatches_to_kernels():
    """decode(backend="triton") runs these kernels and agrees with the reference."""
    cache, ids, q, sl = case([120, 33], 2, 2, 16, 8, torch.float32, seed=9, slopes=True)
    for pol, alpha in [(Full(), 1.5), (TopK(32), 1.0), (Gaussian(), 2.0), (Certified(), 1.5)]:
        out, st = decode(q, cache, ids, pol, alpha=alpha, alibi_slopes=sl, backend="triton", return_stats=True)
        ref, rst = decode(q, cache, ids, pol, alpha=alpha, alibi_slopes=sl, backend="reference", return_stats=True)
        assert rel_err(out, ref) < 1e-4, pol
        if not isinstance(pol, Gaussian):
            assert torch.equal(st.certified.cpu(), rst.certified.cpu()), pol
