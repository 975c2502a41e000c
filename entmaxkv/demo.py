"""`entmaxkv demo`: every policy on one long synthetic cache, with metrics.

Builds a paged cache of synthetic keys/values (clustered keys by default, or the paper's
standard-normal setting), decodes one step with each policy that applies (softmax: full,
top-k; entmax: full, top-k, Gaussian, certified), and reports coverage,
dropped mass delta, support recall rho, relative error R against full-cache
attention of the same kind, the certified fraction and the time per step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import List

import torch
from tqdm import tqdm

from ._checks import device_flag, float_flag, int_flag
from .limits import ALPHA_MAX
from .cache import PagedKVCache
from .backend import resolve_backend
from .decode import decode
from .step import run_step
from .metrics import evaluate_selection
from .policies import Certified, Full, Gaussian, TopK

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


POS = int_flag(lo=1)
NONNEG = int_flag(lo=0)


def add_demo_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache")
    g.add_argument("--seq-len", type=POS, default=16384, help="tokens per sequence (default 16384)")
    g.add_argument("--batch", type=POS, default=2, help="sequences (default 2)")
    g.add_argument("--q-heads", type=POS, default=8, help="query heads, a multiple of --kv-heads (default 8)")
    g.add_argument("--kv-heads", type=POS, default=4, help="KV heads (default 4)")
    g.add_argument("--head-dim", type=POS, default=64, help="head dimension (default 64)")
    g.add_argument("--page-size", type=POS, default=16, help="tokens per page (default 16)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="cache dtype (default float16)")
    g.add_argument("--device", type=device_flag, default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--seed", type=NONNEG, default=0, help="random seed (default 0)")
    g.add_argument("--data", choices=["clustered", "normal"], default="clustered",
                   help="clustered: keys sit around a new random centre every --cluster tokens "
                   "with --noise spread, a stand-in for the locality of real caches; normal: "
                   "i.i.d. standard-normal Q/K/V, the paper's synthetic setting, where entmax is "
                   "barely sparse (default clustered)")
    g.add_argument("--cluster", type=POS, default=16, help="tokens per key cluster for --data clustered")
    g.add_argument("--noise", type=float_flag(lo=0.0), default=0.3,
                   help="within-cluster key noise (>= 0) for --data clustered")
    g.add_argument("--q-scale", type=float_flag(lo=0.0, lo_open=True), default=1.0,
                   help="multiply queries by this (> 0; larger: sharper attention)")
    g = p.add_argument_group("attention and policies")
    g.add_argument("--alpha", type=float_flag(lo=1.0, hi=ALPHA_MAX, lo_open=True), default=1.5,
                   help=f"entmax alpha in (1, {ALPHA_MAX:g}] for the entmax rows "
                        "(default 1.5; the softmax rows always run)")
    g.add_argument("--alibi", action="store_true", help="add ALiBi slopes to half the heads (NAPE)")
    g.add_argument("--budget", type=POS, default=1024,
                   help="top-k token budget, at least --page-size (default 1024)")
    g.add_argument("--q-max", type=float_flag(lo=0.0, hi=1.0, lo_open=True, hi_open=True), default=0.995,
                   help="Gaussian page-max quantile in (0, 1) (default 0.995)")
    g.add_argument("--margin", type=float_flag(lo=0.0), default=0.0,
                   help="Gaussian threshold margin >= 0, tau units (default 0)")
    g.add_argument("--pooled", action="store_true", help="pooled Gaussian tau estimate instead of page mixture")
    g.add_argument("--sinks", type=NONNEG, default=0, help="attention-sink pages kept by every policy")
    g.add_argument("--window", type=NONNEG, default=0, help="local-window pages kept by every policy")
    g.add_argument("--per-query-head", action="store_true", help="select per query head instead of per KV head")
    g.add_argument("--policy", action="append", default=None,
                   choices=["full", "topk", "gaussian", "certified"],
                   help="run only these policies (repeatable; default all)")
    g.add_argument("--repeats", type=POS, default=3, help="timed decode calls per policy (default 3)")
    g.add_argument("--json", action="store_true", help="print one JSON object per policy row instead of a table")


def check_demo_args(args) -> None:
    """ValueError naming the flag for settings that do not fit together (the
    flags' own ranges are checked by argparse)."""
    if args.q_heads % args.kv_heads:
        raise ValueError(f"--q-heads: expected a multiple of --kv-heads ({args.kv_heads}), got {args.q_heads}")
    if args.budget < args.page_size:
        raise ValueError(f"--budget: expected at least --page-size ({args.page_size}) tokens, got {args.budget}")


@dataclass
class Row:
    name: str
    attention: str
    coverage: float
    delta: float
    rho: float
    R: float
    certified: float
    time_ms: float


def nape_slopes(q_heads: int) -> torch.Tensor:
    """ALiBi slopes on the first half of the heads, 0 (no position) on the rest."""
    half = max(q_heads // 2, 1)
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / half) for i in range(half)])
    return torch.cat([s, torch.zeros(q_heads - half)])


def synthetic_keys(args, n: int, H: int, D: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [n, H, D] keys with unit variance per coordinate."""
    if args.data == "normal":
        return torch.randn(n, H, D, generator=gen)
    centres = torch.randn(-(-n // args.cluster), H, D, generator=gen)
    k = centres.repeat_interleave(args.cluster, dim=0)[:n]
    k = k + args.noise * torch.randn(n, H, D, generator=gen)
    return k / math.sqrt(1.0 + args.noise**2)


def build_cache(args, device) -> tuple:
    gen = torch.Generator().manual_seed(args.seed)
    B, n, H, D = args.batch, args.seq_len, args.kv_heads, args.head_dim
    pages_per_seq = -(-n // args.page_size)
    cache = PagedKVCache(
        B * pages_per_seq + 1, args.page_size, H, D, max_seqs=B,
        max_pages_per_seq=pages_per_seq, dtype=DTYPES[args.dtype], device=device,
    )
    seqs = []
    for _ in tqdm(range(B), desc="prefill", file=sys.stderr, leave=False):
        k = synthetic_keys(args, n, H, D, gen)
        v = torch.randn(n, H, D, generator=gen)
        seqs.append(cache.allocate(k.to(device), v.to(device)))  # atomic: no slot left on failure
    q = torch.randn(B, args.q_heads, D, generator=gen) * args.q_scale
    q = q.to(device=device, dtype=DTYPES[args.dtype])
    return cache, seqs, q


def policies_for(args) -> List:
    common = dict(sinks=args.sinks, window=args.window, per_query_head=args.per_query_head)
    topk = TopK(args.budget, **common)
    gauss = Gaussian(q_max=args.q_max, margin=args.margin, pooled=args.pooled, **common)
    rows = [
        ("softmax", 1.0, "full", Full(per_query_head=args.per_query_head)),
        ("softmax", 1.0, "topk", topk),
        ("entmax", args.alpha, "full", Full(per_query_head=args.per_query_head)),
        ("entmax", args.alpha, "topk", topk),
        ("entmax", args.alpha, "gaussian", gauss),
        ("entmax", args.alpha, "certified", Certified(seed=topk, **common)),
    ]
    return [r for r in rows if args.policy is None or r[2] in args.policy]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(args) -> List[Row]:
    check_demo_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cache, seqs, q = build_cache(args, device)
    slopes = nape_slopes(args.q_heads).to(device) if args.alibi else None
    ids = torch.tensor(seqs, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(args.head_dim)
    rows = []
    for attn, alpha, name, pol in tqdm(policies_for(args), desc="policies", file=sys.stderr):
        kw = dict(alpha=alpha, alibi_slopes=slopes)
        out, stats = decode(q, cache, seqs, pol, return_stats=True, **kw)  # also the warm-up
        times = []
        for _ in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            decode(q, cache, ids, pol, check_finite=False, **kw)
            _sync(device)
            times.append(time.perf_counter() - t0)
        # The selection the decode used, for token-level metrics.
        ops = resolve_backend("auto", device)
        sel, _, _, _ = run_step(ops, pol, q, cache, ids, alpha, scale, slopes, need_bounds=True)
        qual = evaluate_selection(q, cache, seqs, sel, out, alpha=alpha, scale=scale, slopes=slopes)
        times.sort()
        rows.append(Row(
            name, attn, float(qual.coverage.mean()), float(qual.delta.mean()), float(qual.rho.mean()),
            float(qual.R.mean()), float(stats.certified.float().mean()), 1e3 * times[len(times) // 2],
        ))
    return rows


def format_table(rows: List[Row], args, device: str) -> str:
    head = (f"EntmaxKV demo: batch {args.batch}, {args.seq_len} tokens, {args.q_heads} query / "
            f"{args.kv_heads} KV heads, head dim {args.head_dim}, page {args.page_size}, "
            f"{args.dtype}, alpha {args.alpha}, device {device}")
    cols = f"{'attention':<9} {'policy':<10} {'coverage':>9} {'delta':>10} {'rho':>7} {'R':>10} {'certified':>9} {'ms':>9}"
    lines = [head, "", cols, "-" * len(cols)]
    for r in rows:
        lines.append(
            f"{r.attention:<9} {r.name:<10} {r.coverage:>9.4f} {r.delta:>10.3e} {r.rho:>7.4f} "
            f"{r.R:>10.3e} {r.certified:>9.2f} {r.time_ms:>9.2f}"
        )
    lines += ["", "coverage: fraction of tokens read; delta: dropped full-cache probability mass;",
              "rho: support recall; R: relative L2 error vs full-cache attention of the same kind;",
              "certified: fraction of heads whose output is provably exact; ms: median time per decode step."]
    if args.dtype != "float32":
        lines.append(f"(R of the full rows is the rounding of the {args.dtype} output against a float32 truth.)")
    return "\n".join(lines)


def main_demo(args) -> int:
    rows = run_demo(args)
    if args.json:
        for r in rows:
            print(json.dumps({"name": r.name, "attention": r.attention, "coverage": r.coverage,
                              "delta": r.delta, "rho": r.rho, "R": r.R, "certified": r.certified,
                              "time": r.time_ms, "time_unit": "ms"}))
    else:
        dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(format_table(rows, args, dev))
    return 0
