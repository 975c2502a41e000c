"""Sweep of the all-heads Quest keys pass (``_topk_keys_kernel``, kernels/topk/keys.py).

For each configuration, times (CUDA graph, L2 flushed, median) a plain Triton
read of the whole k_min/k_max table (the achievable read bandwidth of the
metadata, no block table) and then the whole top-k selection with each
``keys_plan`` override (BLOCK_M, KCH, HG, WARPS), next to the
default plan (each a ``TopKConfig.keys_tune``). Prints one line per
variant: selection ms, and the keys pass alone in ms and TB/s. With
``--fields`` it times the selection over the product of values of
``TopKConfig`` fields instead (e.g. the chunk size and the warps of the lb
and merge kernels). The chosen values become the ``TopKConfig`` defaults by
hand.

    python -m benchmarks.tune_keys --configs paper_128k,paper_b1_2m
    python -m benchmarks.tune_keys --configs paper_b1_2m \
        --fields "select_ch=4096,8192;lb_warps=1,4"
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

import torch
import triton
import triton.language as tl

from .bench_decode import CONFIGS
from entmaxkv.kernels import KernelConfig, TopKConfig

from .harness import build, capture, time_graph


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Largest element of STEPS * BLOCK contiguous values per program (a pure read)."""
    i = tl.program_id(0).to(tl.int64)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(STEPS):
        o = (i * STEPS + s) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(x_ptr + o, mask=o < N, other=0.0).to(tl.float32))
    tl.store(out_ptr + i, tl.max(acc, axis=0))


def parse_variants(text):
    """'BLOCK_M,KCH,HG,WARPS;...' -> list of dicts."""
    out = []
    for v in text.split(";"):
        bm, kch, hg, w = (int(x) for x in v.split(","))
        out.append(dict(BLOCK_M=bm, KCH=kch, HG=hg, WARPS=w))
    return out


def grid():
    """The built-in sweep for 24 heads of dim 32 (HG 8: three unmasked runs;
    HG 32: one masked run, the layout before head groups)."""
    out = []
    for bm, hg, w in itertools.product((4, 8, 16, 32), (8, 32), (4, 8)):
        if bm * hg * 64 > 16384 or bm * hg * 64 < 2048:
            continue
        for kch in (32, 128, 512):
            if kch >= bm:
                out.append(dict(BLOCK_M=bm, KCH=kch, HG=hg, WARPS=w))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k,paper_b1_2m")
    ap.add_argument("--variants", default=None, metavar="BM,KCH,HG,WARPS;...")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fields", default=None, metavar="NAME=V1,V2;...",
                    help="time select_topk over the product of these TopKConfig field values")
    args = ap.parse_args(argv)
    from entmaxkv.kernels.topk import launch as T

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    if args.fields:
        return sweep_fields(T, args, flush)
    variants = parse_variants(args.variants) if args.variants else grid()
    for cname in args.configs.split(","):
        cache, ids, q, scale = setup(cname)
        meta = cache.k_bounds
        nbytes = meta.numel() * meta.element_size()
        N = meta.numel()
        for block, steps in ((4096, 8), (8192, 4), (2048, 16)):
            out = torch.empty(triton.cdiv(N, block * steps), device="cuda")
            g, _ = capture(lambda: _read_kernel[(out.numel(),)](meta, out, N, BLOCK=block, STEPS=steps,
                                                                num_warps=8))
            ms, _ = time_graph(g, flush, 5, args.reps)
            print(f"{cname:12s} read   block {block} x {steps}: {ms * 1e3:7.1f} us "
                  f"{nbytes / ms / 1e9:5.2f} TB/s ({nbytes / 2**20:.0f} MiB)", flush=True)
        for v in [None] + variants:
            c = TopKConfig(keys_tune=() if v is None else tuple(v.items()))
            name = "default" if v is None else ",".join(f"{k}={int(x)}" for k, x in v.items())
            try:
                ms = time_select(T, q, cache, ids, scale, flush, args.reps, c)
                keys_ms, kp = time_keys(T, q, cache, ids, scale, flush, args.reps, c)
                print(f"{cname:12s} {name:55s} select {ms * 1e3:7.1f} us  keys {keys_ms * 1e3:7.1f} us "
                      f"{nbytes / keys_ms / 1e9:5.2f} TB/s  plan {kp}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(cname, name, "ERROR", str(exc)[:300], flush=True)
        torch.cuda.empty_cache()


def setup(cname):
    """(cache, seq ids, queries, scale) of a bench_decode configuration (no dense K/V copy kept)."""
    cache, ids, q, k4, v4 = build(CONFIGS[cname])
    del k4, v4
    return cache, ids, q, 1 / math.sqrt(q.shape[-1])


def time_select(T, q, cache, ids, scale, flush, reps, c):
    """Median ms of the whole top-k selection (budget 1024, TopKConfig ``c``), captured in a graph."""
    cfg = KernelConfig(topk=c)
    g, _ = capture(lambda: T.select_topk(q, cache, ids, budget=1024, scale=scale, config=cfg))
    ms, _ = time_graph(g, flush, 5, reps)
    del g
    return ms


def sweep_fields(T, args, flush):
    """Selection time for every combination of the --fields values."""
    names, values = [], []
    for item in args.fields.split(";"):
        name, vals = item.split("=")
        if name not in {f.name for f in dataclasses.fields(TopKConfig)}:
            raise ValueError(f"--fields: TopKConfig has no field {name!r}")
        names.append(name)
        values.append([int(v) for v in vals.split(",")])
    for cname in args.configs.split(","):
        cache, ids, q, scale = setup(cname)
        for combo in itertools.product(*values):
            c = TopKConfig(**dict(zip(names, combo)))
            label = ",".join(f"{k}={v}" for k, v in zip(names, combo))
            ms = time_select(T, q, cache, ids, scale, flush, args.reps, c)
            print(f"{cname:12s} {label:55s} select {ms * 1e3:7.1f} us", flush=True)
        torch.cuda.empty_cache()


def time_keys(T, q, cache, ids, scale, flush, reps, c):
    """(median ms, plan) of _topk_keys_kernel alone, launched as select_topk launches it."""
    from entmaxkv.kernels._common import as_slopes, num_sms
    from entmaxkv.kernels.topk import plan as TP

    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    M = cache.block_table.shape[1]
    k_pages, W = TP.topk_width(M, P, 1024, 0, 0)
    cfg = TP.topk_plan(c, M, W, 1, D, q.dtype, cache.dtype, B * H, num_sms(q.device), cap=c.select_ch)
    MK = cfg["NCH"] * cfg["CH"]
    keys = torch.empty(B * H * MK, dtype=torch.int32, device=q.device)
    sl = as_slopes(None, HQ, q.device)
    ids32 = ids.to(torch.int32)
    plan = {}

    def launch():
        plan.update(T.launch_keys(q, sl, ids32, cache, keys, None, MK, scale, 0, 0, k_pages, has_alibi=False, c=c))

    g, _ = capture(launch)
    ms, _ = time_graph(g, flush, 5, reps)
    return ms, plan


if __name__ == "__main__":
    main()
