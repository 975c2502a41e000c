"""Certified selection and the certificate kernels, and decode through the kernels."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, Full, Gaussian, TopK, decode  # noqa: E402
from entmaxkv.kernels import KernelConfig, TopKConfig  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, page_sets, poisoned_case, rel_err  # noqa: E402
from entmaxkv.testing import random_case as case  # noqa: E402
from entmaxkv.types import Selection  # noqa: E402

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("per_q", [False, True], ids=["per-kv", "per-q"])
def test_certified_alibi_seed_by_head_group(per_q):
    """With an ALiBi seed, a selection head takes it exactly where all its
    query heads have a slope > 0 (``policies.alibi_heads``; the mark kernel
    reads the slopes itself): per KV group, a group with one zero slope and
    one with a negative slope take the main seed. Each head's pages equal the
    reference's and those of the certified policy with that head's seed."""
    cache, ids, q, _ = case([300, 70, 6], 3, 2, 16, 8, torch.float32, seed=11, key_scale=2.0)
    sl = torch.tensor([0.5, 0.0, 0.3, 0.4, -0.2, 0.6], device=DEV)  # groups: mixed, ALiBi, negative
    S = 6 if per_q else 3  # selection heads: query heads, or KV groups of two
    alibi = (sl > 0).view(S, -1).all(1).tolist()
    assert alibi == ([True, False, True, True, False, True] if per_q else [False, True, False])
    kw = dict(per_query_head=per_q, window=1)
    sets = {}
    for name, pol in (("both", Certified(seed=TopK(48), alibi_seed=TopK(8), **kw)),
                      ("main", Certified(seed=TopK(48), **kw)), ("alibi", Certified(seed=TopK(8), **kw))):
        sets[name] = page_sets(K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl))
        if name == "both":
            assert sets[name] == page_sets(RP.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl))
    for b in range(3):
        for s, got in enumerate(sets["both"][b]):
            assert got == sets["alibi" if alibi[s] else "main"][b][s]
    # the two seeds keep different pages on some head, so a wrong split shows
    assert sets["main"] != sets["alibi"]


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
    full, ftau = K.dense_attend(q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    assert rel_err(out, full) < 1e-5
    # tau over the seed rides along as a lower bound on tau (the attention starts there)
    ref_lower = RP.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl).tau_lower
    for lower in (sel.tau_lower, ref_lower):
        assert lower.dtype == torch.float32 and lower.shape == tau.shape
        assert (lower <= ftau + 1e-5 * (1 + ftau.abs())).all()
    assert (sel.tau_lower > ftau - 0.5).any()  # (a seed holding most of the mass: a tight bound)
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


@pytest.mark.parametrize("slopes", [True, False], ids=["alibi", "nope"])
def test_certified_gqa_seed_through_the_keys_pass(slopes, launches):
    """GQA with TopKConfig.keys_gqa: the seed's per-query-head bounds + slack
    come from _topk_keys_kernel; the selection is the reference's and the
    output is full-cache attention."""
    cache, ids, q, sl = case([260, 45], 2, 3, 24, 4, torch.float16, seed=21, key_scale=2.0, slopes=slopes)
    pol = Certified(seed=TopK(24), window=1)
    cfg = KernelConfig(topk=TopKConfig(keys_gqa=True))
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=cfg)
    assert "_topk_keys_kernel" in launches.names()
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert page_sets(sel) == page_sets(ref)
    out, _ = K.attend(q, cache, ids, sel, alpha=1.5, scale=0.3, slopes=sl)
    full, _ = K.dense_attend(q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert rel_err(out, full) < TOL[torch.float16]


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


# non-finite data and the certificate
# ---------------------------------------------------------------------------
# (the float64 truth and the bad caches as in tests/test_certificate.py, small
# enough for the interpreter)

_NAN, _INF = float("nan"), float("inf")


def _entmax64(s, alpha):
    """alpha-entmax (alpha = 1: softmax) of finite float64 scores [n], by bisection on tau."""
    if alpha == 1.0:
        return torch.softmax(s, 0)
    x = (alpha - 1.0) * s
    lo, hi = float(x.max()) - 1.0, float(x.max())
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float((x - mid).clamp(min=0).pow(1.0 / (alpha - 1.0)).sum()) >= 1.0:
            lo = mid
        else:
            hi = mid
    p = (x - lo).clamp(min=0).pow(1.0 / (alpha - 1.0))
    return p / p.sum()


def _truth(q, cache, seqs, alpha, scale):
    """float64 [B, HQ, D] full-cache attention over the stored keys / values,
    NaN where it is not defined (a non-finite score or support value)."""
    B, HQ, D = q.shape
    G = HQ // cache.kv_heads
    out = torch.full((B, HQ, D), _NAN, dtype=torch.float64)
    for b, seq in enumerate(seqs):
        k, v = (t.double().cpu() for t in cache.gather(seq))
        for h in range(HQ):
            s = scale * (k[:, h // G] @ q[b, h].double().cpu())
            if bool(torch.isfinite(s).all()):
                p = _entmax64(s, alpha)
                vs = v[p > 0, h // G]
                if bool(torch.isfinite(vs).all()):
                    out[b, h] = p[p > 0] @ vs
    return out


def _bad_case(kind, where, P, G, dtype, seed=0):
    """Two sequences on the test device (``poisoned_case``), row 0 holding the bad value."""
    return poisoned_case(kind, where, [5 * P + 2, 3 * P], P, G, dtype, seed=seed, device=DEV)

_KTOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("P,G,dtype,kind,where", [
    (1, 1, torch.float32, "nan-k", "kept"), (3, 2, torch.float32, "nan-kv", "dropped"),
    (16, 4, torch.float16, "overflow", "kept"), (3, 4, torch.float16, "inf-k", "dropped"),
    (16, 1, torch.float32, "nan-q", "kept"), (1, 2, torch.float16, "nan-v", "kept"),
], ids=["p1-g1-f32-nan-kept", "p3-g2-f32-nankv-dropped", "p16-g4-f16-overflow-kept",
        "p3-g4-f16-inf-dropped", "p16-g1-f32-nanq", "p1-g2-f16-nanv-kept"])
def test_decode_kernels_non_finite_never_certified(P, G, dtype, kind, where):
    """decode(backend="triton") with NaN / inf in the cache (stored with
    check_finite=False; a float16 key that overflows) or in q
    (check_finite=False): no head with a non-finite output is certified,
    and every certified head equals the float64 full-cache truth. The
    attention kernels may turn a NaN key into a finite output; the bounds
    of that page are NaN, so the certificate still refuses the head. Every
    selection keeps its row's last page."""
    cache, seqs, q = _bad_case(kind, where, P, G, dtype, seed=P + G)
    ids = torch.tensor(seqs, dtype=torch.int32, device=DEV)
    scale, bad = 0.25, (1 if kind == "nan-q" else G)
    for pol, alpha in [(Full(), 1.5), (TopK(2 * P), 1.0), (Certified(seed=TopK(2 * P)), 2.0), (Gaussian(), 1.5)]:
        out, st = decode(q, cache, ids, pol, alpha=alpha, scale=scale, return_stats=True, check_finite=False,
                         backend="triton")
        truth = _truth(q, cache, seqs, alpha, scale)
        cert = st.certified.cpu()
        assert not bool((cert & ~torch.isfinite(out.cpu()).all(-1)).any()), pol
        assert not bool((cert & ~torch.isfinite(truth).all(-1)).any()), pol
        for b, h in cert.nonzero().tolist():
            err = float((out[b, h].cpu().double() - truth[b, h]).abs().max())
            assert err <= _KTOL[dtype] * max(1.0, float(truth[b, h].abs().max())), (pol, b, h, err)
        if kind != "nan-v":
            assert not bool(cert[0, :bad].any()), pol
        if isinstance(pol, (Full, Certified)):
            assert bool(cert[1].all()), pol  # the clean row keeps its certificate
        assert bool((st.pages_read >= 1).all()), pol
        sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale)
        last = [[(n + P - 1) // P - 1 in s for s in row] for row, n in zip(page_sets(sel), [5 * P + 2, 3 * P])]
        assert all(all(r) for r in last), pol


def test_certify_kernel_refuses_non_finite_inputs():
    """K.certify against attention.certify with NaN / +-inf bounds (kept and
    left-out pages, and pages past the end), slack and tau, for entmax and
    softmax: the same flags, and no head certified with a non-finite tau or
    a non-finite bound on a valid page."""
    gen = torch.Generator().manual_seed(4)
    B, HQ, M, P = 3, 4, 9, 2
    lens = torch.tensor([17, 9, 2], device=DEV)
    ub = torch.randn(B, HQ, M, generator=gen)
    slack = torch.rand(B, HQ, M, generator=gen) * 1e-3
    tau = torch.randn(B, HQ, generator=gen) + 4.0  # most pages provably out
    for x, n in ((ub, 14), (slack, 4)):
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (n,), generator=gen)] = torch.tensor([_NAN, _INF, -_INF])[
            torch.arange(n) % 3]
    tau[1, 2], tau[2, 0], tau[0, 3] = _NAN, _INF, -_INF
    sel = Selection(torch.randint(0, M, (B, 2, 3), generator=gen, dtype=torch.int32),
                    torch.tensor([[3, 2], [1, 3], [2, 0]], dtype=torch.int32))
    sel_d = Selection(sel.pages.to(DEV), sel.counts.to(DEV))
    for alpha in (1.0, 1.5, 2.0):
        for sl in (None, slack):
            got = K.certify(ub.to(DEV), sel_d, tau.to(DEV), alpha, lens, page_size=P,
                            slack=None if sl is None else sl.to(DEV)).cpu()
            want = RA.certify(ub, sel, tau, alpha, lens.cpu(), page_size=P, slack=sl)
            assert torch.equal(got, want), (alpha, sl is None)
            bound = ub if sl is None else ub + sl
            valid = (torch.arange(M) * P < lens.cpu()[:, None])[:, None, :]
            fin = torch.isfinite(tau) & (torch.isfinite(bound) | ~valid).all(-1)
            assert not bool((got & ~fin).any())
            assert bool(got.any()) or alpha == 1.0  # not trivially all refused


@pytest.mark.parametrize("per_q", [False, True])
def test_kept_fraction_matches_reference(per_q):
    """The planner's read-back of a certified selection's coverage: the
    kernel (lengths through the ids) equals the reference."""
    cache, ids, q, _ = case([300, 41, 7], 2, 3, 16, 8, torch.float32, seed=5)
    sel = K.select(Certified(seed=TopK(16), per_query_head=per_q), q, cache, ids, alpha=1.5, scale=0.25)
    got = K.TritonBackend().kept_fraction(sel, cache, ids)
    want = RA.kept_fraction(sel, cache.seq_lens[ids.long()], cache.page_size)
    assert got.shape == (1,) and torch.allclose(got, want, rtol=1e-6)
    assert 0.0 < float(want) <= 1.0
