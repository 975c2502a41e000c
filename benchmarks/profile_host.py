"""Where the host time of a decode call goes: cProfile over many calls.

A script (GPU machine). Profiles ``decode()`` and ``Decoder.run`` (graphs on
and off) for one configuration and policy and prints the functions with the
most own time per call, so host-overhead work has a measured target.

    python -m benchmarks.profile_host --config paper_128k --method topk1024 --calls 300
"""
from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats

import torch

from entmaxkv import decode
from entmaxkv.planner import Decoder

from .bench_api import METHODS
from .bench_decode import CONFIGS
from .harness import build


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="paper_128k", choices=sorted(CONFIGS))
    ap.add_argument("--method", default="topk1024", choices=list(METHODS))
    ap.add_argument("--calls", type=int, default=300, help="profiled calls per entry point (>= 1)")
    ap.add_argument("--top", type=int, default=25, help="rows printed per entry point (>= 1)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.top < 1:
        ap.error("--calls and --top must be >= 1")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    cfg = CONFIGS[args.config]
    B, n, HQ, H, D, dtype, P = cfg
    cache, ids, q, _, _ = build(cfg)
    alpha, policy, _ = METHODS[args.method]
    out = torch.empty_like(q)
    entries = {"decode": lambda: decode(q, cache, ids, policy, alpha=alpha, check_finite=False, out=out)}
    for graphs in (True, False):
        dec = Decoder(policy, q_heads=HQ, kv_heads=H, head_dim=D, page_size=P, alpha=alpha, device="cuda",
                      cuda_graphs=graphs, scale=1.0 / math.sqrt(D))
        dec.plan_cache(cache, ids)
        entries[f"run(cuda_graphs={graphs})"] = (lambda dec=dec: dec.run(q, cache.layer(), out))
    for name, call in entries.items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        total = stats.total_tt / args.calls * 1e6
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"\n=== {name}: {total:.1f} us of host time per call (profiled) ===")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
