"""Approximation quality of sparse decoding (paper Fig. 2, Tables 2-3).

Two sources of (q, K, V):

- synthetic: standard-normal queries, keys and values in a paged cache
  (the model's head layout, no positional bias);
- captured: the twins' own activations. Each twin prefills passkey prompts
  built from the test split, then decodes a few steps with the full cache;
  at every layer of every step the query and that layer's cache (which
  holds the current token) are captured and every policy is evaluated on
  them.

Softmax top-k and entmax top-k run at matched coverages (budget = coverage
x length), Gaussian and certified (entmax only) at their own coverage. Each
is compared with full-cache attention of the same kind: coverage, dropped
mass delta, support recall rho and relative error R, reported as mean ± std
over all (sequence, layer, step, query-head) records.

    python -m entmaxkv.eval.quality --checkpoints checkpoints --out results/quality.json
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from ..backend import resolve_backend
from ..step import run_step
from ..cache import PagedKVCache
from ..metrics import evaluate_selection
from ..model.data import load_split
from ..model.generate import DecodeSession
from ..policies import Certified, Full, Gaussian, TopK
from .._checks import float_flag
from ..limits import ALPHA_MAX
from ..model.data import passkey_min_length
from .common import (POS, TWINS, Timer, add_common_args, add_gaussian_args, check_common_args,
                     check_prompt_lengths, device_info,
                     load_twins, mean_std, model_info, png_path, setup, write_json)
from .passkey import build_prompts

FIELDS = ("coverage", "delta", "rho", "R")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, out_default="results/quality.json")
    g = p.add_argument_group("quality")
    g.add_argument("--coverages", type=float_flag(lo=0.0, hi=1.0, lo_open=True), nargs="+",
                   default=[0.1, 0.125, 0.25, 0.5], help="top-k coverages in (0, 1] (default 0.1 0.125 0.25 0.5)")
    g.add_argument("--synthetic-lengths", type=POS, nargs="+", default=[16384, 32768],
                   help="tokens of the synthetic caches (default 16384 32768)")
    g.add_argument("--synthetic-batch", type=POS, default=8, help="synthetic sequences per length")
    g.add_argument("--capture-lengths", type=POS, nargs="+", default=[4096, 8192],
                   help=f"prompt lengths for captured activations, >= {passkey_min_length()} (default 4096 8192)")
    g.add_argument("--capture-seqs", type=POS, default=4, help="prompts per capture length")
    g.add_argument("--capture-steps", type=POS, default=2, help="decode steps captured per prompt")
    add_gaussian_args(g)
    g.add_argument("--alpha", type=float_flag(lo=1.0, hi=ALPHA_MAX, lo_open=True), default=1.5,
                   help=f"entmax alpha in (1, {ALPHA_MAX:g}] of the synthetic rows")


def check_quality_args(args, stream_len: Optional[int] = None) -> None:
    """ValueError naming the flag, before any work (``stream_len``: the test
    split's size, to check the capture lengths against it)."""
    check_common_args(args)
    check_prompt_lengths("--capture-lengths", args.capture_lengths, stream_len)


def policy_rows(kind: str, n: int, page: int, args):
    """(method, target coverage or None, policy, alpha) for one attention kind."""
    rows = []
    for c in args.coverages:
        budget = max(page, int(round(c * n / page)) * page)
        rows.append(("topk", c, TopK(budget=budget)))
    if kind == "entmax":
        rows.append(("gaussian", None, Gaussian(q_max=args.q_max, margin=args.margin)))
        seed = max(page, int(round(min(args.coverages) * n / page)) * page)
        rows.append(("certified", None, Certified(seed=TopK(budget=seed))))
    return rows


def evaluate_policies(q, cache, slots, *, kind, alpha, scale, slopes, args, ops, sink, key):
    """Run every policy of ``kind`` on one (q, cache) and append per-head metrics to sink."""
    ids = torch.as_tensor(slots, dtype=torch.int32, device=q.device)
    n = cache.length(slots[0])
    for method, target, pol in policy_rows(kind, n, cache.page_size, args):
        rec = sink[key + (kind, method, target)]
        sel, out, _, _ = run_step(ops, pol, q, cache, ids, alpha, scale, slopes, need_bounds=False)
        qual = evaluate_selection(q, cache, slots, sel, out, alpha=alpha, scale=scale, slopes=slopes)
        for f in FIELDS:
            rec[f].extend(getattr(qual, f).double().cpu().tolist())


def summarise(sink) -> List[dict]:
    rows = []
    for (source, length, kind, method, target), rec in sink.items():
        row = {"source": source, "length": length, "attention": kind, "method": method,
               "target_coverage": target}
        for f in FIELDS:
            row[f] = mean_std(rec[f])
        if rec.get("error"):
            row["error"] = rec["error"][0]
        rows.append(row)
    return rows


@torch.no_grad()
def run_quality(args: argparse.Namespace) -> int:
    check_quality_args(args)
    stream = load_split("test")
    check_quality_args(args, len(stream))
    device = setup(args)
    clock = Timer()
    models = load_twins(args, device)
    ops = resolve_backend(args.backend, device)
    cfg = models["entmax"].cfg
    HQ, KV, D, P = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, args.page_size
    scale = 1.0 / math.sqrt(D)
    sink: Dict[tuple, Dict[str, list]] = defaultdict(lambda: defaultdict(list))

    # Synthetic standard-normal q, K, V.
    gen = torch.Generator().manual_seed(args.seed)
    for n in tqdm(args.synthetic_lengths, desc="quality synthetic", file=sys.stderr):
        B = args.synthetic_batch
        per = -(-n // P)
        cache = PagedKVCache(B * per, P, KV, D, max_seqs=B, max_pages_per_seq=per,
                             dtype=torch.float32, device=device)
        slots = []
        for _ in range(B):
            slots.append(cache.allocate(torch.randn(n, KV, D, generator=gen).to(device),
                                        torch.randn(n, KV, D, generator=gen).to(device)))
        q = torch.randn(B, HQ, D, generator=gen).to(device)
        for kind, alpha in (("softmax", 1.0), ("entmax", args.alpha)):
            evaluate_policies(q, cache, slots, kind=kind, alpha=alpha, scale=scale, slopes=None,
                              args=args, ops=ops, sink=sink, key=("synthetic", n))
        del cache

    # Activations captured from the twins while decoding passkey prompts.
    bar = tqdm(total=len(args.capture_lengths) * len(TWINS), desc="quality captured", file=sys.stderr)
    for L in args.capture_lengths:
        rng = np.random.default_rng([args.seed, 7, L])
        prompts, _ = build_prompts(stream, L, args.capture_seqs, rng)
        for twin in TWINS:
            model = models[twin]
            sess = DecodeSession(model, args.capture_seqs, L + args.capture_steps, page_size=P,
                                 backend=args.backend)
            sess.prefill(prompts[:, :-1].to(device))
            slots = sess.slots[0]

            def hook(layer, q, cache, seq_ids, _twin=twin, _model=model):
                evaluate_policies(q, cache, slots, kind=_twin, alpha=_model.cfg.attn_alpha,
                                  scale=_model.scale, slopes=_model.slopes, args=args, ops=ops,
                                  sink=sink, key=("captured", L))

            cur = prompts[:, -1].to(device)
            for _ in range(args.capture_steps):
                lg = sess.step(cur, Full(), layer_hook=hook)
                cur = lg.argmax(-1)
            del sess
            bar.update(1)
    bar.close()

    rows = summarise(sink)
    result = {
        "eval": "quality", "device": device_info(device), "backend": args.backend, "seed": args.seed,
        "models": model_info(models, args),
        "setup": {"coverages": args.coverages, "synthetic_lengths": args.synthetic_lengths,
                  "synthetic_batch": args.synthetic_batch, "capture_lengths": args.capture_lengths,
                  "capture_seqs": args.capture_seqs, "capture_steps": args.capture_steps,
                  "page_size": P, "q_max": args.q_max, "margin": args.margin,
                  "heads": {"q": HQ, "kv": KV, "dim": D},
                  "records": "one per (sequence, layer, step, query head); std is the sample std"},
        "rows": rows, "wall_s": clock(),
    }
    write_json(args.out, result)
    print_table(result)
    if not args.no_plot:
        plot_quality(result, png_path(args.out))
    return 0


def _fmt(ms: dict) -> str:
    return f"{ms['mean']:.4f} ± {ms['std']:.4f}"


def print_table(result: dict) -> None:
    print(f"{'source':<9} {'len':>6} {'attn':<7} {'method':<9} {'target':>6} "
          f"{'coverage':>17} {'delta':>17} {'rho':>17} {'R':>17}")
    for r in result["rows"]:
        t = "-" if r["target_coverage"] is None else f"{r['target_coverage']:.3f}"
        print(f"{r['source']:<9} {r['length']:>6} {r['attention']:<7} {r['method']:<9} {t:>6} "
              + " ".join(f"{_fmt(r[f]):>17}" for f in FIELDS))


def plot_quality(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = [s for s in ("synthetic", "captured") if any(r["source"] == s for r in result["rows"])]
    fig, axes = plt.subplots(len(sources), 3, figsize=(14, 3.8 * len(sources)), squeeze=False)
    for i, source in enumerate(sources):
        rows = [r for r in result["rows"] if r["source"] == source]
        lengths = sorted({r["length"] for r in rows})
        for j, metric in enumerate(("delta", "rho", "R")):
            ax = axes[i][j]
            for L in lengths:
                for kind, color in (("softmax", "tab:red"), ("entmax", "tab:blue")):
                    pts = sorted((r["coverage"]["mean"], r[metric]["mean"], r[metric]["std"]) for r in rows
                                 if r["length"] == L and r["attention"] == kind and r["method"] == "topk")
                    if pts:
                        x, y, e = zip(*pts)
                        ls = "-" if L == lengths[0] else "--"
                        ax.errorbar(x, y, yerr=e, fmt="o" + ls, color=color, capsize=2, alpha=0.8,
                                    label=f"{kind} top-k, n={L}")
                for method, mk in (("gaussian", "*"), ("certified", "D")):
                    for r in rows:
                        if r["length"] == L and r["method"] == method:
                            ax.plot(r["coverage"]["mean"], r[metric]["mean"], mk, ms=10, color="tab:green"
                                    if method == "gaussian" else "k", label=f"entmax {method}, n={L}")
            ax.set_xlabel("coverage")
            ax.set_title(f"{source}: {metric}")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    from ..cli import Parser, run

    p = Parser(prog="python -m entmaxkv.eval.quality", description="Approximation quality of sparse decoding.")
    add_quality_args(p)
    p.set_defaults(func=run_quality)
    return run(p, argv)


if __name__ == "__main__":
    sys.exit(main())
