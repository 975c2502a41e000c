"""Fused causal prefill attention (kernels/prefill/) timed against torch SDPA.

A script, not a test (run on the GPU machine). For each shape and length,
in one process and on the same data:

- ``ms``: ``causal_attention`` (softmax, alpha = 1, or alpha-entmax), the
  median of ``--reps`` calls after ``--warmup`` untimed ones, CUDA events
  around each call, the L2 flushed before it (bench_api.time_calls);
- ``sdpa_ms``: torch's causal ``scaled_dot_product_attention`` on the same
  q, k, v (flash backend where it takes the shape; softmax only, and
  without the ALiBi bias, which the flash backend cannot add: a speed
  baseline, not the same function for ALiBi heads);
- ``tflops``: 2 * 2 * B * H * (T^2 / 2) * D, the causal FLOPs of one pass
  over the keys (QK and PV), divided by the time; ``key_passes``: how many
  times the entmax programs read their keys (1 for softmax), the mean
  weighted by each program's key count and the max;
- ``ratio``: ms / sdpa_ms.

Shapes: ``twin`` (B=1, H=8, KV=4, D=32, NAPE slopes: the 6-layer model's
attention) at 16k, 32k, 128k and ``llama8b`` (H=32, KV=8, D=128, no slopes)
at 32k, 128k, each with alpha 1.5 and 1.0.

    python -m benchmarks.bench_prefill --out benchmarks/results
    python -m benchmarks.bench_prefill --shapes twin --lengths 131072 --alphas 1.5
    python -m benchmarks.bench_prefill --device cpu --dry-run     # interpreter, tiny shapes

``--config FIELD=VALUE`` sets PrefillConfig fields (VALUE a Python literal).
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
import warnings
from datetime import datetime, timezone

# (B, H, KV, D, NAPE slopes, default lengths); dry runs shrink heads and lengths.
SHAPES = {
    "twin": (1, 8, 4, 32, True, (16384, 32768, 131072)),
    "llama8b": (1, 32, 8, 128, False, (32768, 131072)),
}
DRY = {"twin": (1, 8, 4, 32, True, (48,)), "llama8b": (1, 4, 2, 128, False, (40,))}


def causal_flops(B: int, H: int, T: int, D: int) -> float:
    """FLOPs of one causal pass over the keys (QK and PV): 2 * 2 * B * H * T^2/2 * D."""
    return 2.0 * 2.0 * B * H * (T * T / 2.0) * D


def weighted_passes(passes, T: int, block_m: int):
    """(mean weighted by each program's key count, max) of an int32 [B * H,
    query blocks] pass count: block i reads about (i + 1) * block_m keys."""
    import torch

    nm = passes.shape[1]
    keys = torch.arange(1, nm + 1, dtype=torch.float64, device=passes.device).clamp(max=math.ceil(T / block_m))
    w = keys.expand_as(passes)
    return float((passes.double() * w).sum() / w.sum()), int(passes.max())


def _time(call, device, flush, warmup: int, reps: int) -> float:
    """Median ms of ``reps`` calls: CUDA events (bench_api.time_calls) on
    the GPU, the host clock on the CPU."""
    if device == "cuda":
        from .bench_api import time_calls

        return time_calls(call, flush, warmup, reps)[0]
    for _ in range(warmup):
        call()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _sdpa(q, k, v, scale):
    """torch causal SDPA with GQA: the flash backend where it runs, else the
    default choice; returns (call, backend name)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    gqa = q.shape[1] != k.shape[1]

    def default():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    if q.device.type == "cuda":
        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return default()
        try:
            flash()
            return flash, "flash"
        except RuntimeError:
            pass
    return default, "default"


def bench_shape(name, B, H, KV, D, nape, T, alphas, args, cfg, flush):
    import torch

    from entmaxkv.kernels.prefill.launch import _tiles, causal_attention, causal_attention_passes
    from entmaxkv.kernels._common import next_pow2
    from entmaxkv.model.lm import ModelConfig

    dev = args.device
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(B, KV, T, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(B, KV, T, D, device=dev, dtype=dtype, generator=gen)
    slopes = None
    if nape:
        slopes = torch.tensor(ModelConfig(n_heads=H, n_kv_heads=KV, d_model=H * D).alibi_slopes(),
                              dtype=torch.float32, device=dev)
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    flops = causal_flops(B, H, T, D)
    sdpa_call, backend = _sdpa(q, k, v, scale)
    sdpa_ms = _time(sdpa_call, dev, flush, args.warmup, args.reps)
    rows = []
    for alpha in alphas:
        row = dict(shape=name, B=B, H=H, KV=KV, D=D, T=T, alibi="nape" if nape else "none", alpha=alpha,
                   dtype=args.dtype, sdpa_ms=sdpa_ms, sdpa_backend=backend, sdpa_tflops=flops / sdpa_ms / 1e9)
        try:
            _, passes = causal_attention_passes(q, k, v, alpha=alpha, scale=scale, slopes=slopes, config=cfg, out=out)
            bm = _tiles(cfg, max(16, next_pow2(D)), dtype, alpha)[0]
            row["key_passes"], row["key_passes_max"] = weighted_passes(passes, T, bm)
            ms = _time(lambda: causal_attention(q, k, v, alpha=alpha, scale=scale, slopes=slopes, config=cfg,
                                                out=out), dev, flush, args.warmup, args.reps)
            row.update(ms=ms, tflops=flops / ms / 1e9, ratio=ms / sdpa_ms)
            if alpha == 1.0 and slopes is None:  # the same function as SDPA: say how close
                want = sdpa_call()
                row["sdpa_maxabs"] = float((out.float() - want.float()).abs().max())
            print(f"{name:8s} T={T:7d} alpha={alpha:<4} {ms:10.3f} ms {row['tflops']:7.1f} TFLOP/s  "
                  f"passes {row['key_passes']:.2f} (max {row['key_passes_max']})  "
                  f"sdpa({backend}) {sdpa_ms:9.3f} ms  ratio {row['ratio']:.2f}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed row is recorded, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} T={T} alpha={alpha} ERROR {row['error'][:300]}", flush=True)
        rows.append(row)
    del q, k, v, out
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--lengths", default=None, help="comma list of T (default: each shape's own)")
    ap.add_argument("--alphas", default="1.5,1.0", help="comma list of alpha in [1, 4]")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: Triton's interpreter (use with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, 1 warm-up, 1 rep: checks the script")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed ones (>= 1)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per measurement (>= 1)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a PrefillConfig field (repeatable), e.g. block_m=128")
    ap.add_argument("--out", default=None, help="a .json file, or a folder for bench_prefill.json")
    args = ap.parse_args(argv)
    for flag in ("warmup", "reps"):
        if getattr(args, flag) < 1:
            ap.error(f"argument --{flag}: expected an int >= 1, got {getattr(args, flag)}")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"argument --shapes: unknown shape {s!r} (expected one of {list(SHAPES)})")
    try:
        alphas = [float(a) for a in args.alphas.split(",")]
        lengths = None if args.lengths is None else [int(t) for t in args.lengths.split(",")]
    except ValueError as exc:
        ap.error(f"argument --alphas/--lengths: {exc}")
    if args.device == "cpu":
        if not args.dry_run:
            ap.error("argument --device: cpu runs only with --dry-run (Triton's interpreter is slow)")
        # the interpreter is chosen when the kernels are first imported (below);
        # it evaluates both sides of tl.where, inf - inf on masked lanes included
        os.environ.setdefault("TRITON_INTERPRET", "1")
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    if args.dry_run:
        args.warmup, args.reps = 1, 1

    import torch
    import triton

    from entmaxkv.kernels.prefill import PrefillConfig

    from .harness import kernel_config

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA device (or use --device cpu --dry-run)")
    cfg = kernel_config(args.config, base=PrefillConfig())
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if args.device == "cuda" else None
    table = DRY if args.dry_run else SHAPES
    rows = []
    t0 = time.time()
    for name in shapes:
        B, H, KV, D, nape, own = table[name]
        for T in (lengths if lengths and not args.dry_run else own):
            rows += bench_shape(name, B, H, KV, D, nape, T, alphas, args, cfg, flush)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu (Triton interpreter), {platform.processor()}"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command="python -m benchmarks.bench_prefill " + " ".join(sys.argv[1:] if argv is None else argv),
                config=repr(cfg), seconds=round(time.time() - t0, 1))
    data = dict(meta=meta, rows=rows)
    if args.out:
        path = args.out if args.out.endswith(".json") else os.path.join(args.out, "bench_prefill.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"# wrote {path}")
    return data


if __name__ == "__main__":
    main()
