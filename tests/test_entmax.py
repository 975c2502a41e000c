"""Tests for entmaxkv.entmax: thresholds, probabilities and gradients.

The `entmax` PyPI package is the independent oracle (its sort-based
sparsemax / entmax15 and its bisection entmax_bisect). It does not handle
-inf, so masked rows are compared on their unmasked entries only.
"""
import math

import entmax as oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entmaxkv.entmax import (
    _threshold_impl,
    entmax,
    entmax15,
    entmax_from_tau,
    entmax_threshold,
    sparsemax,
)

ALPHAS = [1.25, 4.0 / 3.0, 1.5, 2.0, 3.0]
NEG_INF = float("-inf")


def oracle_entmax(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The package's entmax along the last dim of a float64 [rows, n] tensor, -inf aware."""
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        keep = x[r] > NEG_INF
        if not keep.any():
            continue
        row = x[r, keep][None]
        if alpha == 2.0:
            p = oracle.sparsemax(row, dim=-1)
        elif alpha == 1.5:
            p = oracle.entmax15(row, dim=-1)
        else:
            p = oracle.entmax_bisect(row, alpha, dim=-1, n_iter=80)
        out[r, keep] = p[0]
    return out


def make_rows(kind: str, n: int, rows: int = 6, seed: int = 0) -> torch.Tensor:
    """float64 [rows, n] score rows of a named family."""
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(rows, n, generator=g, dtype=torch.float64)
    if kind == "peaked":  # one entry far above the rest: support of size 1
        x[:, n // 2] = 1e3
    elif kind == "tied":  # few distinct values, many repeats (ties at the threshold)
        x = torch.randint(0, 3, (rows, n), generator=g).to(torch.float64) * 0.5
    elif kind == "masked":  # ~60% -inf, and the first row keeps a single entry
        drop = torch.rand(rows, n, generator=g) < 0.6
        x = x.masked_fill(drop, NEG_INF)
        x[0] = NEG_INF
        x[0, n - 1] = 0.3
    return x


# ---------------------------------------------------------------- oracle agreement


@pytest.mark.parametrize("kind", ["random", "peaked", "tied", "masked"])
@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"alpha={a:.3g}")
def test_matches_entmax_package(alpha, kind):
    for n in [1, 2, 7, 63, 1001]:
        x = make_rows(kind, n, seed=n)
        p = entmax(x, alpha)
        ref = oracle_entmax(x, alpha)
        assert p.dtype == torch.float64 and p.shape == x.shape
        assert (p - ref).abs().max().item() <= 1e-6, (n, kind)
        # exact zeros where the oracle has them, and exact zeros on masked entries
        assert (p[ref == 0] == 0).all()
        assert (p[x == NEG_INF] == 0).all()
        expected_sum = (x > NEG_INF).any(-1).to(x.dtype)  # all-masked rows sum to 0
        assert torch.allclose(p.sum(-1), expected_sum, atol=1e-12, rtol=0)
    # the families are not vacuous: long random rows do have zeros
    if kind == "random":
        assert (entmax(make_rows(kind, 1001), alpha) == 0).any()


def test_named_variants_match_package():
    x = make_rows("random", 257)
    assert torch.allclose(sparsemax(x), oracle.sparsemax(x, dim=-1), atol=1e-12, rtol=0)
    assert torch.allclose(entmax15(x), oracle.entmax15(x, dim=-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_any_dim(alpha, dim):
    x = torch.randn(5, 6, 7, dtype=torch.float64) * 3
    p = entmax(x, alpha, dim=dim)
    tau, support = entmax_threshold(x, alpha, dim=dim)
    # reference: move the dim last, solve, move back
    xl = x.movedim(dim, -1)
    ref = entmax(xl.reshape(-1, xl.shape[-1]), alpha).reshape(xl.shape).movedim(-1, dim)
    tau_ref, _ = entmax_threshold(xl, alpha)
    # (equal up to summation order: a strided reduction may round differently)
    assert torch.allclose(p, ref, atol=1e-14, rtol=0)
    assert tau.shape == tau_ref.shape and torch.allclose(tau, tau_ref, atol=1e-13, rtol=0)
    assert support.shape == tau.shape and support.dtype == torch.int64
    assert torch.allclose(p.sum(dim), torch.ones_like(tau), atol=1e-12)


def test_softmax_is_torch_softmax():
    x = make_rows("masked", 50)
    x = x[1:]  # rows with at least two unmasked entries
    assert torch.allclose(entmax(x, 1.0), torch.softmax(x, -1), atol=1e-15, rtol=0)
    tau, support = entmax_threshold(x, 1.0)
    assert torch.allclose(tau, torch.logsumexp(x, -1), atol=1e-14, rtol=0)
    assert torch.equal(support, (x > NEG_INF).sum(-1))


# ---------------------------------------------------------------- threshold conventions


@pytest.mark.parametrize("alpha", [1.0] + ALPHAS, ids=lambda a: f"alpha={a:.3g}")
def test_threshold_defines_probabilities(alpha):
    x = torch.cat([make_rows("random", 101), make_rows("masked", 101)])
    tau, support = entmax_threshold(x, alpha)
    p = entmax(x, alpha)
    # entmax solves in coordinates shifted by the row max; from tau it is unshifted
    assert torch.allclose(entmax_from_tau(x, tau, alpha), p, atol=1e-13, rtol=0)
    if alpha > 1:
        manual = ((alpha - 1) * x - tau[:, None]).clamp_min(0) ** (1 / (alpha - 1))
        assert torch.allclose(manual, p, atol=1e-14, rtol=0)
        assert torch.equal(support, (p > 0).sum(-1))
        # the spec bracket: tau in [m - 1, m - n^(1-alpha)]
        m = ((alpha - 1) * x).amax(-1)
        n = (x > NEG_INF).sum(-1).to(x.dtype)
        assert (tau >= m - 1 - 1e-12).all() and (tau <= m - n ** (1 - alpha) + 1e-12).all()


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0], ids=lambda a: f"alpha={a}")
def test_fully_masked_rows(alpha):
    x = make_rows("random", 9, rows=4)
    x[1] = NEG_INF
    x[3] = NEG_INF
    xr = x.clone().requires_grad_(True)
    p = entmax(xr, alpha)
    tau, support = entmax_threshold(x, alpha)
    assert torch.equal(p[1], torch.zeros(9, dtype=x.dtype)) and torch.equal(p[3], p[1])
    assert tau[1].item() == math.inf and tau[3].item() == math.inf
    assert support[1].item() == 0 and support[3].item() == 0
    assert torch.isfinite(tau[[0, 2]]).all()
    assert torch.allclose(p[[0, 2]], entmax(x[[0, 2]], alpha), atol=0, rtol=0)
    assert torch.equal(entmax_from_tau(x, tau, alpha)[1], torch.zeros(9, dtype=x.dtype))
    (p * torch.randn_like(p)).sum().backward()
    assert torch.isfinite(xr.grad).all() and (xr.grad[1] == 0).all()
    # zero-length rows: +inf threshold, empty support
    tau0, s0 = entmax_threshold(torch.zeros(3, 0), alpha)
    assert tau0.shape == (3,) and (tau0 == math.inf).all() and (s0 == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_half_precision_inputs_solve_in_float32(alpha, dtype):
    x = (make_rows("random", 300) * 2).to(dtype)
    p = entmax(x, alpha)
    tau, _ = entmax_threshold(x, alpha)
    assert p.dtype == dtype and tau.dtype == torch.float32
    # the solve is float32 on the rounded scores, not a half-precision solve
    tau32, _ = entmax_threshold(x.float(), alpha)
    assert torch.equal(tau, tau32)
    assert torch.equal(p, entmax(x.float(), alpha).to(dtype))
    ref = entmax(x.double(), alpha)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    assert (p.double() - ref).abs().max().item() <= tol * ref.max().item()
    assert (p[ref == 0] == 0).all()


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_float32_long_rows(alpha):
    """The shifted, polished solve keeps float32 accurate on 2^17-entry rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1 << 17, generator=g, dtype=torch.float64) * 4 + 30
    p32 = entmax(x.float(), alpha)
    p64 = entmax(x, alpha)
    assert (p32.double() - p64).abs().max().item() <= 1e-6
    assert (p32.double().sum(-1) - 1).abs().max().item() <= 1e-5


def test_float32_sort_path_is_polished():
    """entmax-1.5's float32 cumulative sums lose digits over a 2^17-entry support;
    the final Newton re-solve on the detected support recovers them."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 1 << 17, generator=g) * 0.01 + 5).float()
    p = entmax(x, 1.5).double()
    ref = entmax(x.double(), 1.5)  # same (rounded) inputs, float64 solve
    assert (ref > 0).sum(-1).min().item() > 40_000  # long supports
    assert (p - ref).abs().max().item() <= 1e-10  # 4.5e-11; 3.4e-10 without the re-solve
    assert (p.sum(-1) - 1).abs().max().item() <= 8e-7  # 3.0e-7; 2.9e-6 without it


# ---------------------------------------------------------------- solvers agree


@pytest.mark.parametrize("alpha", [1.5, 2.0], ids=lambda a: f"alpha={a}")
@pytest.mark.parametrize("kind", ["random", "peaked", "tied", "masked"])
def test_sort_and_halley_agree(alpha, kind):
    x = make_rows(kind, 501) * (alpha - 1)
    tau_s, sup_s = _threshold_impl(x, alpha, method="sort")
    tau_h, sup_h = _threshold_impl(x, alpha, method="halley")
    assert torch.allclose(tau_s, tau_h, atol=1e-12, rtol=0)
    if kind != "tied":  # ties sit exactly at the threshold: count may differ by the tie
        assert torch.equal(sup_s, sup_h)
    ts32, _ = _threshold_impl(x.float(), alpha, method="sort")
    th32, _ = _threshold_impl(x.float(), alpha, method="halley")
    fin = torch.isfinite(tau_s)
    assert torch.allclose(ts32[fin].double(), tau_s[fin], atol=2e-6, rtol=0)
    assert torch.allclose(th32[fin].double(), tau_s[fin], atol=2e-6, rtol=0)


def test_sort_method_rejects_other_alpha():
    with pytest.raises(ValueError, match="alpha"):
        _threshold_impl(torch.randn(3, 4), 1.25, method="sort")


@pytest.mark.parametrize("alpha", [1.1, 1.25, 4.0 / 3.0, 1.75, 3.0], ids=lambda a: f"alpha={a:.3g}")
def test_warm_start_converges_to_same_tau(alpha):
    x = torch.cat([make_rows("random", 400), make_rows("tied", 400), make_rows("masked", 400)])
    tau, support = entmax_threshold(x, alpha)
    fin = torch.isfinite(tau)
    starts = {
        "exact": tau,
        "near": tau + 1e-3,
        "bad-high": tau + 0.3,
        "far-low": tau - 50.0,
        "far-high": tau + 50.0,
        "nan": torch.full_like(tau, math.nan),
        "inf": torch.full_like(tau, math.inf),
    }
    for name, t0 in starts.items():
        t, s = entmax_threshold(x, alpha, tau_init=t0)
        assert torch.equal(torch.isfinite(t), fin), name
        assert torch.allclose(t[fin], tau[fin], atol=1e-12, rtol=0), name
        assert torch.equal(s, support), name


@pytest.mark.parametrize("alpha", [1.25, 3.0], ids=lambda a: f"alpha={a}")
def test_default_iteration_count_converges(alpha):
    """The fixed default count reaches what 200 iterations reach. (Newton on
    log S0 in the log-threshold converges from the bracket's end within the
    final re-solve on these rows, so n_iter=0 is no longer wrong here.)"""
    spaced = -torch.logspace(-8, 1, 1000, dtype=torch.float64)[None]  # scales 1e-8..10
    for x in (make_rows("random", 1001), spaced):
        tau, _ = entmax_threshold(x, alpha)
        tau_long, _ = _threshold_impl(x, alpha, n_iter=200)
        assert torch.allclose(tau, tau_long, atol=1e-14, rtol=0)
        assert (entmax(x, alpha).sum(-1) - 1).abs().max().item() <= 1e-12


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0], ids=lambda a: f"alpha={a}")
def test_gradcheck(alpha):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64) * 2
    x[2, 1] = NEG_INF  # a masked entry has zero gradient
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: entmax(t, alpha, dim=-1), (x,), eps=1e-6, atol=1e-7)
    xt = x.detach().t().contiguous().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: entmax(t, alpha, dim=0), (xt,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0], ids=lambda a: f"alpha={a}")
def test_backward_matches_package(alpha):
    x = make_rows("random", 300)
    dy = torch.randn_like(x)
    xa = x.clone().requires_grad_(True)
    (entmax(xa, alpha) * dy).sum().backward()
    xb = x.clone().requires_grad_(True)
    ref = {2.0: lambda t: oracle.sparsemax(t, -1), 1.5: lambda t: oracle.entmax15(t, -1)}.get(
        alpha, lambda t: oracle.entmax_bisect(t, alpha, -1, n_iter=80)
    )
    (ref(xb) * dy).sum().backward()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-6, rtol=0)


def test_backward_half_precision_is_finite():
    x = torch.randn(4, 64).to(torch.bfloat16).requires_grad_(True)
    entmax(x, 1.5).pow(2).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- validation, no host sync


@pytest.mark.parametrize("bad", [0.5, -1.0, 0.999, math.nan, math.inf])
def test_alpha_validation(bad):
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="alpha"):
        entmax(x, bad)
    with pytest.raises(ValueError, match="alpha"):
        entmax_threshold(x, bad)
    with pytest.raises(ValueError, match="alpha"):
        entmax_from_tau(x, torch.zeros(2), bad)


def test_tensor_alpha_is_refused():
    # a tensor alpha would need a host sync on every call to choose the solver
    with pytest.raises(ValueError, match="alpha"):
        entmax(torch.randn(2, 5), torch.tensor(1.5))


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0], ids=lambda a: f"alpha={a}")
def test_runs_on_meta_tensors(alpha):
    """Meta tensors carry no data: any .item() or value-dependent branch would raise.

    This is the CPU stand-in for "no host synchronisation / CUDA-graph safe".
    """
    x = torch.empty(4, 33, device="meta", requires_grad=True)
    tau, support = entmax_threshold(x, alpha, tau_init=torch.empty(4, device="meta"))
    assert tau.shape == (4,) and tau.device.type == "meta" and support.dtype == torch.int64
    p = entmax(x, alpha)
    p.sum().backward()
    assert x.grad.shape == x.shape
    assert entmax_from_tau(x, tau, alpha).shape == x.shape


# ---------------------------------------------------------------- properties


@st.composite
def score_rows(draw):
    n = draw(st.integers(1, 40))
    vals = draw(
        st.lists(
            st.one_of(st.floats(-30, 30, allow_nan=False), st.just(NEG_INF)),
            min_size=n,
            max_size=n,
        )
    )
    return torch.tensor(vals, dtype=torch.float64)[None]


@settings(max_examples=60, deadline=None)
@given(
    x=score_rows(),
    alpha=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0, 3.0]),
    shift=st.floats(-100, 100),
)
def test_properties(x, alpha, shift):
    p = entmax(x, alpha)
    tau, support = entmax_threshold(x, alpha)
    live = x > NEG_INF
    assert torch.isfinite(p).all() and (p >= 0).all() and (p[~live] == 0).all()
    if not live.any():
        assert (p == 0).all() and tau.item() == math.inf and support.item() == 0
        return
    assert abs(p.sum().item() - 1) <= 1e-9
    # order preserving: a larger score never gets less mass
    xs, order = x[0].sort()
    assert (p[0, order].diff() >= -1e-12).all()
    # shift invariance (tau moves by (alpha-1) * shift, or shift for softmax)
    ps = entmax(x + shift, alpha)
    assert (ps - p).abs().max().item() <= 1e-8
    if alpha > 1:
        assert support.item() == (p > 0).sum().item()
        ref = oracle_entmax(x, alpha)
        assert (p - ref).abs().max().item() <= 1e-6
