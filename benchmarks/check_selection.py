"""Kernel top-k selections at benchmark sizes against the reference policy (GPU; a script, not a test).

``gpu_check.py`` compares every stage with the reference on moderate shapes
and ``bench_decode.py --check`` compares outputs over the selected pages; this
checks that the Triton top-k keeps exactly the pages the PyTorch policy keeps
on the benchmark's own caches (including the chunk pre-filter's long rows).

    PYTHONPATH=.:benchmarks python3 benchmarks/check_selection.py --configs paper_128k,paper_b1_2m
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from bench_decode import CONFIGS, build
from entmaxkv import TopK
from entmaxkv import kernels as K
from entmaxkv import policies as RP


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
            for b in range(B):
                for s in range(S):
                    got = set(sel.pages[b, s, : int(sel.counts[b, s])].tolist())
                    want = set(ref.pages[b, s, : int(ref.counts[b, s])].tolist())
                    bad += got != want
            bad_total += bad
            print(f"{cname} {pol}: {bad} of {B * S} rows differ", flush=True)
        del cache
        torch.cuda.empty_cache()
    print("selection check:", "passed" if bad_total == 0 else f"FAILED ({bad_total})")
    return 0 if bad_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
