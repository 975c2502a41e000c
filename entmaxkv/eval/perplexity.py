"""Held-out perplexity under full and sparse decoding (paper Fig. 4).

``--windows`` disjoint windows of ``length + 1`` tokens come from the test
split. Each twin prefills the first ``length - tail`` tokens with full
attention, then decodes the last ``tail`` tokens one at a time (teacher
forcing) through ``entmaxkv.decode`` with each policy; perplexity is
exp(mean next-token loss) over those ``tail`` predictions, whose contexts
run from length - tail to length tokens. (Decoding every position of a 16k
window step by step would cost 16k decode steps per policy; the tail is
where the budget binds.) The full-attention forward's perplexity over the
same tail positions is reported as ``forward`` (it should equal ``full``).

Methods: full and top-k at every budget (1024..8192 by default) for both
twins, plus Gaussian and certified for entmax; certified logits are checked
against full-cache logits at every step (relative error <= 1e-4).

    python -m entmaxkv.eval.perplexity --checkpoints checkpoints --out results/perplexity.json
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..model.data import load_split, test_windows
from ..model.generate import DecodeSession, check_budget_flags
from .common import (CERT_TOL, POS, TWINS, Timer, add_common_args, add_gaussian_args,
                     check_common_args, certified_check, certified_line, device_info,
                     load_twins, model_info, png_path, rel_err, setup, stats_certified, stats_coverage,
                     twin_policies, write_json)


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, out_default="results/perplexity.json")
    g = p.add_argument_group("perplexity")
    g.add_argument("--lengths", type=POS, nargs="+", default=[16384],
                   help="context length at the end of each window, > --tail and >= --page-size (default 16384)")
    g.add_argument("--budgets", type=POS, nargs="+", default=[1024, 2048, 4096, 8192],
                   help="top-k token budgets, at least --page-size (default 1024 2048 4096 8192)")
    g.add_argument("--windows", type=POS, default=4, help="test windows per length (default 4)")
    g.add_argument("--tail", type=POS, default=64, help="decoded (scored) tokens per window (default 64)")
    add_gaussian_args(g)
    g.add_argument("--certified-seed-budget", type=POS, default=1024,
                   help="budget of the TopK seed of the certified policy, at least --page-size (default 1024)")


def check_perplexity_args(args, stream_len: Optional[int] = None) -> None:
    """ValueError naming the flag, before any work (``stream_len``: the test
    split's size, to check that the windows fit in it)."""
    check_common_args(args)
    check_budget_flags(args, {"--budgets": args.budgets, "--certified-seed-budget": [args.certified_seed_budget]})
    for L in args.lengths:
        if L <= args.tail:
            raise ValueError(f"--tail: expected fewer tokens than each of --lengths ({L}), got {args.tail}")
        if L < args.page_size:
            raise ValueError(f"--lengths: expected at least --page-size ({args.page_size}) tokens, got {L}")
        if stream_len is not None and args.windows * (L + 1) > stream_len:
            raise ValueError(f"--windows: {args.windows} windows of {L + 1} tokens (--lengths {L}) do not fit "
                             f"in the test split ({stream_len} bytes); expected at most {stream_len // (L + 1)}")


@torch.no_grad()
def run_perplexity(args: argparse.Namespace) -> int:
    check_perplexity_args(args)
    stream = load_split("test")
    check_perplexity_args(args, len(stream))
    device = setup(args)
    clock = Timer()
    models = load_twins(args, device)
    rows, cert_checks = [], []
    bar = tqdm(total=len(args.lengths) * len(TWINS), desc="perplexity", file=sys.stderr)
    for L in args.lengths:
        win = torch.as_tensor(test_windows(stream, args.windows, L + 1, seed=args.seed + L), dtype=torch.long)
        n0 = L - args.tail
        targets = win[:, n0 + 1:L + 1]  # [W, tail]
        for twin in TWINS:
            model = models[twin]
            pols = twin_policies(twin, args.budgets, L, args, min(args.certified_seed_budget, L))
            sess = DecodeSession(model, args.windows, L, page_size=args.page_size,
                                 backend=args.backend, copies=len(pols))
            sess.prefill(win[:, :n0].to(device))
            # Full-attention forward over the whole window, scored on the same tail.
            fwd_logits = torch.cat([
                model.prefill_logits(win[i:i + 1, :L].to(device), tail=args.tail).cpu()
                for i in range(args.windows)
            ])  # [W, tail, V]
            fwd_nll = F.cross_entropy(fwd_logits.flatten(0, 1).float(), targets.flatten()).item()
            rows.append({"length": L, "model": twin, "method": "forward", "budget": None,
                         "nll": fwd_nll, "ppl": math.exp(fwd_nll), "coverage": 1.0})
            logits_of = {}
            for ci, (method, budget, pol) in enumerate(pols):
                nll, cov, cert, logits = 0.0, [], [], []
                for t in range(args.tail):
                    lg, st = sess.step(win[:, n0 + t].to(device), pol, return_stats=True, copy=ci)
                    lg = lg.float()
                    nll += F.cross_entropy(lg, targets[:, t].to(device), reduction="sum").item()
                    cov.append(stats_coverage(st))
                    cert.append(stats_certified(st))
                    if method in ("full", "certified"):
                        logits.append(lg.cpu())
                logits_of[method] = logits
                nll /= args.windows * args.tail
                rows.append({"length": L, "model": twin, "method": method, "budget": budget, "nll": nll,
                             "ppl": math.exp(nll), "coverage": float(np.mean(cov)),
                             "certified_heads": float(np.mean(cert))})
                bar.set_postfix_str(f"L={L} {twin} {method}{'' if budget is None else budget}")
            if twin == "entmax":
                errs = [rel_err(c, f) for c, f in zip(logits_of["certified"], logits_of["full"])]
                cert_checks.append({"length": L, "steps": len(errs), "sequences": args.windows,
                                    "max_rel_err": max(errs), "ok": max(errs) <= CERT_TOL})
            del sess
            bar.update(1)
    bar.close()
    result = {
        "eval": "perplexity", "device": device_info(device), "backend": args.backend, "seed": args.seed,
        "models": model_info(models, args),
        "setup": {"lengths": args.lengths, "budgets": args.budgets, "windows": args.windows,
                  "tail": args.tail, "page_size": args.page_size, "q_max": args.q_max,
                  "margin": args.margin, "certified_seed_budget": args.certified_seed_budget,
                  "text": "disjoint windows of the test split of the stdlib corpus",
                  "unit": "perplexity per byte (byte-level tokens)"},
        "rows": rows,
        "certified_check": certified_check(cert_checks),
        "wall_s": clock(),
    }
    write_json(args.out, result)
    print_table(result)
    if not args.no_plot:
        plot_perplexity(result, png_path(args.out))
    return 0 if result["certified_check"]["all_ok"] else 1


def print_table(result: dict) -> None:
    print(f"{'len':>6} {'model':<8} {'method':<10} {'budget':>6} {'ppl':>9} {'coverage':>9}")
    for r in result["rows"]:
        print(f"{r['length']:>6} {r['model']:<8} {r['method']:<10} {str(r['budget'] or '-'):>6} "
              f"{r['ppl']:>9.4f} {r['coverage']:>9.4f}")
    print(certified_line(result["certified_check"]))


def plot_perplexity(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["setup"]["lengths"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.2), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        rows = [r for r in result["rows"] if r["length"] == L]
        for twin, color in (("softmax", "tab:red"), ("entmax", "tab:blue")):
            pts = sorted((r["budget"], r["ppl"]) for r in rows
                         if r["model"] == twin and r["method"] == "topk")
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=f"{twin} top-k")
            full = next((r["ppl"] for r in rows if r["model"] == twin and r["method"] == "full"), None)
            if full is not None:
                ax.axhline(full, color=color, ls="--", lw=1, label=f"{twin} full cache")
        for method, mk, c in (("gaussian", "*", "tab:green"), ("certified", "D", "k")):
            r = next((r for r in rows if r["model"] == "entmax" and r["method"] == method), None)
            if r is not None:
                ax.plot(r["coverage"] * L, r["ppl"], mk, ms=10, color=c,
                        label=f"entmax {method} (mean tokens read)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
        ax.set_ylabel("perplexity (per byte)")
        ax.set_title(f"context {L}")
        ax.legend(fontsize=8)
    fig.suptitle("Held-out perplexity under sparse decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    from ..cli import Parser, run

    p = Parser(prog="python -m entmaxkv.eval.perplexity",
               description="Held-out perplexity under full and sparse decoding.")
    add_perplexity_args(p)
    p.set_defaults(func=run_perplexity)
    return run(p, argv)


if __name__ == "__main__":
    sys.exit(main())
