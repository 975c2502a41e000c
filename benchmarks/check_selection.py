"""Kernel selections at benchmark sizes against the reference policy (GPU; a script, not a test).

``gpu_check.py`` compares every stage with the reference on moderate shapes
and ``bench_decode.py --check`` compares outputs over the selected pages; this
checks that the Triton top-k keeps exactly the pages the PyTorch policy keeps
on the benchmark's own caches (including the chunk pre-filter's long rows),
and that the Triton Gaussian tau_hat matches a float64 solve over float64
page statistics (relative error), also when its iteration launches stop
early (against the same kernels with CONV_TOL = 0 and 8 launches), with the
number of pages its selection and the reference's differ by (borderline
pages at a tau_hat rounded differently).

    python -m benchmarks.check_selection --configs paper_128k,paper_b1_2m
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from .bench_decode import CONFIGS
from .harness import build
from entmaxkv import Gaussian, TopK
from entmaxkv import kernels as K
from entmaxkv import policies as RP
from .gpu_check import sets, tau_hat_f64

# relative tau_hat error that fails the Gaussian check (float32 tau_hat over
# float32 page statistics: a few 1e-7)
TAU_TOL = 2e-6


def _with_state(gk, fn):
    """Run fn, returning its result and the Gaussian solve's state buffer
    ([NIT, rows, 4] float64: lo, hi, tau, converged flag from launch 1 on),
    caught as the kernel module allocates it (a diagnostic only)."""
    real, seen = torch.empty, []

    def empty(*a, **k):
        t = real(*a, **k)
        if k.get("dtype") == torch.float64 and t.dim() == 3 and t.shape[-1] == 4:
            seen.append(t)
        return t

    torch.empty = empty
    try:
        out = fn()
    finally:
        torch.empty = real
    return out, (seen[-1].cpu() if seen else None)


def check_gaussian(cname, q, cache, ids, scale, alpha=1.5) -> int:
    """Failures (tau_hat beyond TAU_TOL) of the Gaussian selection on one config."""
    from entmaxkv.kernels import gaussian as gk

    pol = Gaussian()
    sel, state = _with_state(gk, lambda: K.select(pol, q, cache, ids, alpha=alpha, scale=scale))
    if state is not None:  # rows whose solve had converged by each iteration launch
        done = [int((state[it, :, 3] != 0).sum()) if it else 0 for it in range(state.shape[0])]
        print(f"{cname} Gaussian: rows converged at launches 0..{state.shape[0] - 1}: {done} of {state.shape[1]}")
    conv_tol, nit = gk.CONV_TOL, gk.NIT
    gk.CONV_TOL, gk.NIT = 0.0, 8
    try:
        full = K.select(pol, q, cache, ids, alpha=alpha, scale=scale)
    finally:
        gk.CONV_TOL, gk.NIT = conv_tol, nit
    oracle = tau_hat_f64(pol, q, cache, ids, scale, None, alpha)
    err = ((sel.tau_hat.double() - oracle).abs() / oracle.abs().clamp_min(1.0)).max().item()
    err_full = ((full.tau_hat.double() - oracle).abs() / oracle.abs().clamp_min(1.0)).max().item()
    ref = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale)
    diff = sum(len(a ^ b) for ra, rb in zip(sets(sel), sets(ref)) for a, b in zip(ra, rb))
    kept = int(sel.counts.sum())
    print(f"{cname} {pol}: tau_hat rel err {err:.1e} (never stopping early: {err_full:.1e}); "
          f"{kept} pages kept, {diff} differ from the reference's", flush=True)
    return int(err > TAU_TOL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_32k,paper_128k,paper_b1_2m")
    args = ap.parse_args(argv)
    bad_total = 0
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        cache, ids, q, k4, v4 = build(cfg)
        del k4, v4
        scale = 1 / math.sqrt(cfg[4])
        for pol in (TopK(1024), TopK(4096, sinks=1, window=2)):
            sel = K.select(pol, q, cache, ids, alpha=1.5, scale=scale)
            ref = RP.select(pol, q, cache, ids, alpha=1.5, scale=scale)
            B, S, _ = sel.pages.shape
            bad = int((sel.counts != ref.counts).sum())
            bad += sum(got != want for rg, rw in zip(sets(sel), sets(ref)) for got, want in zip(rg, rw))
            bad_total += bad
            print(f"{cname} {pol}: {bad} of {B * S} rows differ", flush=True)
        bad_total += check_gaussian(cname, q, cache, ids, scale)
        del cache
        torch.cuda.empty_cache()
    print("selection check:", "passed" if bad_total == 0 else f"FAILED ({bad_total})")
    return 0 if bad_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
