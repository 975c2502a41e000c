"""Non-finite data and the certificate (reference backend, CPU).

NaN / inf written into the cache with check_finite=False (in a page the
policy keeps and in one it leaves out), float16 keys that overflow to inf,
and NaN in q with decode(check_finite=False): no head whose output is not
finite is certified, every certified head equals a float64 full-cache
computation written here, and no selection is empty (the last page is
always kept; NaN bounds rank last).
"""
from __future__ import annotations

import math

import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, TopK, decode
from entmaxkv import attention as RA
from entmaxkv import policies as RP
from entmaxkv import scoring as RS
from entmaxkv.testing import poisoned_case
from entmaxkv.types import Selection

NAN, INF = float("nan"), float("inf")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def entmax64(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha-entmax (alpha = 1: softmax) of finite float64 scores s [n], by bisection on tau."""
    if alpha == 1.0:
        return torch.softmax(s, 0)
    x = (alpha - 1.0) * s
    lo, hi = float(x.max()) - 1.0, float(x.max())  # sum p >= 1 at lo, 0 at hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float((x - mid).clamp(min=0).pow(1.0 / (alpha - 1.0)).sum()) >= 1.0:
            lo = mid
        else:
            hi = mid
    p = (x - lo).clamp(min=0).pow(1.0 / (alpha - 1.0))
    return p / p.sum()


def full_truth(q, cache, seqs, alpha, scale):
    """float64 [B, HQ, D] full-cache attention over the stored keys/values;
    NaN where it is not defined (a non-finite score, or a non-finite value
    of a support token)."""
    B, HQ, D = q.shape
    G = HQ // cache.kv_heads
    out = torch.full((B, HQ, D), NAN, dtype=torch.float64)
    for b, seq in enumerate(seqs):
        k, v = (t.double() for t in cache.gather(seq))
        for h in range(HQ):
            s = scale * (k[:, h // G] @ q[b, h].double())
            if not bool(torch.isfinite(s).all()):
                continue
            p = entmax64(s, alpha)
            sup = p > 0
            vs = v[sup, h // G]
            if bool(torch.isfinite(vs).all()):
                out[b, h] = p[sup] @ vs
    return out


def bad_case(kind, where, P, G, dtype, seed=0):
    """Three sequences of P-token pages (``poisoned_case``), row 0 holding
    the bad value; rows 1 and 2 are clean. Returns (cache, seqs, q)."""
    return poisoned_case(kind, where, [6 * P + 2, 3 * P + 1, 5 * P], P, G, dtype, seed=seed)

POLICIES = {
    "full": Full(),
    "topk": TopK(16),
    "topk-per-q": TopK(16, per_query_head=True),
    "gaussian": Gaussian(),
    "certified": Certified(seed=TopK(16)),
    "certified-gaussian": Certified(seed=Gaussian()),
}
KINDS = ["nan-k", "nan-kv", "nan-v", "inf-k", "nan-q"]


def check_invariants(q, cache, seqs, pol, alpha, out, st, dtype, scale):
    """No certified head with a non-finite output; every certified head equals
    the float64 truth; the clean rows are certified where the policy covers
    the support (always for Full)."""
    truth = full_truth(q, cache, seqs, alpha, scale)
    cert = st.certified.cpu()
    fin = torch.isfinite(out.cpu()).all(-1)
    assert not bool((cert & ~fin).any()), "a head with a non-finite output is certified"
    assert not bool((cert & ~torch.isfinite(truth).all(-1)).any()), "an undefined head is certified"
    for b, h in cert.nonzero().tolist():
        err = (out[b, h].cpu().double() - truth[b, h]).abs().max()
        assert float(err) <= TOL[dtype] * max(1.0, float(truth[b, h].abs().max())), (b, h, float(err))
    return truth, cert


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["kept", "dropped"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_uncertain_head_certified(kind, where, policy):
    """Every policy, every kind of bad value, in a kept or a dropped page."""
    dtype, P, G, alpha = torch.float32, 4, 2, 1.5
    cache, seqs, q = bad_case(kind, where, P, G, dtype, seed=len(kind) + len(policy))
    pol = POLICIES[policy]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, st = decode(q, cache, seqs, pol, alpha=alpha, return_stats=True, check_finite=False)
    truth, cert = check_invariants(q, cache, seqs, pol, alpha, out, st, dtype, scale)
    if policy == "full" or policy.startswith("certified"):
        # the clean rows are exact: nothing but the bad head may lose its certificate
        assert bool(cert[1:].all())
    if kind != "nan-v":  # (a NaN value leaves the bounds finite)
        bad = 1 if kind == "nan-q" else G  # the bad query head, or the heads of the bad KV head
        assert not bool(cert[0, :bad].any())


@pytest.mark.parametrize("P", [1, 3, 16])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_shapes_and_dtypes(P, G, dtype):
    """Page sizes 1 / 3 / 16, GQA groups 1 / 2 / 4, float16 (with a key that
    overflows to inf when stored) and float32."""
    scale = 0.25
    for i, (kind, where, policy, alpha) in enumerate([
        ("overflow" if dtype == torch.float16 else "inf-k", "kept", "full", 1.5),
        ("nan-kv", "kept", "certified", 2.0),
        ("nan-k", "dropped", "topk", 1.0),
        ("nan-q", "kept", "gaussian", 1.5),
    ]):
        cache, seqs, q = bad_case(kind, where, P, G, dtype, seed=P * 10 + G + i)
        out, st = decode(q, cache, seqs, POLICIES[policy], alpha=alpha, scale=scale, return_stats=True,
                         check_finite=False)
        check_invariants(q, cache, seqs, POLICIES[policy], alpha, out, st, dtype, scale)
        assert not bool(st.certified[0, : 1 if kind == "nan-q" else G].any()), (kind, policy)
        if policy == "full":
            assert bool(st.certified[1:].all())


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_full_nan_output_not_certified(alpha):
    """Full reads every page, so its certificate is only the finiteness of
    its inputs and output: a NaN key makes the head's output NaN, and that
    head (only that one) is not certified."""
    cache, seqs, q = bad_case("nan-k", "dropped", 4, 2, torch.float32)
    out, st = decode(q, cache, seqs, Full(), alpha=alpha, return_stats=True)
    assert not bool(torch.isfinite(out[0, :2]).all())
    want = torch.ones(3, 4, dtype=torch.bool)
    want[0, :2] = False
    assert torch.equal(st.certified, want)


@pytest.mark.parametrize("kind", ["nan-k", "inf-k", "nan-q"])
@pytest.mark.parametrize("per_q", [False, True])
def test_topk_selection_never_empty(kind, per_q):
    """NaN bounds rank last and +inf bounds below the forced pages: every row
    keeps min(max(forced, budget pages), pages in use) pages, its last page
    among them; a page whose bound is NaN is left out while finite ones
    remain, and then the output is finite."""
    P, G = 4, 2
    cache, seqs, q = bad_case(kind, "dropped", P, G, torch.float32)
    ids = torch.tensor(seqs, dtype=torch.int32)
    lay = RS.page_layout(cache, ids)
    pol = TopK(2 * P, per_query_head=per_q)
    sel = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.25)
    npages = lay.num_pages
    assert torch.equal(sel.counts, torch.minimum(npages, torch.tensor(2))[:, None].expand_as(sel.counts).int())
    for b in range(3):
        for s in range(sel.sel_heads):
            kept = set(sel.pages[b, s, : int(sel.counts[b, s])].tolist())
            assert int(npages[b]) - 1 in kept
    ub = RS.quest_bounds(q, cache, ids, scale=0.25)
    S = sel.sel_heads
    nan_pages = torch.isnan(ub).view(3, S, -1, ub.shape[-1]).all(2)  # NaN for every head of the row
    mask = RA.selection_mask(sel, ub.shape[-1])
    if kind == "nan-k":
        assert bool(nan_pages[0, 0, 0]) and not bool((mask & nan_pages).any())
        out = RA.attend(q, cache, ids, sel, alpha=1.5, scale=0.25)[0]
        assert bool(torch.isfinite(out).all())
    if kind == "inf-k":  # +inf bounds rank first after the forced page, NaN ones last
        pos = (ub == INF).view(3, S, -1, ub.shape[-1]).any(2)
        assert bool(pos.any()) and bool((mask | ~pos).all())


def test_nan_query_topk_keeps_pages_and_is_not_certified():
    """A NaN in q (decode with check_finite=False) makes every bound of that
    head NaN: its selection still holds its budget (the last page first),
    and the head is not certified; the other heads are unaffected."""
    cache, seqs, q = bad_case("nan-q", "kept", 4, 1, torch.float32)
    for pol in (TopK(8, per_query_head=True), TopK(8)):
        out, st = decode(q, cache, seqs, pol, alpha=1.5, return_stats=True, check_finite=False)
        assert bool((st.pages_read == 2).all())
        assert not bool(st.certified[0, 0]) and not bool(torch.isfinite(out[0, 0]).all())
        assert bool(torch.isfinite(out[:, 1:]).all()) and bool(torch.isfinite(out[1:]).all())


def test_certify_checks_its_inputs():
    """attention.certify: a NaN / inf tau, or a non-finite bound of any valid
    page (kept or left out), refuses the head; NaN never passes the test;
    pages past the end do not count; finite_rows checks output and query."""
    B, HQ, M, P = 1, 2, 4, 2
    lens = torch.tensor([7])  # 4 pages, all valid
    ub = torch.tensor([[[0.5, 0.1, 0.2, 0.3], [0.5, 0.1, 0.2, 0.3]]])
    all_pages = Selection(torch.arange(M, dtype=torch.int32).view(1, 1, M), torch.tensor([[M]], dtype=torch.int32))
    some = Selection(torch.tensor([[[3, 0, 0, 0]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32))
    tau = torch.tensor([[1.0, 1.0]])
    for sel in (all_pages, some):
        assert bool(RA.certify(ub, sel, tau, 1.5, lens, page_size=P).all())
        for bad in (NAN, INF, -INF):
            t = tau.clone()
            t[0, 1] = bad
            assert RA.certify(ub, sel, t, 1.5, lens, page_size=P).tolist() == [[True, False]]
        for page in (0, 1):  # a kept page, a left-out page
            for bad in (NAN, INF, -INF):
                u = ub.clone()
                u[0, 0, page] = bad
                assert RA.certify(u, sel, tau, 1.5, lens, page_size=P).tolist() == [[False, True]], (page, bad)
                slack = torch.zeros_like(ub)
                slack[0, 1, page] = bad
                assert RA.certify(ub, sel, tau, 1.5, lens, page_size=P, slack=slack).tolist() == [[True, False]]
    # softmax: only the full selection certifies, and only with finite inputs
    assert RA.certify(ub, all_pages, tau, 1.0, lens, page_size=P).tolist() == [[True, True]]
    t = tau.clone()
    t[0, 0] = NAN
    assert RA.certify(ub, all_pages, t, 1.0, lens, page_size=P).tolist() == [[False, True]]
    # pages past the end (-inf, or anything) are ignored
    short = torch.tensor([4])  # pages 0 and 1 only
    u = ub.clone()
    u[0, :, 2:] = NAN
    two = Selection(torch.tensor([[[0, 1, 0, 0]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32))
    assert bool(RA.certify(u, two, tau, 1.5, short, page_size=P).all())
    out = torch.zeros(1, 2, 3)
    qq = torch.zeros(1, 2, 3)
    out[0, 0, 1] = NAN
    qq[0, 1, 2] = INF
    assert RA.finite_rows(out, qq).tolist() == [[False, False]]
    assert RA.finite_rows(out, torch.zeros(1, 2, 3)).tolist() == [[False, True]]
