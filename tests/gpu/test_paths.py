"""The attention's launch paths on the GPU: the dense one-head entmax pass
with each of its plans, and every way an entmax head finishes.

GPU only (skipped without CUDA); ``ENTMAXKV_GPU_QUICK=1`` shortens the
sweeps (tests/gpu/test_stages.py says how to run them).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from entmaxkv import attention as RA
from entmaxkv import policies as RP
from entmaxkv.kernels.config import AttentionConfig, KernelConfig
from entmaxkv.testing import KERNEL_TOL as TOL, gpu_quick, random_case, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float16] if gpu_quick() else [torch.float16, torch.bfloat16, torch.float32]
DIMS = [32, 128] if gpu_quick() else [32, 64, 128, 256]


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _dense_vs_reference(q, cache, ids, alpha, scale, config=None):
    from entmaxkv import kernels as K

    o, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, config=config)
    full = RP.select(RP.Full(), q, cache, ids, alpha=alpha, scale=scale)
    ro, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=scale)
    assert rel_err(o, ro) < TOL[q.dtype] and float((tau.double() - rtau).abs().max()) < 1e-4


@pytest.mark.parametrize("dtype,D", list(itertools.product(DTYPES, DIMS)))
@pytest.mark.parametrize("rows", ["few", "many"])
def test_dense_one_head_entmax(dtype, D, rows):
    """The dense one-head entmax pass (software-pipelined, its tile set by row
    count: AttentionConfig.dense_entmax_pipe_*) with fewer rows than
    multiprocessors and with more."""
    H, lens = (2, [2500, 700, 19]) if rows == "few" else (-(-_sms() // 3) + 1, [1200, 333, 16])
    cache, ids, q, _ = random_case(lens, H, 1, D, 16, dtype, seed=D + H, device="cuda")
    for alpha in (1.5, 2.0):
        _dense_vs_reference(q, cache, ids, alpha, 1.0 / math.sqrt(D))


FINISH = {"registers": {}, "memory": {"solve_tile": 64}, "three-launches": {"finish": False}}


@pytest.mark.parametrize("dtype,D", list(itertools.product(DTYPES, [d for d in DIMS if d in (32, 128)])))
@pytest.mark.parametrize("shape", ["one-head-many-rows", "gqa4"])
@pytest.mark.parametrize("variant", list(FINISH))
def test_finish_paths(dtype, D, shape, variant):
    """The ways an entmax head finishes, on nearly flat keys (long candidate
    lists, a support of most kept tokens): _attn_finish_kernel solving in
    registers where a row's lists fit, from memory where they do not
    (solve_tile shrunk: every list outgrows the tile), and the three
    launches (finish off); dense with one head per program and more rows
    than multiprocessors (two splits) and on the tl.dot path (G = 4), and
    over a top-k 1024 selection, whose support spans several V blocks."""
    from entmaxkv import kernels as K

    H, G, lens = (-(-_sms() // 3) + 1, 1, [1200, 333, 16]) if shape == "one-head-many-rows" else (2, 4, [3000, 700, 19])
    cache, ids, q, _ = random_case(lens, H, G, D, 16, dtype, seed=D + G, key_scale=0.01, device="cuda")
    scale = 1.0 / math.sqrt(D)
    cfg = KernelConfig(attention=dataclasses.replace(AttentionConfig(), **FINISH[variant]))
    for alpha in (1.5, 2.0):
        _dense_vs_reference(q, cache, ids, alpha, scale, cfg)
        sel = K.select(RP.TopK(1024), q, cache, ids, alpha=alpha, scale=scale, config=cfg)
        o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, config=cfg)
        ro, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=scale)
        assert rel_err(o, ro) < TOL[dtype] and float((tau.double() - rtau).abs().max()) < 1e-4
