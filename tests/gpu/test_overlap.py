"""Overlapped launches under CUDA-graph replay (race checks, GPU only).

The top-k step through _topk_rowsel_kernel publishes each row for the
attention to poll (Selection.pending), overlapped with the keys pass
(batch >= 2, rows of at most 32768 pages) or not (batch 1, long rows). A
read before its producer's write, or a write into memory a running launch
still uses, shows as a replay that differs from the eager step, so every
replay must be bit-equal to it, with each launch variant.
``ENTMAXKV_GPU_QUICK=1`` replays fewer times (tests/gpu/test_stages.py says
how to run these).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from benchmarks.harness import capture
from entmaxkv import attention as RA
from entmaxkv import policies as RP
from entmaxkv.kernels.config import KernelConfig
from entmaxkv.testing import KERNEL_TOL as TOL, alibi, gpu_quick, page_sets, random_case, rel_err
from entmaxkv.types import Selection

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPLAYS = 20 if gpu_quick() else 100
SHAPES = {  # name: (lens, H, D, P, dtype, alibi, policy, alphas)
    "paper-32k": ([32768] * 8, 24, 32, 16, torch.float16, False, RP.TopK(1024), (1.0, 1.5)),
    "paper-32k-k4096": ([32768] * 8, 24, 32, 16, torch.float16, False, RP.TopK(4096, sinks=1, window=2), (1.5, 2.0)),
    "paper-32k-alibi": ([32768] * 8, 24, 32, 16, torch.float16, True, RP.TopK(1024), (1.0,)),
    "odd-bf16-alibi": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, True, RP.TopK(512, sinks=2, window=1),
                       (1.0, 1.3, 1.5)),
    "odd-bf16": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, False, RP.TopK(512, sinks=2, window=1), (1.0,)),
    "odd-bf16-even": ([20001, 9000, 9000, 20001], 6, 64, 8, torch.bfloat16, True,
                      RP.TopK(512, sinks=2, window=1), (1.0,)),
    "odd-f32-d128": ([7000, 12345, 33], 4, 128, 64, torch.float32, False, RP.TopK(2048), (1.5, 1.0)),
    # not overlapped (batch 1; rows past overlap_max_keys): _topk_gmax_kernel zeroes the counters
    "b1-300k": ([300000], 24, 32, 16, torch.float16, False, RP.TopK(1024), (1.0, 1.5)),
    "b2-600k-alibi": ([600000, 250001], 4, 64, 16, torch.bfloat16, True, RP.TopK(1024, sinks=1, window=2), (2.0, 1.0)),
}
VARIANTS = {  # launch variants: KernelConfig fields (stage.field or field)
    "default": {},
    "no-poll-ready": {"attention.poll_ready": False},
    "no-overlap": {"topk.overlap": False},
    "no-pdl": {"pdl": False},
}


def _config(fields) -> KernelConfig:
    cfg = KernelConfig()
    for key, value in fields.items():
        stage, _, name = key.rpartition(".")
        if stage:
            cfg = dataclasses.replace(cfg, **{stage: dataclasses.replace(getattr(cfg, stage), **{name: value})})
        else:
            cfg = dataclasses.replace(cfg, **{name: value})
    return cfg


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_topk_step_replays_bit_equal(shape, variant):
    """Pages equal to the reference policy's, every row published (pending
    counters[0] all 1; the default launches always take the row selection), the output close to the float64 reference,
    and every graph replay's pages (as sets) and output equal to the eager
    step's."""
    from entmaxkv import kernels as K

    lens, H, D, P, dtype, has_alibi, pol, alphas = SHAPES[shape]
    cfg = _config(VARIANTS[variant])
    cache, ids, q, _ = random_case(lens, H, 1, D, P, dtype, seed=sum(lens) % 1000, device="cuda")
    scale = 1.0 / math.sqrt(D)
    slopes = alibi(H).cuda() if has_alibi else None
    for alpha in alphas:
        sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=cfg)
        rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
        assert page_sets(sel) == page_sets(rsel), alpha
        if variant == "default":  # (the chain, without pending counters, may serve the other variants)
            assert sel.pending is not None
        if sel.pending is not None:
            assert bool((sel.pending.counters[0] == 1).all())
        eo, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes, config=cfg)
        ro, _ = RA.attend(q.double(), cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
        assert rel_err(eo, ro) < TOL[dtype]

        def step():
            s_ = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=cfg)
            o_ = K.attend(q, cache, ids, s_, alpha=alpha, scale=scale, slopes=slopes, config=cfg)[0]
            return s_.pages, s_.counts, o_

        g, (gp, gc, go) = capture(step)
        want = page_sets(sel)
        bad_pages = bad_out = 0
        for _ in range(REPLAYS):
            g.replay()
            torch.cuda.synchronize()
            bad_out += int(not torch.equal(go, eo))
            bad_pages += int(page_sets(Selection(gp, gc)) != want)
        del g
        assert (bad_pages, bad_out) == (0, 0), (alpha, bad_pages, bad_out, REPLAYS)
