"""Gaussian selection kernels (statistics, tau-hat iteration, select) against the reference."""
from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Gaussian  # noqa: E402
from entmaxkv import policies as RP  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.kernels import GaussianConfig, KernelConfig  # noqa: E402
from entmaxkv.testing import page_sets, tau_hat_oracle  # noqa: E402
from entmaxkv.testing import random_case as case  # noqa: E402

gk = importlib.import_module("entmaxkv.kernels.gaussian.plan")
GC = GaussianConfig()

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("alpha,pooled,per_q,slopes", [
    (1.5, False, False, False), (2.0, False, False, True), (4.0 / 3.0, False, True, True),
    (1.5, True, False, True), (1.25, False, False, False),
    (1.0001, False, False, True), (1.0001, True, True, False),
], ids=["a1.5", "a2-alibi", "a4/3-per-q", "a1.5-pooled", "a1.25-reference-path",
        "a1.0001-reference-path", "a1.0001-pooled-per-q"])
def test_gaussian_select(alpha, pooled, per_q, slopes):
    _check_gaussian_select(alpha, pooled, per_q, slopes)


@pytest.mark.parametrize("pooled", [False, True], ids=["iterated", "pooled"])
def test_gaussian_select_short_stats_chunks(pooled):
    """The stats and selection launches cut into more chunks than the
    iteration launches (as on a GPU with few rows, and as sel_ch does on
    long rows): the partial statistics still merge right and every page is
    tested once."""
    # (and selection chunks shorter than the partials' chunks)
    c = GaussianConfig(min_ch=16, stats_tune=(True, 16, 4, None, 4096), sel_ch=32)
    cfg = gk.gauss_plan(c, 113, 2, 16, torch.float32, torch.float32, rows=4, sms=4)
    assert cfg["NCS"] > cfg["NCH"]
    _check_gaussian_select(1.5, pooled, False, True, c=c)


@pytest.mark.parametrize("slopes", [True, False], ids=["alibi", "iid"])
def test_gaussian_select_several_blocks_per_chunk(slopes, launches):
    """Iteration chunks of several blocks (each block's mu, sigma loaded
    while the previous one is used, the last prefetch masked off): every
    block is summed once, with its own pages."""
    c = GaussianConfig(iter_block=16)
    cfg = gk.gauss_plan(c, 113, 2, 16, torch.float32, torch.float32, rows=4, sms=4)
    assert cfg["CH"] >= 64  # so the iteration launches loop over >= 4 blocks
    _check_gaussian_select(1.5, False, False, slopes, c=c)
    iters = [k for n, _, k, _ in launches if n == "_gauss_iter_kernel"]
    assert len(iters) == c.nit and all(k["BLOCK"] == 16 and k["CH"] >= 64 for k in iters)


@pytest.mark.parametrize("B,H,n,ch", [
    (8, 24, 1 << 20, 8192),  # paper 8 x 1M: 192 rows >= SMs, 8 chunks of 8192 pages
    (8, 24, 1 << 19, 8192),
    (8, 24, 1 << 17, 4096),  # one 8192-page chunk per row would leave 192 programs < 1.5 per SM
    (8, 24, 1 << 15, 1024),
    (1, 24, 1 << 21, 4096),  # 1 x 2M: 24 rows < SMs keep 4096-page chunks
], ids=["8x1M", "8x512k", "8x128k", "8x32k", "1x2M"])
def test_gaussian_iteration_chunks_by_rows(B, H, n, ch):
    """The GPU plan of the iteration chunks (interpreter cap off): the
    longest chunk of max_ch_many / max_ch_few (by rows) that keeps
    iter_per_sm programs per SM, on an H200's 132 SMs."""
    M = n // 16
    cfg = gk.gauss_plan(GC, M, 1, 32, torch.float16, torch.float16, rows=B * H, sms=132, interpreted=False)
    assert cfg["CH"] == ch and cfg["NCH"] == -(-M // ch)
    assert B * H * cfg["NCH"] >= GC.iter_per_sm * 132 or ch == 1024


@pytest.mark.parametrize("G,D,dtype,prefetch", [
    (1, 24, torch.float16, False), (1, 24, torch.float16, True), (2, 40, torch.float32, True),
    (4, 16, torch.bfloat16, False),
], ids=["mha-f16", "mha-f16-prefetch", "g2-f32-prefetch", "gqa4-bf16-dot"])
def test_gaussian_stats_blocks(G, D, dtype, prefetch):
    """The stats launch with 16-page blocks (several per chunk), on the
    elementwise path loading each block's page ids and moments one block
    ahead or not, and on the tl.dot path: every block must be reduced with
    its own pages (tau_hat against the oracle, pages by the definition)."""
    c = GaussianConfig(stats_tune=(prefetch, 16, 4, None, 1 << 16), dot_stats_tune=(16, 4, None, 1 << 16), min_ch=32)
    cfg = gk.gauss_plan(c, 113, G, D, dtype, dtype, rows=3, sms=4)
    assert cfg["SNSUB"] >= 2 and cfg["SBLOCK_M"] == 16 and cfg["SPREFETCH"] == (prefetch and G < 3)
    _check_gaussian_select(1.5, False, False, True, H=3, G=G, D=D, dtype=dtype, c=c)


@pytest.mark.parametrize("H,D,dtype,alpha,pooled,slopes", [
    (3, 24, torch.float16, 1.5, False, True), (4, 16, torch.float32, 2.0, False, False),
    (5, 40, torch.bfloat16, 4.0 / 3.0, True, True),
], ids=["h3-f16-a1.5-alibi", "h4-f32-a2", "h5-bf16-a4/3-pooled-alibi"])
def test_gaussian_select_one_query_head_per_kv_head(H, D, dtype, alpha, pooled, slopes):
    """MHA (G = 1), odd head counts and dims, half-precision caches: tau_hat
    and the pages by the definition."""
    _check_gaussian_select(alpha, pooled, False, slopes, H=H, G=1, D=D, dtype=dtype)


def test_gaussian_select_unpacked_statistics():
    """k_mean / k_std as separate tensors (not views of k_moments, e.g. built
    by another framework): the same selection as the packed cache."""
    cache, ids, q, sl = case([500, 61], 3, 1, 16, 8, torch.float16, seed=12, slopes=True)
    pol = Gaussian(q_max=0.99, margin=0.05, sinks=1)
    want = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    cache.k_mean = cache.k_mean.clone()
    cache.k_std = cache.k_std.clone()
    assert cache.k_std.data_ptr() - cache.k_mean.data_ptr() != 16 * 2  # really unpacked
    got = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    assert torch.equal(got.tau_hat, want.tau_hat)
    assert page_sets(got) == page_sets(want)


@pytest.mark.parametrize("slopes", [False, True], ids=["iid", "alibi"])
def test_gaussian_converged_launches_forward_the_state(slopes):
    """Once a Halley step is below conv_tol the later iteration launches skip
    their pages: tau_hat must equal (to float32 rounding) the solve that never
    stops early, itself within 1e-4 of the float64 oracle."""
    cache, ids, q, sl = case([3000, 700], 2, 1, 16, 4, torch.float32, seed=21, slopes=slopes)
    pol = Gaussian(q_max=0.99, margin=0.05, sinks=1)
    early = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl)
    never = KernelConfig(gaussian=GaussianConfig(conv_tol=0.0, nit=8))
    full = K.select(pol, q, cache, ids, alpha=1.5, scale=0.3, slopes=sl, config=never)
    rel = (early.tau_hat.double() - full.tau_hat.double()).abs() / full.tau_hat.double().abs()
    assert rel.max().item() <= 2.4e-7, rel.max().item()
    oracle = tau_hat_oracle(q, cache, ids, scale=0.3, slopes=sl, alpha=1.5, pooled=False)
    assert (early.tau_hat.double() - oracle).abs().max() < 1e-4


def _check_gaussian_select(alpha, pooled, per_q, slopes, H=2, G=2, D=16, dtype=torch.float32, c=GC):
    lens = [300, 900, 9]
    cache, ids, q, sl = case(lens, H, G, D, 8, dtype, seed=7, slopes=slopes)
    pol = Gaussian(q_max=0.99, margin=0.05, pooled=pooled, sinks=1, per_query_head=per_q)
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=0.3, slopes=sl, config=KernelConfig(gaussian=c))
    oracle = tau_hat_oracle(q, cache, ids, scale=0.3, slopes=sl, alpha=alpha, pooled=pooled)
    assert (sel.tau_hat.double() - oracle).abs().max() < 1e-4
    # the kept pages follow the definition, evaluated at the kernel's tau_hat
    mu, sg, n = RS.gaussian_stats(q, cache, ids, scale=0.3, slopes=sl)
    z = RP.normal_icdf(torch.tensor(0.99, dtype=mu.dtype) ** (1.0 / n.clamp(min=1)))
    crit = (alpha - 1) * (mu + z[:, None, :] * sg) - (sel.tau_hat[..., None] - 0.05)
    S = sel.pages.shape[1]
    got = page_sets(sel)
    for b, n_b in enumerate(lens):
        npages = -(-n_b // 8)
        for s in range(S):
            heads = [s] if per_q else list(range(G * s, G * s + G))
            c = crit[b, heads, :npages].amax(0)
            sure_in = {int(p) for p in (c > 1e-4).nonzero().flatten()} | {0, npages - 1}
            maybe = {int(p) for p in (c.abs() <= 1e-4).nonzero().flatten()}
            assert sure_in <= got[b][s] <= sure_in | maybe


