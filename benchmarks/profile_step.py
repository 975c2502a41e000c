"""Per-kernel time of one decode step (a script, not a test; GPU only).

For each configuration and method of ``bench_decode.py`` it runs the step
eagerly under ``torch.profiler`` and prints the mean device time of every
kernel per step, next to the CUDA-graph replay time of the whole step. It is
the tool behind the kernel choices recorded in docs/tuning.md.

Usage (on the GPU machine, from the repository root):

    python -m benchmarks.profile_step \
        --configs paper_128k --methods quest_topk1024,gaussian
    python -m benchmarks.profile_step --methods full_entmax,certified_sketch --sketch-dims 32
"""
from __future__ import annotations

import argparse
import collections
import math
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_decode import CONFIGS, METHODS, make_step
from .harness import build, capture, kernel_config, sketched, time_graph


def kernel_times(step, iters: int):
    """{kernel name: mean microseconds per step} from the profiler's device events."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for ev in prof.events():
        dt = getattr(ev, "device_time", None)
        if dt is None:
            dt = getattr(ev, "cuda_time", 0.0)
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type) and dt:
            acc[ev.name] += dt
    return {k: v / iters for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def extra_step(K, meth, cache, ids, q, scale):
    """Scoring kernels alone ("bounds", "gstats"), to compare with whole steps."""
    if meth == "bounds":
        return lambda: (K.quest_bounds(q, cache, ids, scale=scale), None, None)
    if meth == "gstats":
        return lambda: (K.gaussian_stats(q, cache, ids, scale=scale)[0], None, None)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sketch-dims", type=int, default=8,
                    help="coordinates per token of certified_sketch's key sketches (as in bench_decode)")
    ap.add_argument("--config", action="append", default=[], metavar="[STAGE.]FIELD=VALUE",
                    help="a KernelConfig field for every kernel call, e.g. topk.select_warps=8")
    args = ap.parse_args(argv)
    from entmaxkv import kernels as K

    kcfg = kernel_config(args.config)

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        t0 = time.time()
        cache, ids, q, k4, v4 = build(cfg)
        print(f"\n## {cname} {cfg[:5]} built in {time.time() - t0:.1f}s", flush=True)
        scale = 1.0 / math.sqrt(cfg[4])
        with_sketch = None
        for meth in args.methods.split(","):
            try:
                if meth == "certified_sketch" and with_sketch is None:
                    with_sketch = sketched(cache, args.sketch_dims)
                c = with_sketch if meth == "certified_sketch" else cache
                step = extra_step(K, meth, c, ids, q, scale) or make_step(K, meth, c, ids, q, k4, v4, scale, kcfg)
                g, _ = capture(step)
                ms, _ = time_graph(g, flush, 5, 20)
                kt = kernel_times(step, args.iters)
            except Exception as exc:  # noqa: BLE001  (keep profiling the other methods)
                print(f"{meth}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            tot = sum(kt.values())
            print(f"{meth}: graph {ms * 1e3:.1f} us, kernels {tot:.1f} us", flush=True)
            for name, us in kt.items():
                print(f"    {us:8.1f} us  {name[:90]}", flush=True)
        del cache, with_sketch, ids, q, k4, v4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
