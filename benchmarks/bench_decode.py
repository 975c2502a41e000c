"""Decode-step latency of the EntmaxKV Triton kernels against the bytes floor.

A script, not a test. For each configuration it builds a paged cache of
standard-normal keys/values (shuffled block tables), captures one whole
decode step per method (selection + attention) in a CUDA graph, and times
graph replays with CUDA events (warm-up, then the median of timed replays;
the L2 cache is flushed before every timed replay so that repeated calls
cannot serve K/V from L2). torch's scaled_dot_product_attention over the same
cache stored contiguously is timed in the same run.

Each row: method, batch, n (context length), median ms, bytes moved (page
metadata read + K/V of the selected pages + outputs), the floor (bytes at
4.26 TB/s, the H200 copy bandwidth measured here), ratio = ms / floor, and
coverage (kept tokens / n). ``certified_sketch`` runs the certified policy
over the same cache with per-token key sketches (``enable_sketches``; its
bytes count the page summaries and the token sketches it reads instead of
the page boxes). Entmax methods read V only for support tokens,
so they can beat this floor; ``bytes_entmax`` counts what they really need
(metadata + selected K + support V + outputs).

With ``--check`` the outputs of every method are also compared, for two
batch rows, with a float32 PyTorch computation over the same pages (dense
rows from the contiguous copy), which covers batch 8 x 512k and 1M tokens.

Usage (on the GPU machine, from the repository root):

    python -m benchmarks.bench_decode --out benchmarks/results
    python -m benchmarks.bench_decode --configs paper_32k --methods full_softmax,sdpa
    python -m benchmarks.bench_decode --configs paper_128k --config pdl=False   # a launch-config variant
    python -m benchmarks.bench_decode --configs paper_1m --methods gaussian \
        --config attention.split_min_tokens_many=4096   # an A/B variant of one stage's setting
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from entmaxkv.entmax import entmax_from_tau, entmax_threshold
from entmaxkv.types import Certified, Gaussian, TopK

from .harness import build, capture, kernel_config, sketched, time_graph

COPY_BW = 4.26e12  # bytes/s, device-to-device copy bandwidth measured on the H200

CONFIGS = {
    # name: (batch, n, q_heads, kv_heads, head_dim, dtype, page)
    "paper_32k": (8, 32768, 24, 24, 32, torch.float16, 16),
    "paper_128k": (8, 131072, 24, 24, 32, torch.float16, 16),
    "paper_512k": (8, 524288, 24, 24, 32, torch.float16, 16),
    "paper_1m": (8, 1048576, 24, 24, 32, torch.float16, 16),
    "paper_b1_2m": (1, 2097152, 24, 24, 32, torch.float16, 16),
    "gqa_32k": (4, 32768, 32, 8, 128, torch.bfloat16, 16),
    "gqa_128k": (4, 131072, 32, 8, 128, torch.bfloat16, 16),
    "gqa_512k": (4, 524288, 32, 8, 128, torch.bfloat16, 16),
    # one sequence of the Llama-8B shape's attention (bench_generate --suite llama8b)
    "l8_128k": (1, 131072, 32, 8, 128, torch.bfloat16, 16),
    "l8_512k": (1, 524288, 32, 8, 128, torch.bfloat16, 16),
}
ALPHA = 1.5
METHODS = {
    # name: (alpha, policy or None for dense)
    "full_softmax": (1.0, None),
    "full_entmax": (ALPHA, None),
    "quest_topk1024": (1.0, TopK(1024)),
    "entmax_topk1024": (ALPHA, TopK(1024)),
    "entmax_topk4096": (ALPHA, TopK(4096)),
    "gaussian": (ALPHA, Gaussian()),
    "certified": (ALPHA, Certified()),
    "certified_sketch": (ALPHA, Certified()),  # the same policy over a cache with key sketches
    "sdpa": (1.0, "sdpa"),
}
SKETCH_DIMS = 8  # the default of --sketch-dims


def sketch_bytes(cache, ids, q, pol, scale) -> float:
    """Bytes the certified policy reads from a cache with sketches besides
    K/V: every page's summary and the token sketches of the pages it needs
    them for (``policies.certified_parts``, the reference, one batch row at
    a time to bound its memory; outside the timing)."""
    from entmaxkv.policies import certified_parts
    from entmaxkv.scoring import page_layout

    P, H, m = cache.page_size, cache.kv_heads, cache.sketch.dims
    total = 0.0
    for b in range(q.shape[0]):
        row = ids[b:b + 1].long()
        lay = page_layout(cache, row)
        parts = certified_parts(pol, q[b:b + 1], cache, row, lay, H, alpha=ALPHA, scale=scale, slopes=None)
        total += float(lay.num_pages.sum()) * H * (2 * m + 4) + float(parts.sketched.sum()) * P * (m + 4)
    return total


def make_step(K, method, cache, ids, q, k4, v4, scale, config=None):
    """A closure running one decode step; returns (out, sel or None, tau or None).
    ``config``: the kernels' KernelConfig (None: defaults)."""
    alpha, pol = METHODS[method]
    if pol == "sdpa":
        HQ, H = q.shape[1], k4.shape[1]
        q4 = q[:, :, None, :]

        def step():
            o = torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, scale=scale, enable_gqa=HQ != H)
            return o[:, :, 0, :], None, None
        return step
    if pol is None:
        def step():
            o, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, config=config)
            return o, None, tau
        return step

    def step():
        sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, config=config)
        o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, tau_init=sel.tau_hat, config=config)
        return o, sel, tau
    return step


def nbytes(cfg, method, sel, seed_counts=None, sketch_extra=0.0):
    """Bytes of the spec's floor: metadata + selected K/V + outputs."""
    B, n, HQ, H, D, dtype, P = cfg
    es = torch.tensor([], dtype=dtype).element_size()
    npages = -(-n // P)
    out = B * HQ * D * es
    kv_tok = 2 * D * es  # K + V of one token of one KV head
    alpha, pol = METHODS[method]
    if pol is None or pol == "sdpa":
        return B * H * n * kv_tok + out, 1.0, None
    meta = B * H * npages * 2 * D * es  # two metadata tensors (min/max or mean/std)
    if method == "certified_sketch":
        meta = sketch_extra  # summaries and token sketches instead of page boxes
    counts = sel.counts.to(torch.float64)  # [B, S]
    S = counts.shape[1]
    # per selection row, tokens of the kept pages (every row here has length n)
    toks = (counts * P).clamp(max=n)
    reads = toks.sum().item() * (H / S) if S == H else toks.sum().item()
    cov = (toks / n).mean().item()
    total = meta + reads * kv_tok + out
    if isinstance(pol, Certified):
        seed_toks = min(max(pol.seed.budget // P, 1) * P, n) * B * H if isinstance(pol.seed, TopK) else 0
        total += seed_toks * kv_tok / 2  # K of the seed pages for tau_A
    return total, cov, reads


def ref_row(q, k4, v4, b, alpha, scale, pages=None, P=16):
    """float32 reference for batch row b: (out [HQ, D], tau [HQ]) over the kept tokens."""
    HQ, D = q.shape[1], q.shape[2]
    H = k4.shape[1]
    G = HQ // H
    outs, taus = [], []
    for h in range(HQ):
        kv = h // G
        if pages is None:
            kk, vv = k4[b, kv].float(), v4[b, kv].float()
        else:
            s = kv if len(pages) == H else h
            tok = (pages[s][:, None] * P + torch.arange(P, device=pages[s].device)).flatten()
            tok = tok[tok < k4.shape[2]]
            kk, vv = k4[b, kv, tok].float(), v4[b, kv, tok].float()
        sc = (kk @ q[b, h].float()) * scale
        tau, _ = entmax_threshold(sc, alpha)
        p = entmax_from_tau(sc, tau, alpha)
        outs.append(p @ vv)
        taus.append(tau)
    return torch.stack(outs), torch.stack(taus)


def check(cfg, method, res, q, k4, v4, scale, rows=(0, -1)):
    """Max relative error of out over the checked rows (and tau, abs)."""
    o, sel, tau = res
    alpha, pol = METHODS[method]
    B = q.shape[0]
    P = cfg[6]
    errs, terrs = [], []
    for b in rows:
        b = b % B
        pages = None
        if sel is not None:
            S = sel.pages.shape[1]
            pages = [sel.pages[b, s, : int(sel.counts[b, s])].long() for s in range(S)]
        ro, rt = ref_row(q, k4, v4, b, alpha, scale, pages, P)
        errs.append(((o[b].float() - ro).norm() / ro.norm()).item())
        if tau is not None:
            terrs.append((tau[b].float() - rt).abs().max().item())
    return max(errs), (max(terrs) if terrs else None)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for col, fam in enumerate(("paper", "gqa")):
        sub = [r for r in rows if r["config"].startswith(fam)]
        for meth in METHODS:
            pts = sorted((r["n"], r["ms"], r["ratio"], r["batch"]) for r in sub if r["method"] == meth and r.get("ms"))
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0, col].plot(xs, [p[1] for p in pts], "o-", label=meth)
            axes[1, col].plot(xs, [p[2] for p in pts], "o-", label=meth)
        cfgname = "batch 8 (2M: batch 1), 24 heads, d 32, fp16" if fam == "paper" else "batch 4, 32q/8kv heads, d 128, bf16"
        axes[0, col].set_title(f"{fam}: {cfgname}")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length n")
            ax.grid(True, alpha=0.3)
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("decode step latency (ms, median)")
        axes[1, col].set_ylabel("ratio to bytes floor (4.26 TB/s)")
        axes[1, col].axhline(1.0, color="k", lw=0.8)
        axes[0, col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warm-ms", type=float, default=200.0,
                    help="untimed replays go on for at least this long (after --warmup of them)")
    ap.add_argument("--check", action="store_true", help="compare outputs with a float32 reference")
    ap.add_argument("--sketch-dims", type=int, default=SKETCH_DIMS,
                    help="coordinates per token of certified_sketch's key sketches (1 .. head_dim; i.i.d. keys "
                         "have no low-rank structure: head_dim)")
    ap.add_argument("--out", default=None, help="folder for bench_decode.json / .png")
    ap.add_argument("--config", action="append", default=[], metavar="[STAGE.]FIELD=VALUE",
                    help="a KernelConfig field for every kernel call (A/B runs), e.g. pdl=False or "
                         "attention.prefetch_pages=False; recorded in the JSON")
    args = ap.parse_args(argv)
    kcfg = kernel_config(args.config)

    from entmaxkv import kernels as K

    torch.backends.cuda.matmul.allow_tf32 = False
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=__import__("triton").__version__, python=platform.python_version(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command="python -m benchmarks.bench_decode " + " ".join(sys.argv[1:]),
        config=args.config, copy_bandwidth_Bps=COPY_BW,
        timing="CUDA-graph replay, CUDA events, L2 flushed before each timed replay, "
        f"at least {args.warmup} warm-ups and {args.warm_ms:g} ms of them, median of {args.reps}",
    )
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        B, n, HQ, H, D, dtype, P = cfg
        t0 = time.time()
        cache, ids, q, k4, v4 = build(cfg)
        print(f"# {cname}: built in {time.time() - t0:.1f}s", flush=True)
        scale = 1.0 / math.sqrt(D)
        with_sketch = None
        for meth in args.methods.split(","):
            if meth == "certified_sketch" and with_sketch is None:
                with_sketch = sketched(cache, args.sketch_dims)
            row = dict(config=cname, method=meth, batch=B, n=n, q_heads=HQ, kv_heads=H, head_dim=D,
                       dtype=str(dtype).replace("torch.", ""), page=P)
            if meth == "certified_sketch":
                row["sketch_dims"] = args.sketch_dims
            try:
                c = with_sketch if meth == "certified_sketch" else cache
                step = make_step(K, meth, c, ids, q, k4, v4, scale, kcfg)
                g, res = capture(step)
                ms, ts = time_graph(g, flush, args.warmup, args.reps, args.warm_ms)
                extra = sketch_bytes(c, ids, q, METHODS[meth][1], scale) if meth == "certified_sketch" else 0.0
                total, cov, _ = nbytes(cfg, meth, res[1], sketch_extra=extra)
                floor = total / COPY_BW * 1e3
                row.update(ms=ms, ms_min=ts[0], ms_max=ts[-1], bytes=total, floor_ms=floor, ratio=ms / floor,
                           coverage=cov, GBps=total / ms / 1e6)
                if args.check:
                    try:
                        err, terr = check(cfg, meth, res, q, k4, v4, scale)
                        row.update(rel_err=err, tau_abs_err=terr)
                    except Exception as exc:  # noqa: BLE001
                        row.update(check_error=f"{type(exc).__name__}: {exc}"[:300])
                del g, res
            except Exception as exc:  # keep going: one failing method must not hide the others
                row.update(error=f"{type(exc).__name__}: {exc}"[:500])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cache, with_sketch, ids, q, k4, v4
        torch.cuda.empty_cache()
        if args.out:  # after every configuration, so a time limit keeps what was measured
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.out:
        try:
            plot(rows, os.path.join(args.out, "bench_decode.png"))
        except Exception as exc:  # noqa: BLE001
            print("plot failed:", exc)
    # short table last
    print(f"\n{'config':13s} {'method':16s} {'ms':>8s} {'floor':>7s} {'ratio':>6s} {'cov':>6s} {'err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:13s} {r['method']:16s} ERROR {r['error'][:80]}")
            continue
        err = r.get("rel_err")
        print(f"{r['config']:13s} {r['method']:16s} {r['ms']:8.4f} {r['floor_ms']:7.4f} {r['ratio']:6.2f} "
              f"{r['coverage']:6.3f} {err if err is None else format(err, '8.1e')}")


if __name__ == "__main__":
    main()
