"""Replay a captured select + attend step many times and count replays whose
pages (as stored, and as sets) or output differ from the first replay, per
kernel-knob variant (a diagnostic for races between overlapped launches).

    python -m benchmarks.race_probe [--reps 100]
"""
from __future__ import annotations

import argparse
import math

import torch

from .harness import capture
from entmaxkv import kernels as K
from entmaxkv import policies as RP
from .gpu_check import alibi, make

import entmaxkv.kernels.attention as A  # noqa: E402
import entmaxkv.kernels.topk as T  # noqa: E402
from entmaxkv.kernels.config import KernelConfig  # noqa: E402

SHAPES = {  # name: (lens, H, D, P, dtype, alibi, policy, alpha)
    "odd-softmax-alibi": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, True, RP.TopK(512, sinks=2, window=1), 1.0),
    "odd-softmax": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, False, RP.TopK(512, sinks=2, window=1), 1.0),
    "odd-softmax-nosinks": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, True, RP.TopK(512), 1.0),
    "odd-softmax-even": ([20001, 9000, 9000, 20001], 6, 64, 8, torch.bfloat16, True, RP.TopK(512, sinks=2, window=1), 1.0),
    "odd-entmax-alibi": ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, True, RP.TopK(512, sinks=2, window=1), 1.5),
    "paper32k-softmax-alibi": ([32768] * 8, 24, 32, 16, torch.float16, True, RP.TopK(1024), 1.0),
}
# Each variant: (module knobs set for its run, KernelConfig fields).
VARIANTS = {
    "default": ({}, {}),
    "no-poll-ready": ({(A, "POLL_READY"): False}, {}),
    "no-overlap": ({(T, "OVERLAP"): False}, {}),
    "no-pdl": ({}, {"pdl": False}),
}


def rows_sorted(pages, counts):
    p = pages.clone()
    w = torch.arange(p.shape[-1], device=p.device)
    p[w.expand_as(p) >= counts[..., None]] = 2**31 - 1
    return torch.sort(p, dim=-1).values


def probe(name, variant, reps, config=None):
    lens, H, D, P, dtype, has_alibi, pol, alpha = SHAPES[name]
    cache, ids, q = make(lens, H, 1, D, P, dtype, seed=7)
    scale = 1.0 / math.sqrt(D)
    slopes = alibi(H) if has_alibi else None

    def step():
        s = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=config)
        o = K.attend(q, cache, ids, s, alpha=alpha, scale=scale, slopes=slopes, config=config)[0]
        return s.pages, s.counts, o

    g, (gp, gc, go) = capture(step)
    g.replay()
    p0, c0, o0, s0 = gp.clone(), gc.clone(), go.clone(), rows_sorted(gp, gc)
    dp = ds = do = 0
    for _ in range(reps):
        g.replay()
        dp += int(not (torch.equal(gp, p0) and torch.equal(gc, c0)))
        ds += int(not torch.equal(rows_sorted(gp, gc), s0))
        do += int(not torch.equal(go, o0))
    torch.cuda.synchronize()
    print(f"{name:24s} {variant:14s} pages as stored differ {dp}/{reps}, as sets {ds}/{reps}, output {do}/{reps}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    for name in args.shapes.split(","):
        for v in args.variants.split(","):
            knobs, fields = VARIANTS[v]
            saved = {k: getattr(*k) for k in knobs}
            for (mod, attr), val in knobs.items():
                setattr(mod, attr, val)
            try:
                probe(name, v, args.reps, KernelConfig(**fields))
            finally:
                for (mod, attr), val in saved.items():
                    setattr(mod, attr, val)


if __name__ == "__main__":
    main()
