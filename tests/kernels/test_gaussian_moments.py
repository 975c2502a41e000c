"""The Triton Gaussian selector's float32 moments and its tau_hat deep in the tail.

``entmaxkv.kernels.gaussian.moments._gauss_terms`` evaluates the truncated moments of
every page in float32 (float64 only for the pooled scalar solve). The
textbook closed forms in Phi(t), phi(t) cancel for t << 0, which is where
tau_hat sits at long context, so these tests compare

* the jit helper itself, through a one-program test kernel, with the float64
  reference ``entmaxkv.gaussian.truncated_power_moment`` (erfc + continued
  fraction) over t in [-12, 8] and sigma from 0 to 1e3, plus underflow;
* the kernel's tau_hat on thousands of pages, most of them 4-7 standard
  deviations below tau_hat, with the float64 solve ``solve_tau_hat`` on the
  same float32 page statistics. A plain float32 port of the closed forms is
  6e-7 .. 1e-5 (relative) off there and fails; the stable form is within
  one float32 ulp of tau_hat.

Like the other kernel tests, this runs on Triton's CPU interpreter without a GPU.
"""
from __future__ import annotations

import importlib

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import entmaxkv.kernels as K  # noqa: E402

GK = importlib.import_module("entmaxkv.kernels.gaussian.moments")

from entmaxkv import Gaussian  # noqa: E402
from entmaxkv.gaussian import normal_pdf, pooled_moments, solve_tau_hat, truncated_power_moment  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, alibi, random_cache  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


@triton.jit
def _terms_kernel(m_ptr, s_ptr, o_ptr, N, BETA_KIND: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    mask = o < N
    m = tl.load(m_ptr + o, mask=mask, other=0.0)
    s = tl.load(s_ptr + o, mask=mask, other=0.0)
    e_b, e_b1, e_b2 = GK._gauss_terms(m, s, BETA_KIND, F64)
    tl.store(o_ptr + o, e_b, mask=mask)
    tl.store(o_ptr + N + o, e_b1, mask=mask)
    tl.store(o_ptr + 2 * N + o, e_b2, mask=mask)


def kernel_terms(m, s, beta_kind, f64=False):
    """(E[Y+^b], E[Y+^(b-1)], d^2/dtau^2 E[Y+^b]) from the jit helper, Y ~ N(m, s^2), b = beta_kind."""
    dt = torch.float64 if f64 else torch.float32
    N = m.numel()
    out = torch.empty(3, N, dtype=dt, device=DEV)
    _terms_kernel[(1,)](m.to(DEV, dt), s.to(DEV, dt), out, N, BETA_KIND=beta_kind, F64=f64,
                        BLOCK=triton.next_power_of_2(N))
    return out.cpu().double()


def reference_terms(m, s, beta_kind):
    """The same three values in float64 (sigma == 0: point mass, second derivative 0 for b = 1)."""
    m, s = m.double(), s.double()

    def moment(k):
        return truncated_power_moment(m, s, float(k))

    if beta_kind == 1:
        pos = s > 0
        s1 = torch.where(pos, s, torch.ones_like(s))
        density = torch.where(pos, normal_pdf(m / s1) / s1, torch.zeros_like(s))
        return torch.stack([moment(1), moment(0), density])
    if beta_kind == 2:
        return torch.stack([moment(2), moment(1), 2.0 * moment(0)])
    return torch.stack([moment(3), moment(2), 6.0 * moment(1)])


T_GRID = torch.linspace(-12.0, 8.0, 401, dtype=torch.float64)


@pytest.mark.parametrize("beta_kind", [1, 2, 3], ids=["beta1", "beta2", "beta3"])
@pytest.mark.parametrize("sigma", [0.0, 1e-20, 1e-6, 0.05, 1.0, 1e3])
def test_float32_moments_match_float64(beta_kind, sigma):
    """Relative error <= 1e-6 + 2e-7 x^2, x = |t|, wherever the float64 value
    exceeds 1e-30 (absolute error <= 1e-30 below that). Measured on the CPU
    interpreter: <= 8.1e-7 for |t| <= 3, <= 2.8e-6 for |t| <= 6, <= 9.4e-6 at
    |t| = 12; the x^2 part is the conditioning of phi(x) in x (rounding of
    x = |mu| / sigma and of the exponent). The bound leaves 2x for the GPU's
    approximate ex2 and division. A plain float32 port of the closed forms is
    off by O(1) at t = -8."""
    s = torch.full_like(T_GRID, sigma)
    m = T_GRID * (sigma if sigma > 0 else 1.0)
    m, s = m.float().double(), s.float().double()  # the float32 inputs, exactly
    got = kernel_terms(m, s, beta_kind)
    want = reference_terms(m, s, beta_kind)
    assert torch.isfinite(got).all()
    x = (m / torch.where(s > 0, s, torch.ones_like(s))).abs()
    big = want.abs() > 1e-30
    rel = (got - want).abs() / want.abs().clamp_min(1e-300)
    bound = (1e-6 + 2e-7 * x * x).expand_as(rel)
    assert (rel[big] <= bound[big]).all(), (rel[big] / bound[big]).max()
    assert ((got - want)[~big].abs() <= 1e-30).all()
    # the float64 variant (pooled solve): the rational fit's 1.1e-8
    got64 = kernel_terms(m, s, beta_kind, f64=True)
    rel64 = (got64 - want).abs() / want.abs().clamp_min(1e-300)
    assert (rel64[big] <= 3e-8).all(), rel64[big].max()
    assert ((got64 - want)[~big].abs() <= 1e-30).all()


def test_moments_underflow_and_extremes():
    """Far tails give exact zeros (never NaN/inf), huge |t| the limits, sigma <= 1e-30 the point mass."""
    m = torch.tensor([-1e30, -1e3, -40.0, -14.6, -1e-10, 0.0, 2.0, 40.0, 1e3, 1e6], dtype=torch.float64)
    for s_val in [1.0, 1e-25, 1e-35, 0.0]:
        s = torch.full_like(m, s_val)
        for bk in (1, 2, 3):
            got = kernel_terms(m, s, bk)
            assert torch.isfinite(got).all(), (s_val, bk)
            # phi(x) < 1.3e-46 below float32's range: exactly 0, never 0 * inf
            deep = (m < 0) & (m <= -14.6 * s_val)
            assert (got[:, deep] == 0).all(), (s_val, bk)
            # (sigma <= 1e-30 is read as the point mass, as sigma = 0)
            want = reference_terms(m, s if s_val > 1e-30 else torch.zeros_like(s), bk)
            big = want.abs() > 1e-30
            rel = (got - want).abs() / want.abs().clamp_min(1e-300)
            assert (rel[big] <= 1e-6).all(), (s_val, bk, rel[big].max())
            assert ((got - want)[~big].abs() <= 1e-30).all(), (s_val, bk)


def _tail_setup(slopes):
    # 8000 and 2500 tokens in pages of 4: M ~ 2600 pages, the median page
    # 4-7 standard deviations below tau_hat
    cache, slots, _, _ = random_cache([8000, 2500], 1, 16, 4, seed=3, key_scale=1.5, device=DEV)
    q = (torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(104)) * 1.5).to(DEV)
    ids = torch.tensor(slots, dtype=torch.int32, device=DEV)
    return cache, ids, q, (alibi(2).to(DEV) if slopes else None)


@pytest.mark.parametrize("alpha,slopes,pooled", [
    (2.0, False, False), (1.5, False, False), (4.0 / 3.0, False, False),
    (2.0, True, False), (1.5, True, False), (4.0 / 3.0, True, False),
    (1.5, True, True), (4.0 / 3.0, False, True),
], ids=["a2", "a1.5", "a4/3", "a2-alibi", "a1.5-alibi", "a4/3-alibi", "a1.5-alibi-pooled", "a4/3-pooled"])
def test_tau_hat_deep_in_the_tail(alpha, slopes, pooled):
    """tau_hat against the float64 solve on the kernel's own float32 page
    statistics: within 3e-7 relative (measured <= 1.0e-7, i.e. the float32
    rounding of tau_hat; the plain float32 closed forms: 6.3e-7 .. 1.05e-5)."""
    cache, ids, q, sl = _tail_setup(slopes)
    pol = Gaussian(q_max=0.99, margin=0.05, pooled=pooled, sinks=1)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl)
    mu, sg, n = (t.cpu().double() for t in K.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl))
    w = n[:, None, :].expand_as(mu)
    if pooled:
        a, b, c = pooled_moments(mu, sg, w)
        oracle = solve_tau_hat(a[..., None], b[..., None], c[..., None], alpha, iters=120)
    else:
        oracle = solve_tau_hat(mu, sg, w, alpha, iters=120)
        # the regime this test is about: most pages deep in the lower tail
        am1 = alpha - 1.0
        x = (oracle[..., None] - am1 * mu) / (am1 * sg).clamp_min(1e-30)
        assert x[w > 0].median().item() > 3.5
    err = (sel.tau_hat.cpu().double() - oracle).abs() / oracle.abs().clamp_min(1.0)
    assert err.max().item() <= 3e-7, err.max().item()
