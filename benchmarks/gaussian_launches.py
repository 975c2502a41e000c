"""Per-launch device times of the Gaussian selection (eager, PDL off; a script, not a test; GPU only):

    PYTHONPATH=.:benchmarks python3 benchmarks/gaussian_launches.py paper_b1_2m,paper_1m,gqa_512k

"default" stops the tau_hat iteration once converged (CONV_TOL); "conv0" never stops early.
"""
from __future__ import annotations

import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import CONFIGS, build
from entmaxkv import Gaussian
from entmaxkv import kernels as K
from entmaxkv.kernels import _common
from entmaxkv.kernels import gaussian as gk
_common.PDL = False
for cname in sys.argv[1].split(","):
    cfg = CONFIGS[cname]
    cache, ids, q, k4, v4 = build(cfg)
    del k4, v4
    scale = 1 / math.sqrt(cfg[4])
    conv_tol = gk.CONV_TOL
    for variant in ("default", "conv0"):
        gk.CONV_TOL = 0.0 if variant == "conv0" else conv_tol
        for _ in range(3):
            K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=scale)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=scale)
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
        print(cname, variant, " ".join(f"{e.name.replace('_kernel','')}:{getattr(e, 'device_time', 0):.1f}" for e in evs))
    gk.CONV_TOL = conv_tol
    del cache
    torch.cuda.empty_cache()
