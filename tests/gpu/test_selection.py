"""Kernel selections at the benchmark's sizes against the reference policy (GPU only).

On the benchmark's own caches (benchmarks/bench_decode.py CONFIGS, shuffled
block tables, up to 1 x 2M tokens) the Triton top-k must keep exactly the
pages the PyTorch policy keeps (including the pre-filter's long rows), and
the Triton Gaussian tau_hat must match a float64 solve over float64 page
statistics, also when its iteration launches stop early (and against the
same kernels never stopping early). ``ENTMAXKV_GPU_QUICK=1`` checks
paper_32k only (tests/gpu/test_stages.py says how to run these).
"""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks.bench_decode import CONFIGS
from benchmarks.harness import build
from entmaxkv import Gaussian, TopK
from entmaxkv import policies as RP
from entmaxkv.kernels.config import GaussianConfig, KernelConfig
from entmaxkv.testing import gpu_quick, page_sets, tau_hat_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAMES = ["paper_32k"] if gpu_quick() else ["paper_32k", "paper_128k", "paper_b1_2m"]
# relative tau_hat error allowed: float32 tau_hat over float32 page statistics is a few 1e-7 off
TAU_TOL = 2e-6


@pytest.fixture(scope="module", params=NAMES)
def bench_case(request):
    cache, ids, q, k4, v4 = build(CONFIGS[request.param])
    del k4, v4
    yield cache, ids, q, 1 / math.sqrt(q.shape[-1])
    del cache
    torch.cuda.empty_cache()


@pytest.mark.parametrize("pol", [TopK(1024), TopK(4096, sinks=1, window=2)], ids=["k1024", "k4096-sinks-window"])
def test_topk_pages_equal_reference(bench_case, pol):
    from entmaxkv import kernels as K

    cache, ids, q, scale = bench_case
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=scale)
    ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=scale)
    assert torch.equal(sel.counts, ref.counts)
    got, want = page_sets(sel), page_sets(ref)
    bad = sum(g != w for rg, rw in zip(got, want) for g, w in zip(rg, rw))
    assert bad == 0, f"{bad} rows differ"


def test_gaussian_tau_hat(bench_case):
    from entmaxkv import kernels as K

    cache, ids, q, scale = bench_case
    pol = Gaussian()
    sel = K.select(pol, q, cache, ids, alpha=1.5, scale=scale)
    never = KernelConfig(gaussian=GaussianConfig(conv_tol=0.0, nit=8))
    full = K.select(pol, q, cache, ids, alpha=1.5, scale=scale, config=never)
    oracle = tau_hat_oracle(q, cache, ids, scale=scale, alpha=1.5)
    denom = oracle.abs().clamp_min(1.0)
    err = ((sel.tau_hat.double() - oracle).abs() / denom).max().item()
    err_full = ((full.tau_hat.double() - oracle).abs() / denom).max().item()
    assert err <= TAU_TOL and err_full <= TAU_TOL, (err, err_full)
