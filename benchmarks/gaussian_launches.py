"""Per-launch device times of the Gaussian selection (eager, PDL off; a script, not a test; GPU only):

    PYTHONPATH=.:benchmarks python3 benchmarks/gaussian_launches.py paper_b1_2m,paper_1m,gqa_512k \
        [--variants "default;conv0:CONV_TOL=0.0;w2:STATS_TUNE=(True,64,2,None,32) MIN_CH=256"]

Each variant is ``name[:KNOB=VALUE KNOB=VALUE ...]`` (no spaces inside a value), knobs of ``entmaxkv.kernels.gaussian``
set for that variant only. "default" runs the module as it is; "conv0" never
stops the tau_hat iteration early. Times are medians over ``--reps`` profiled calls.
Knobs that kernels read as globals (tl.constexpr: _FAST_DIV, ATOMIC_SEM) cannot change
after the first compile in a process (Triton refuses): time those in separate runs,
e.g. ``bench_decode.py --set``.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import CONFIGS, build, knob_value
from entmaxkv import Gaussian
from entmaxkv import kernels as K
from entmaxkv.kernels import _common
from entmaxkv.kernels import gaussian as gk


def parse_variants(text: str):
    """[(name, {knob: value})] from "name[:KNOB=VALUE KNOB=VALUE ...];..."."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, knobs = item.partition(":")
        sets = {}
        for kv in knobs.split():
            k, v = kv.split("=", 1)
            if not hasattr(gk, k):
                raise ValueError(f"--variants: gaussian has no knob {k!r}")
            sets[k] = knob_value(gk, k, v)
        out.append((name, sets))
    return out


def launch_times(q, cache, ids, scale, reps: int):
    """[(kernel name, median us)] of one Gaussian selection, in launch order."""
    per = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=scale)
            torch.cuda.synchronize()
        evs = [e for e in prof.events()
               if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
        per.append([(e.name, getattr(e, "device_time", 0.0)) for e in evs])
    names = [n for n, _ in per[0]]
    return [(n, statistics.median(p[i][1] for p in per if len(p) == len(names))) for i, n in enumerate(names)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs")
    ap.add_argument("--variants", default="default;conv0:CONV_TOL=0.0")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    _common.PDL = False
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        cache, ids, q, k4, v4 = build(cfg)
        del k4, v4
        scale = 1 / math.sqrt(cfg[4])
        first = None
        for vname, sets in variants:
            saved = {k: getattr(gk, k) for k in sets}
            for k, v in sets.items():
                setattr(gk, k, v)
            try:
                for _ in range(3):
                    K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=scale)
                sel = K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=scale)
                first = first or sel
                # against the first variant: tau_hat (max relative difference) and page counts
                dtau = ((sel.tau_hat - first.tau_hat).abs() / first.tau_hat.abs().clamp(min=1e-30)).max().item()
                same = torch.equal(sel.counts, first.counts)
                times = launch_times(q, cache, ids, scale, args.reps)
                short = " ".join(f"{n.replace('_kernel', '')[:24]}:{us:.1f}" for n, us in times)
                print(cname, vname, f"total:{sum(us for _, us in times):.1f}", short,
                      f"| tau_rel_vs_first {dtau:.1e} counts_equal {same}", flush=True)
            except Exception as exc:  # noqa: BLE001  (keep timing the other variants)
                print(cname, vname, f"ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            finally:
                for k, v in saved.items():
                    setattr(gk, k, v)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
