"""Passkey retrieval over context lengths and token budgets (paper Fig. 3).

For each context length L, ``--trials`` prompts of exactly L tokens are built
from the *test* split (haystack) with test keys (multiples of 7, never seen
in training) at evenly spaced depths. Each twin prefills the prompt minus
its last token once (full attention), then every policy decodes from its own
copy of that cache: the last prompt token and 4 generated digits go through
``entmaxkv.decode``, so all 5 answer digits are predicted by the sparse path
(greedy). A trial is correct when the 5 digits equal the key.

Methods: entmax full / top-k (each budget) / Gaussian / certified, softmax
full / top-k (each budget). For certified, every step's logits are compared
with full-cache decoding's (relative error <= 1e-4 required).

    python -m entmaxkv.eval.passkey --checkpoints checkpoints --out results/passkey.json
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import numpy as np
import torch
from tqdm import tqdm

from ..model.data import PK_DIGITS, decode as detok, draw_key, load_split, passkey_min_length, passkey_prompt
from ..model.generate import DecodeSession, check_budget_flags
from .common import (CERT_TOL, POS, TWINS, Timer, add_common_args, add_gaussian_args,
                     check_common_args, check_prompt_lengths, certified_check, certified_line, device_info,
                     load_twins, model_info, png_path, rel_err, setup, stats_certified, stats_coverage,
                     twin_policies, write_json)


def add_passkey_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, out_default="results/passkey.json")
    g = p.add_argument_group("passkey")
    g.add_argument("--lengths", type=POS, nargs="+", default=[2048, 4096, 8192, 16384],
                   help=f"context lengths in tokens, >= {passkey_min_length()} (default 2048 4096 8192 16384)")
    g.add_argument("--budgets", type=POS, nargs="+", default=[128, 256, 512, 1024],
                   help="top-k token budgets, at least --page-size (default 128 256 512 1024)")
    g.add_argument("--trials", type=POS, default=8, help="prompts per length (default 8)")
    add_gaussian_args(g)
    g.add_argument("--certified-seed-budget", type=POS, default=256,
                   help="budget of the TopK seed of the certified policy, at least --page-size (default 256)")


def check_passkey_args(args, stream_len: Optional[int] = None) -> None:
    """ValueError naming the flag, before any work (``stream_len``: the test
    split's size, to check the lengths against it)."""
    check_common_args(args)
    check_prompt_lengths("--lengths", args.lengths, stream_len)
    check_budget_flags(args, {"--budgets": args.budgets, "--certified-seed-budget": [args.certified_seed_budget]})


def build_prompts(stream: np.ndarray, L: int, trials: int, rng: np.random.Generator):
    """Prompts long [trials, L] and their keys; depths (i + 0.5) / trials."""
    rows, keys = [], []
    for i in range(trials):
        key = draw_key(rng, "test")
        start = int(rng.integers(0, len(stream) - L))
        rows.append(passkey_prompt(stream[start:start + L], key, (i + 0.5) / trials, L))
        keys.append(key)
    return torch.as_tensor(np.stack(rows), dtype=torch.long), keys


@torch.no_grad()
def run_passkey(args: argparse.Namespace) -> int:
    check_passkey_args(args)
    stream = load_split("test")
    check_passkey_args(args, len(stream))
    device = setup(args)
    clock = Timer()
    models = load_twins(args, device)
    cells, cert_checks = [], []
    bar = tqdm(total=len(args.lengths) * len(TWINS), desc="passkey", file=sys.stderr)
    for L in args.lengths:
        rng = np.random.default_rng([args.seed, L])
        prompts, keys = build_prompts(stream, L, args.trials, rng)
        for twin in TWINS:
            model = models[twin]
            pols = twin_policies(twin, args.budgets, L, args, args.certified_seed_budget)
            sess = DecodeSession(model, args.trials, L + PK_DIGITS, page_size=args.page_size,
                                 backend=args.backend, copies=len(pols))
            sess.prefill(prompts[:, :-1].to(device))
            logits_of = {}
            for ci, (method, budget, pol) in enumerate(pols):
                cur = prompts[:, -1].to(device)
                toks, logits, cov, cert = [], [], [], []
                for _ in range(PK_DIGITS):
                    lg, st = sess.step(cur, pol, return_stats=True, copy=ci)
                    cur = lg.argmax(-1)
                    toks.append(cur.cpu())
                    logits.append(lg.float().cpu())
                    cov.append(stats_coverage(st))
                    cert.append(stats_certified(st))
                toks = torch.stack(toks, 1)
                answers = [detok(t.tolist()) for t in toks]
                correct = [a == str(k) for a, k in zip(answers, keys)]
                logits_of[method, budget] = (toks, logits)
                cells.append({
                    "length": L, "model": twin, "method": method, "budget": budget,
                    "accuracy": float(np.mean(correct)), "correct": correct, "answers": answers,
                    "coverage": float(np.mean(cov)), "certified_heads": float(np.mean(cert)),
                })
                bar.set_postfix_str(f"L={L} {twin} {method}{'' if budget is None else budget}")
            if twin == "entmax":
                ft, fl = logits_of["full", None]
                ct, cl = logits_of["certified", None]
                same_tokens = bool(torch.equal(ft, ct))
                errs = [rel_err(c, f) for c, f in zip(cl, fl)]
                cert_checks.append({"length": L, "steps": len(errs), "sequences": args.trials,
                                    "same_tokens": same_tokens, "max_rel_err": max(errs),
                                    "ok": same_tokens and max(errs) <= CERT_TOL})
            del sess
            bar.update(1)
    bar.close()
    result = {
        "eval": "passkey",
        "device": device_info(device), "backend": args.backend, "seed": args.seed,
        "models": model_info(models, args),
        "setup": {"lengths": args.lengths, "budgets": args.budgets, "trials": args.trials,
                  "page_size": args.page_size, "q_max": args.q_max, "margin": args.margin,
                  "certified_seed_budget": args.certified_seed_budget,
                  "haystack": "test split of the stdlib corpus", "keys": "test keys (multiples of 7)",
                  "depths": "(i + 0.5) / trials"},
        "cells": cells,
        "certified_check": certified_check(cert_checks),
        "wall_s": clock(),
    }
    write_json(args.out, result)
    print_table(result)
    if not args.no_plot:
        plot_passkey(result, png_path(args.out))
    return 0 if result["certified_check"]["all_ok"] else 1


def print_table(result: dict) -> None:
    L = result["setup"]["lengths"]
    print(f"passkey accuracy ({result['setup']['trials']} trials per cell)")
    print(f"{'model':<8} {'method':<10} {'budget':>6} " + " ".join(f"{x:>7}" for x in L))
    keys = []
    for c in result["cells"]:
        k = (c["model"], c["method"], c["budget"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        acc = {c["length"]: c.get("accuracy", float("nan")) for c in result["cells"]
               if (c["model"], c["method"], c["budget"]) == k}
        print(f"{k[0]:<8} {k[1]:<10} {str(k[2] or '-'):>6} " + " ".join(
            f"{acc[x]:>7.2f}" if x in acc else f"{'':>7}" for x in L))
    print(certified_line(result["certified_check"]))


def plot_passkey(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, budgets = result["setup"]["lengths"], result["setup"]["budgets"]
    cells = result["cells"]

    def grid(model, method):
        g = np.full((len(budgets), len(lengths)), np.nan)
        for c in cells:
            if c["model"] == model and c["method"] == method and c["budget"] in budgets and "error" not in c:
                g[budgets.index(c["budget"]), lengths.index(c["length"])] = c["accuracy"]
        return g

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, model in zip(axes[:2], ("softmax", "entmax")):
        g = grid(model, "topk")
        ax.imshow(g, vmin=0, vmax=1, cmap="RdYlGn", origin="lower", aspect="auto")
        for i in range(len(budgets)):
            for j in range(len(lengths)):
                if not np.isnan(g[i, j]):
                    ax.text(j, i, f"{g[i, j]:.2f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("token budget")
        ax.set_title(f"{model} top-k")
    ax = axes[2]
    for model, method, style in [("entmax", "full", "-o"), ("entmax", "gaussian", "-s"),
                                 ("entmax", "certified", "--^"), ("softmax", "full", "-x")]:
        ys = [next((c.get("accuracy", np.nan) for c in cells if c["model"] == model and c["method"] == method
                    and c["length"] == L), np.nan) for L in lengths]
        ax.plot(range(len(lengths)), ys, style, label=f"{model} {method}")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title("full cache / adaptive budgets")
    ax.legend(fontsize=8)
    fig.suptitle("Passkey retrieval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    from ..cli import Parser, run

    p = Parser(prog="python -m entmaxkv.eval.passkey",
               description="Passkey retrieval accuracy over lengths and budgets.")
    add_passkey_args(p)
    p.set_defaults(func=run_passkey)
    return run(p, argv)


if __name__ == "__main__":
    sys.exit(main())
