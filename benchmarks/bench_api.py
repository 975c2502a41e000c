"""What users call, timed: eager ``decode()``, the planned ``Decoder.run``, and graph replays.

A script, not a test (run on the GPU machine). For each configuration and
policy, in one process and on the same data (bench_decode's caches):

- ``graph_ms``: the stage functions of one step (selection + attention)
  captured in a CUDA graph and replayed (bench_decode's measurement);
- ``eager_ms``: ``decode(q, cache, ids_tensor, policy, check_finite=False)``;
- ``default_ms``: ``decode(q, cache, ids_list, policy)`` as the README shows
  it (it checks q for NaN: one host synchronisation);
- ``run_ms``: ``Decoder.run`` after ``plan`` (per-layer CUDA graphs, the default);
- ``direct_ms``: ``Decoder.run`` with ``cuda_graphs=False`` (every launch from Python);
- ``*_host_us``: host CPU time of one call (the device idle before it);
- ``*_stream_ms``: per call, of ``--stream`` calls issued back to back, as a
  model calls attention once per layer (host and device overlap);
- ``sdpa_ms``: torch SDPA over the same K/V stored contiguously.

Per-call times follow the published code's benchmark: an L2 flush before
every call, CUDA events around the call alone, the median (and mean: the
certified policy's occasional probe shows in the mean) of ``--reps`` calls
after ``--warmup`` untimed ones. The bytes floor is bench_decode's.

    python -m benchmarks.bench_api --out benchmarks/results
    python -m benchmarks.bench_api --configs paper_128k --methods topk1024,certified
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from entmaxkv import decode
from entmaxkv.backend import resolve_backend
from entmaxkv.planner import Decoder
from entmaxkv.step import run_step
from entmaxkv.types import Certified, Full, Gaussian, TopK

from .bench_decode import CONFIGS, COPY_BW, nbytes
from .harness import build, capture, time_graph

API_CONFIGS = ["paper_32k", "paper_128k", "paper_b1_2m", "gqa_128k"]
METHODS = {
    # name: (alpha, policy, bench_decode's method name for the bytes floor)
    "full_softmax": (1.0, Full(), "full_softmax"),
    "full_entmax": (1.5, Full(), "full_entmax"),
    "quest1024": (1.0, TopK(1024), "quest_topk1024"),
    "topk1024": (1.5, TopK(1024), "entmax_topk1024"),
    "gaussian": (1.5, Gaussian(), "gaussian"),
    "certified": (1.5, Certified(seed=TopK(1024)), "certified"),
}


def time_calls(call, flush, warmup: int, reps: int):
    """(median ms, mean ms) of ``reps`` calls, each after an L2 flush, with
    CUDA events around the call alone."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in evs:
        flush.zero_()
        e0.record()
        call()
        e1.record()
    torch.cuda.synchronize()
    ts = [e0.elapsed_time(e1) for e0, e1 in evs]
    return statistics.median(ts), statistics.fmean(ts)


def time_stream(call, n: int, rounds: int = 5) -> float:
    """ms per call of ``n`` calls issued back to back (median of ``rounds``)."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            call()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) / n)
    return statistics.median(out)


def host_us(call, reps: int) -> float:
    """Median host CPU time (perf_counter) of one call, the device idle before it."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def bench_config(name, methods, args, flush):
    cfg = CONFIGS[name]
    B, n, HQ, H, D, dtype, P = cfg
    cache, ids, q, k4, v4 = build(cfg)
    ids_list = ids.tolist()
    scale = 1.0 / math.sqrt(D)
    ops = resolve_backend("triton", q.device)
    rows = []
    q4 = q[:, :, None, :]
    g, _ = capture(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale,
                                                                             enable_gqa=HQ != H))
    sdpa_ms, _ = time_graph(g, flush, args.warmup, args.reps)
    del g
    for m in methods:
        alpha, policy, floor_name = METHODS[m]
        row = dict(config=name, method=m, batch=B, n=n, alpha=alpha, policy=repr(policy), sdpa_ms=sdpa_ms)
        try:
            g, res = capture(lambda: run_step(ops, policy, q, cache, ids, alpha, scale, None))
            row["graph_ms"], _ = time_graph(g, flush, args.warmup, args.reps)
            sel = res[0]
            if sel is not None:
                total, cov, _ = nbytes(cfg, floor_name, sel)
            else:
                total, cov, _ = nbytes(cfg, floor_name, None)
            row.update(bytes=total, floor_ms=total / COPY_BW * 1e3, coverage=cov)
            want = res[1].clone()
            del g, res
            out = torch.empty_like(q)
            calls = {
                "eager": lambda: decode(q, cache, ids, policy, alpha=alpha, check_finite=False, out=out),
                "default": lambda: decode(q, cache, ids_list, policy, alpha=alpha),
            }
            for graphs, key in ((True, "run"), (False, "direct")):
                dec = Decoder(policy, q_heads=HQ, kv_heads=H, head_dim=D, page_size=P, alpha=alpha, device="cuda",
                              cuda_graphs=graphs)
                dec.plan_cache(cache, ids)
                layer = cache.layer()
                calls[key] = (lambda dec=dec: dec.run(q, layer, out))
            for key, call in calls.items():
                row[f"{key}_ms"], row[f"{key}_mean_ms"] = time_calls(call, flush, args.warmup, args.reps)
                row[f"{key}_host_us"] = host_us(call, args.reps)
                row[f"{key}_stream_ms"] = time_stream(call, args.stream)
                if key == "run":
                    err = (out.float() - want.float()).abs().max().item()
                    row["run_vs_graph_maxabs"] = err
            row["ratio"] = row["graph_ms"] / row["floor_ms"]
            print(f"{name:12s} {m:13s} graph {row['graph_ms']:.4f}  eager {row['eager_ms']:.4f} "
                  f"({row['eager_host_us']:.0f} us host)  run {row['run_ms']:.4f} ({row['run_host_us']:.0f} us)  "
                  f"direct {row['direct_ms']:.4f} ({row['direct_host_us']:.0f} us)  "
                  f"stream eager/run {row['eager_stream_ms']:.4f}/{row['run_stream_ms']:.4f}  sdpa {sdpa_ms:.4f}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed row is recorded, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} {m} ERROR {row['error'][:300]}", flush=True)
        rows.append(row)
    del cache, ids, q, k4, v4
    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    """ms per call of each entry point, per config and policy (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    kinds = [("graph_ms", "graph replay"), ("eager_mean_ms", "eager decode()"), ("run_mean_ms", "Decoder.run"),
             ("direct_mean_ms", "run, no graphs"), ("default_mean_ms", "README call")]
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4.5), squeeze=False)
    for ax, c in zip(axes[0], configs):
        sub = [r for r in rows if r["config"] == c and "error" not in r]
        xs = range(len(sub))
        w = 0.8 / len(kinds)
        for i, (key, label) in enumerate(kinds):
            ax.bar([x + i * w for x in xs], [r[key] for r in sub], w, label=label)
        if sub:
            ax.axhline(sub[0]["sdpa_ms"], color="k", ls="--", lw=1, label="SDPA")
        ax.set_xticks([x + 0.4 - w / 2 for x in xs], [r["method"] for r in sub], rotation=40, ha="right")
        ax.set_yscale("log")
        ax.set_title(c)
        ax.set_ylabel("ms per call")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(API_CONFIGS), help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls before the timed ones (>= 1)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per measurement (>= 1)")
    ap.add_argument("--stream", type=int, default=24, help="calls per back-to-back round (>= 1)")
    ap.add_argument("--out", default=None, help="folder for bench_api.json (default: print only)")
    args = ap.parse_args(argv)
    for flag in ("warmup", "reps", "stream"):
        if getattr(args, flag) < 1:
            ap.error(f"argument --{flag}: expected an int >= 1, got {getattr(args, flag)}")
    configs = args.configs.split(",")
    methods = args.methods.split(",")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"argument --configs: unknown config {c!r} (expected one of {sorted(CONFIGS)})")
    for m in methods:
        if m not in METHODS:
            ap.error(f"argument --methods: unknown method {m!r} (expected one of {list(METHODS)})")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import triton

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    t0 = time.time()
    for c in configs:
        rows += bench_config(c, methods, args, flush)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command="python -m benchmarks.bench_api " + " ".join(sys.argv[1:] if argv is None else argv),
                seconds=round(time.time() - t0, 1))
    data = dict(meta=meta, rows=rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_api.json"), "w") as f:
            json.dump(data, f, indent=1)
        plot(rows, os.path.join(args.out, "bench_api.png"))
    return data


if __name__ == "__main__":
    main()
