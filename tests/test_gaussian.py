"""Tests for entmaxkv.gaussian: truncated moments and the Gaussian tau estimate.

Monte Carlo checks use a fixed seed and a tolerance of 5 standard errors
(estimated from the same samples), so they fail on a wrong formula but not
on sampling noise.
"""
import math

import pytest
import torch

from entmaxkv.entmax import entmax_threshold
from entmaxkv.gaussian import (
    _closed_form,
    _quadrature_moments,
    normal_cdf,
    normal_icdf,
    normal_pdf,
    page_quantile_z,
    pooled_moments,
    solve_tau_hat,
    truncated_power_moment,
)

F64 = torch.float64
N_MC = 2_000_000
# (mu, sigma) of Y covering the bulk, both tails and a narrow and a wide case
MU_SIGMA = [(0.0, 1.0), (1.5, 0.7), (-1.0, 2.0), (-2.0, 0.6), (3.0, 5.0), (0.2, 0.05)]


@pytest.fixture(scope="module")
def std_normal_samples():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(N_MC, generator=g, dtype=torch.float64)


def mc_moment(z, mu, sigma, beta):
    """Monte Carlo E[(mu + sigma Z)_+^beta] and its standard error.

    Importance sampling: draws Z + theta, reweighted by phi(Z + theta) / phi(Z),
    with theta the offset of the peak of y^beta phi, so that the lower-tail
    cases (mu << 0) are resolved to < 1% instead of ~50% with plain draws.
    """
    t = mu / sigma
    theta = (-t + math.sqrt(t * t + 4 * beta)) / 2
    weight = torch.exp(-theta * z - theta * theta / 2)
    y = (mu + sigma * (z + theta)).clamp_min(0.0)
    v = ((y > 0).to(y.dtype) if beta == 0 else y.pow(beta)) * weight
    return v.mean().item(), v.std().item() / math.sqrt(v.numel())


def moment_mixture_residual(mu, sigma, w, alpha, tau):
    """sum_p w_p E[[(alpha-1) S_p - tau]_+^beta] - 1, evaluated in float64."""
    a = alpha - 1.0
    y_mean = a * mu.double() - tau.double()[..., None]
    e = truncated_power_moment(y_mean, a * sigma.double(), 1.0 / a)
    return (w.double() * e).sum(-1) - 1.0


# ---------------------------------------------------------------- standard normal


def test_normal_helpers():
    t = torch.tensor([-30.0, -10.0, -3.0, -0.5, 0.0, 0.7, 4.0, 9.0], dtype=torch.float64)
    exact = [0.5 * math.erfc(-v / math.sqrt(2)) for v in t.tolist()]
    exact_cdf = torch.tensor(exact, dtype=torch.float64)
    # relative accuracy deep in the lower tail (Phi(-30) ~ 5e-198)
    assert torch.allclose(normal_cdf(t), exact_cdf, rtol=1e-13, atol=0)
    exact_pdf = torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)
    assert torch.allclose(normal_pdf(t), exact_pdf, rtol=1e-15, atol=0)
    mid = t[2:7]
    assert torch.allclose(normal_icdf(normal_cdf(mid)), mid, atol=1e-9, rtol=0)
    assert normal_cdf(torch.tensor(-10.0)).item() > 0  # float32 too


@pytest.mark.parametrize("q_max", [0.9, 0.995, 0.999])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_quantile_z(q_max, page_size):
    z = page_quantile_z(q_max, page_size)
    assert isinstance(z, float)
    phi = 0.5 * math.erfc(-z / math.sqrt(2))
    assert abs(phi**page_size - q_max) <= 1e-12
    # and it is the quantile of the max of page_size draws, by simulation
    g = torch.Generator().manual_seed(page_size)
    mx = torch.randn(200_000 // page_size, page_size, generator=g, dtype=torch.float64).amax(-1)
    frac = (mx <= z).double().mean().item()
    se = math.sqrt(q_max * (1 - q_max) / mx.numel())
    assert abs(frac - q_max) <= 5 * se + 1e-12


@pytest.mark.parametrize("bad", [(0.0, 16), (1.0, 16), (0.9, 0), (0.9, 2.5)])
def test_page_quantile_z_validation(bad):
    with pytest.raises(ValueError):
        page_quantile_z(*bad)


# ---------------------------------------------------------------- truncated moments


@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0, 3.0])
def test_closed_forms_match_monte_carlo(beta, std_normal_samples):
    for mu, sigma in MU_SIGMA:
        mu_t, sigma_t = torch.tensor([mu, sigma], dtype=F64)
        got = truncated_power_moment(mu_t, sigma_t, beta)
        est, se = mc_moment(std_normal_samples, mu, sigma, beta)
        assert abs(got.item() - est) <= 5 * se + 1e-12, (mu, sigma)
        assert 5 * se <= 1e-2 * est


@pytest.mark.parametrize("alpha", [1.25, 1.75, 3.0], ids=lambda a: f"alpha={a}")
def test_quadrature_matches_monte_carlo(alpha, std_normal_samples):
    beta = 1.0 / (alpha - 1.0)  # 4, 4/3, 1/2: none has a closed form here
    for mu, sigma in MU_SIGMA:
        mu_t, sigma_t = torch.tensor([mu, sigma], dtype=F64)
        got = truncated_power_moment(mu_t, sigma_t, beta)
        est, se = mc_moment(std_normal_samples, mu, sigma, beta)
        assert abs(got.item() - est) <= 5 * se, (mu, sigma)
        assert 5 * se <= 1e-2 * est  # the check resolves 1% errors (0.2% in the bulk)


def test_quadrature_matches_closed_forms_everywhere():
    """Two independent methods, t from the deep lower tail across both rule switches."""
    t = torch.cat([torch.linspace(-30, 30, 241), torch.tensor([-3.0, -2.999, 7.999, 8.0, 8.001])])
    t = t.to(torch.float64)
    sigma = torch.full_like(t, 1.7)
    mu = t * sigma
    for k in range(4):
        cf = _closed_form(mu, sigma, k)
        q = _quadrature_moments(mu, sigma, [float(k)])[0]
        keep = cf > 1e-280
        rel = ((q - cf).abs() / cf)[keep]
        assert rel.max().item() <= 1e-8, k


def test_quadrature_obeys_recurrence():
    """J_b = t J_(b-1) + (b-1) J_(b-2) (integration by parts) at non-integer b."""
    t = torch.linspace(-6, 12, 73, dtype=torch.float64)
    one = torch.ones_like(t)
    for b in [2.5, 3.25, 4.0 + 1.0 / 3.0]:
        jb, jb1, jb2 = _quadrature_moments(t, one, [b, b - 1.0, b - 2.0])
        rhs = t * jb1 + (b - 1.0) * jb2
        assert torch.allclose(jb, rhs, rtol=1e-9, atol=1e-300), b


@pytest.mark.parametrize("beta", [0.5, 1.0, 4.0 / 3.0, 2.0, 3.0, 4.0])
def test_derivative_identity(beta):
    """d/dmu E[Y_+^b] = b E[Y_+^(b-1)]: the identity the tau solver differentiates with.

    (b = 0 is excluded: the derivative of Phi is a density, not a moment.)
    """
    mu = torch.linspace(-3, 3, 13, dtype=torch.float64)
    sigma = torch.full_like(mu, 0.8)
    h = 1e-5
    up = truncated_power_moment(mu + h, sigma, beta)
    down = truncated_power_moment(mu - h, sigma, beta)
    fd = (up - down) / (2 * h)
    exact = beta * truncated_power_moment(mu, sigma, beta - 1.0)
    assert torch.allclose(fd, exact, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 2.0, 3.0, 4.0])
def test_sigma_zero(beta):
    mu = torch.tensor([-1.5, 0.0, 0.3, 2.0], dtype=torch.float64)
    zero = torch.zeros_like(mu)
    got = truncated_power_moment(mu, zero, beta)
    expected = (mu > 0).double() if beta == 0 else mu.clamp_min(0).pow(beta)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)
    # continuous in sigma away from mu = 0
    near = truncated_power_moment(mu, torch.full_like(mu, 1e-9), beta)
    off = mu != 0
    assert torch.allclose(near[off], expected[off], rtol=1e-6, atol=1e-12)


def test_moment_shapes_and_dtypes():
    mu = torch.randn(3, 1, 4)
    sigma = torch.rand(5, 1)
    for beta in [2.0, 0.7]:
        out = truncated_power_moment(mu, sigma, beta)
        assert out.shape == (3, 5, 4) and out.dtype == torch.float32
        ref = truncated_power_moment(mu.double(), sigma.double(), beta)
        assert ref.dtype == torch.float64
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-7)
    assert truncated_power_moment(mu.half(), sigma.half(), 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="beta"):
        truncated_power_moment(mu, sigma, -1.0)


# ---------------------------------------------------------------- tau_hat


def random_pages(rows, pages, seed, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(rows, pages, generator=g, dtype=torch.float64) * scale
    sigma = torch.rand(rows, pages, generator=g, dtype=torch.float64) * scale
    w = torch.randint(0, 17, (rows, pages), generator=g).to(torch.float64)
    w[:, 0] = 16  # at least one page present
    sigma[:, 1::5] = 0.0  # some pages hold identical scores
    return mu.to(dtype), sigma.to(dtype), w.to(dtype)


@pytest.mark.parametrize(
    "alpha", [1.25, 4.0 / 3.0, 1.5, 1.75, 2.0, 3.0], ids=lambda a: f"alpha={a:.3g}"
)
def test_tau_hat_solves_its_equation(alpha):
    for pages, scale, seed in [(1, 1.0, 0), (7, 1.0, 1), (300, 0.3, 2), (300, 5.0, 3)]:
        mu, sigma, w = random_pages(4, pages, seed, scale)
        tau = solve_tau_hat(mu, sigma, w, alpha)
        assert tau.shape == (4,) and tau.dtype == torch.float64
        assert moment_mixture_residual(mu, sigma, w, alpha, tau).abs().max().item() <= 1e-9
        tau32 = solve_tau_hat(mu.float(), sigma.float(), w.float(), alpha)
        assert tau32.dtype == torch.float32
        assert moment_mixture_residual(mu, sigma, w, alpha, tau32).abs().max().item() <= 1e-4


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_tau_hat_iterations_matter(alpha):
    mu, sigma, w = random_pages(4, 50, 5, 2.0)
    good = solve_tau_hat(mu, sigma, w, alpha)
    assert moment_mixture_residual(mu, sigma, w, alpha, good).abs().max().item() <= 1e-9
    rough = solve_tau_hat(mu, sigma, w, alpha, iters=1)
    assert moment_mixture_residual(mu, sigma, w, alpha, rough).abs().max().item() > 1e-6


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_tau_hat_with_zero_sigma_is_exact_entmax(alpha):
    """All sigma = 0: page p is w_p identical tokens, so tau_hat is the exact threshold."""
    g = torch.Generator().manual_seed(11)
    mu = torch.randn(40, generator=g, dtype=torch.float64)
    w = torch.randint(0, 17, (40,), generator=g)
    tau_hat = solve_tau_hat(mu, torch.zeros_like(mu), w.double(), alpha)
    tau, _ = entmax_threshold(torch.repeat_interleave(mu, w), alpha)
    assert abs(tau_hat.item() - tau.item()) <= 1e-12


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_tau_hat_matches_sampled_threshold(alpha):
    """tau_hat vs the exact entmax threshold of scores sampled from the page model.

    sum_j g(s_j; tau) has standard deviation sd = sqrt(sum_p w_p Var g(S_p))
    (Var g = E[Y_+^(2 beta)] - E[Y_+^beta]^2), so the sampled threshold lies
    within ~sd / |dF/dtau| of tau_hat; the test allows 5 of those.
    """
    g = torch.Generator().manual_seed(21)
    pages, size = 2048, 16
    # score scale per alpha so that the support holds many tokens
    scale = {1.0: 0.3, 1.25: 0.3, 1.5: 0.05, 2.0: 0.02}[alpha]
    mu = torch.randn(pages, generator=g, dtype=torch.float64) * 0.5 * scale
    sigma = (0.5 + torch.rand(pages, generator=g, dtype=torch.float64)) * scale
    w = torch.full((pages,), float(size), dtype=torch.float64)
    tau_hat = solve_tau_hat(mu, sigma, w, alpha).item()
    noise = torch.randn(pages, size, generator=g, dtype=torch.float64)
    scores = mu[:, None] + sigma[:, None] * noise
    tau_mc, support = entmax_threshold(scores.reshape(-1), alpha)
    if alpha == 1.0:
        # F(tau) = sum e^(s - tau), dF/dtau = -F = -1 at the root, and
        # Var e^S = e^(2 mu + 2 sigma^2) - e^(2 mu + sigma^2)
        var = (w * (torch.exp(2 * mu + 2 * sigma**2) - torch.exp(2 * mu + sigma**2))).sum()
        slope = 1.0
        var = var / math.exp(2 * tau_hat)
    else:
        a, beta = alpha - 1.0, 1.0 / (alpha - 1.0)
        ym, ys = a * mu - tau_hat, a * sigma
        m1 = truncated_power_moment(ym, ys, beta)
        m2 = truncated_power_moment(ym, ys, 2 * beta)
        var = (w * (m2 - m1 * m1)).sum()
        slope = (beta * w * truncated_power_moment(ym, ys, beta - 1.0)).sum().item()
        assert support.item() > 50  # a real distribution, not a handful of tokens
    tol = 5 * math.sqrt(var.item()) / slope
    assert tol < 0.02  # sharp enough to mean something (tau_hat ranges over ~0.1..11 here)
    assert abs(tau_mc.item() - tau_hat) <= tol


def test_tau_hat_softmax_closed_form():
    mu, sigma, w = random_pages(3, 20, 8)
    tau = solve_tau_hat(mu, sigma, w, 1.0)
    expected = torch.log((w * torch.exp(mu + sigma**2 / 2)).sum(-1))
    assert torch.allclose(tau, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_absent_pages_and_empty_rows(alpha):
    mu, sigma, w = random_pages(3, 12, 9)
    base = solve_tau_hat(mu, sigma, w, alpha)
    # absent pages (weight 0) may carry anything, even inf/NaN
    junk_mu = torch.tensor([[1e30, math.inf, math.nan]] * 3, dtype=torch.float64)
    junk_sigma = torch.tensor([[5.0, math.nan, math.inf]] * 3, dtype=torch.float64)
    padded = solve_tau_hat(
        torch.cat([mu, junk_mu], -1),
        torch.cat([sigma, junk_sigma], -1),
        torch.cat([w, torch.zeros(3, 3, dtype=w.dtype)], -1),
        alpha,
    )
    assert torch.allclose(padded, base, atol=1e-12, rtol=0)
    # a row with no page at all gives +inf (and no NaN elsewhere)
    w2 = w.clone()
    w2[1] = 0
    tau = solve_tau_hat(mu, sigma, w2, alpha)
    assert tau[1].item() == math.inf
    assert torch.allclose(tau[[0, 2]], base[[0, 2]], atol=1e-12, rtol=0)
    mu_g, sigma_g, n = pooled_moments(mu, sigma, w2)
    assert n[1].item() == 0 and mu_g[1].item() == 0 and sigma_g[1].item() == 0
    pooled = solve_tau_hat(mu_g[..., None], sigma_g[..., None], n[..., None], alpha)
    assert pooled[1].item() == math.inf and torch.isfinite(pooled[[0, 2]]).all()


def test_pooled_moments_are_token_weighted():
    mu, sigma, w = random_pages(2, 9, 13)
    mu_g, sigma_g, n = pooled_moments(mu, sigma, w)
    for r in range(2):
        counts = w[r].long()
        # expand to tokens: a token of page p has mean mu_p and variance sigma_p^2
        tok_mu = torch.repeat_interleave(mu[r], counts)
        tok_var = torch.repeat_interleave(sigma[r] ** 2, counts)
        assert n[r].item() == counts.sum().item()
        assert abs(mu_g[r].item() - tok_mu.mean().item()) <= 1e-12
        total_var = tok_var.mean() + tok_mu.var(unbiased=False)  # law of total variance
        assert abs(sigma_g[r].item() ** 2 - total_var.item()) <= 1e-12
    # and against a simulated mixture
    g = torch.Generator().manual_seed(3)
    counts = w[0].long()
    reps = counts * 20000
    noise = torch.randn(int(reps.sum()), generator=g, dtype=torch.float64)
    draws = torch.repeat_interleave(mu[0], reps) + torch.repeat_interleave(sigma[0], reps) * noise
    se = draws.std().item() / math.sqrt(draws.numel())
    assert abs(draws.mean().item() - mu_g[0].item()) <= 5 * se
    assert abs(draws.std().item() - sigma_g[0].item()) <= 0.01 * sigma_g[0].item()


@pytest.mark.parametrize("alpha", [1.0, 4.0 / 3.0, 1.5, 1.75, 2.0], ids=lambda a: f"alpha={a:.3g}")
def test_pooled_equals_mixture_when_they_coincide(alpha):
    # a single page
    mu, sigma, w = random_pages(5, 1, 17)
    mu_g, sigma_g, n = pooled_moments(mu, sigma, w)
    assert torch.equal(mu_g, mu[:, 0]) and torch.allclose(sigma_g, sigma[:, 0], atol=1e-15, rtol=0)
    assert torch.equal(n, w[:, 0])
    pooled = solve_tau_hat(mu_g[:, None], sigma_g[:, None], n[:, None], alpha)
    mixture = solve_tau_hat(mu, sigma, w, alpha)
    assert torch.allclose(pooled, mixture, atol=1e-12, rtol=0)
    # many identical pages: the mixture is that one Gaussian again
    mu_r = mu.expand(5, 30).contiguous()
    sigma_r = sigma.expand(5, 30).contiguous()
    w_r = torch.full_like(mu_r, 16.0)
    mu_g, sigma_g, n = pooled_moments(mu_r, sigma_r, w_r)
    pooled = solve_tau_hat(mu_g[:, None], sigma_g[:, None], n[:, None], alpha)
    assert torch.allclose(pooled, solve_tau_hat(mu_r, sigma_r, w_r, alpha), atol=1e-10, rtol=0)


def test_tau_hat_runs_on_meta_tensors():
    """No .item() or value-dependent branching (CPU stand-in for CUDA-graph safety)."""
    m = torch.empty(2, 3, 40, device="meta")
    for alpha in [1.0, 1.5, 1.75, 3.0]:
        out = solve_tau_hat(m, m, m, alpha)
        assert out.shape == (2, 3) and out.device.type == "meta"
    for beta in [2.0, 0.7]:
        assert truncated_power_moment(m, m, beta).shape == m.shape
    assert pooled_moments(m, m, m)[0].shape == (2, 3)


def test_tau_hat_validation():
    mu, sigma, w = random_pages(1, 3, 0)
    for bad in [0.5, math.nan]:
        with pytest.raises(ValueError, match="alpha"):
            solve_tau_hat(mu, sigma, w, bad)


# ---------------------------------------------------------------- tau_hat near softmax and up to ALPHA_MAX


def _mp_page_mass(mp, v, s, a):
    """E[(1 + a (v + s Z))_+^(1/a)], Z ~ N(0, 1), by mpmath quadrature (tanh-sinh).

    The integrand peaks at z* with a s z*^2 + (1 + a v) z* - s = 0 and has
    unit-or-narrower width there, so [z* - 60, z* + 60] (cut at the kink)
    holds all of it to far below float64 precision.
    """
    v, s, a = mp.mpf(v), mp.mpf(s), mp.mpf(a)
    m = 1 + a * v
    if s == 0:
        return m ** (1 / a) if m > 0 else mp.mpf(0)
    root = mp.sqrt(m * m + 4 * a * s * s)
    z_peak = 2 * s / (m + root) if m > 0 else (root - m) / (2 * a * s)

    def f(z):
        y = m + a * s * z
        return mp.exp(mp.log(y) / a - z * z / 2) if y > 0 else mp.mpf(0)

    left = max(-m / (a * s), z_peak - 60)
    return mp.quad(f, [left, z_peak, z_peak + 60]) / mp.sqrt(2 * mp.pi)


def _mp_log_mass(mp, mu, sigma, w, alpha, tau):
    """log sum_p w_p E[((alpha-1) S_p - tau)_+^beta], S_p ~ N(mu_p, sigma_p^2), in mpmath.

    Written with lambda = (tau + 1) / (alpha - 1), so that (alpha-1) S - tau =
    1 + (alpha-1) (S - lambda): alpha - 1 = 1e-9 keeps its digits.
    """
    a = mp.mpf(alpha) - 1
    lam = (mp.mpf(tau) + 1) / a
    total = mp.fsum(mp.mpf(wi) * _mp_page_mass(mp, mi - lam, si, a) for mi, si, wi in zip(mu, sigma, w) if wi > 0)
    return mp.log(total)


TRUTH_ALPHAS = [1 + 1e-9, 1.0001, 1.005, 1.0057, 1.02, 1.25, 1.5, 1.7, 2.0, 2.5, 3.0, 4.0]


@pytest.mark.parametrize("alpha", TRUTH_ALPHAS, ids=lambda a: f"alpha={a:.10g}")
def test_tau_hat_matches_high_precision_truth(alpha):
    """tau_hat (float64 and float32) against a 30-digit mpmath evaluation of its
    equation: the log of the mixture's mass at the returned tau must vanish.

    log mass has slope -S1 / S0 = O(1 .. 10) in lambda = (tau + 1) / (alpha - 1),
    and tau itself carries an absolute rounding error of eps (|tau| ~ 1 near
    softmax), i.e. eps / (alpha - 1) in lambda: the tolerance is that
    representational floor (times a small factor) plus 1e-11.
    """
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 30
    g = torch.Generator().manual_seed(int(alpha * 1e6) % 1000)
    for scale in [0.5, 3.0]:
        mu = torch.randn(5, generator=g, dtype=F64) * scale
        sigma = torch.rand(5, generator=g, dtype=F64) * scale
        sigma[3] = 0.0  # one page of identical scores
        w = torch.randint(1, 17, (5,), generator=g).to(F64)
        args = (mu.tolist(), sigma.tolist(), w.tolist(), alpha)
        a = alpha - 1.0
        for dtype, eps in [(F64, 2.0**-52), (torch.float32, 2.0**-23)]:
            tau = solve_tau_hat(mu.to(dtype), sigma.to(dtype), w.to(dtype), alpha)
            assert tau.dtype == dtype and torch.isfinite(tau)
            tau = tau.item()
            resid = abs(float(_mp_log_mass(mp, *args, tau)))
            floor = 16 * eps * (1 + abs(tau)) / a * (1 + scale)
            tol = floor + (1e-11 if dtype == F64 else 1e-5)
            assert resid <= tol, (scale, dtype, tau, resid, tol)


@pytest.mark.parametrize("alpha", [1 + 2.0**-33, 1 + 1e-9, 1.0001, 1.001, 1.003, 1.0057, 1.00579])
def test_no_overflow_just_above_softmax(alpha):
    """1 < alpha < 1.0058 made math.gamma((beta + 1) / 2) overflow a Python float
    (OverflowError); every dtype and shape now gives a finite tau_hat, with
    lambda = (tau + 1) / (alpha - 1) near the softmax value
    logsumexp(log w + mu + sigma^2 / 2) (they differ by O((alpha - 1) x^2))."""
    mu, sigma, w = random_pages(3, 40, 31)
    expected = torch.logsumexp(torch.where(w > 0, w.log() + mu + sigma**2 / 2, -math.inf), -1)
    for dtype in [F64, torch.float32]:
        tau = solve_tau_hat(mu.to(dtype), sigma.to(dtype), w.to(dtype), alpha)
        assert torch.isfinite(tau).all()
        if dtype == F64:
            lam = (tau + 1.0) / (alpha - 1.0)
            # second-order term of the entmax map: (alpha - 1) times O(score^2 + sigma^4)
            # here, plus tau's own rounding (eps absolute) seen through 1 / (alpha - 1)
            floor = 8 * 2.0**-52 * (1 + tau.abs().max().item()) / (alpha - 1.0)
            assert (lam - expected).abs().max().item() <= 1e-10 + 200 * (alpha - 1.0) + floor
        # E[(1 + a S)_+^(1/a)] -> E[e^S] = e^(mu + sigma^2 / 2) as a -> 0; float32
        # rounds 1 + a mu to 1 (the solver keeps those digits in log1p form)
        a = alpha - 1.0
        m = truncated_power_moment((1.0 + a * mu).to(dtype), (a * sigma).to(dtype), 1.0 / a)
        assert torch.isfinite(m).all()
        if dtype == F64:
            assert torch.allclose(m, torch.exp(mu + sigma**2 / 2), rtol=1e-5 + 200 * a, atol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.7, 2.5, 4.0])
def test_tiny_sigma_is_zero_sigma(alpha):
    """A spread no exponent resolves (float32 sigma 1e-30 made mu / sigma overflow,
    NaN moments) and a zero-sigma page on the bracket's kink (the solver used to
    stall there) both give the exact threshold of the repeated scores."""
    mu = torch.tensor([0.0, -3.0, 5.0, -40.0], dtype=F64)
    w = torch.tensor([16.0, 16.0, 3.0, 16.0], dtype=F64)
    tau, _ = entmax_threshold(torch.repeat_interleave(mu, w.long()), alpha)
    for dtype in [F64, torch.float32]:
        for s in [0.0, 1e-30, 1e-12, 1e-9]:
            got = solve_tau_hat(mu.to(dtype), torch.full((4,), s, dtype=dtype), w.to(dtype), alpha)
            assert abs(got.item() - tau.item()) <= (1e-12 if dtype == F64 else 4e-7) * (1 + abs(tau.item())), (dtype, s)
