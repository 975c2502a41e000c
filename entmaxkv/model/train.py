"""Train the entmax / softmax twins in lockstep.

Both models are built from the same seed (identical initial weights), see
the same batches in the same order, with the same optimiser and schedule;
they differ only in the attention mapping. One process steps them in
alternation, so a fixed wall-clock budget gives both the same number of
steps: after a few calibration steps the total is fixed from the measured
time per (entmax + softmax) step, and the cosine schedule uses that total.

Data: the train split of the stdlib corpus (``data.py``), 2048-token rows,
30% of which start with a passkey example (loss weight 5 on the answer
digits). Nothing here reads the test split except the final held-out loss,
reported once after training (it chooses nothing).

Usage (see scripts/train_twins.py):
    python scripts/train_twins.py --out checkpoints --time-budget 300
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import device_flag, float_flag, int_flag
from ..limits import ALPHA_MAX
from .checkpoint import check_model_dir, load_model, save_model
from .data import (BatchRecipe, PK_DIGITS, draw_key, encode, load_split, passkey_prompt,
                   sample_batch, test_windows)
from .lm import ModelConfig, TransformerLM

TWINS = ("entmax", "softmax")


POS = int_flag(lo=1)
NONNEG = int_flag(lo=0)
UNIT = float_flag(lo=0.0, hi=1.0)
POS_FLOAT = float_flag(lo=0.0, lo_open=True)
NONNEG_FLOAT = float_flag(lo=0.0)
# Calibration times the steps after the third (the first ones pay for warm-up).
CALIB_FIRST = 3


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="checkpoints", help="output folder (one subfolder per twin)")
    p.add_argument("--device", type=device_flag, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=NONNEG, default=0)
    p.add_argument("--steps", type=POS, default=4000, help="maximum optimiser steps (default 4000)")
    p.add_argument("--time-budget", type=POS_FLOAT, default=None,
                   help="seconds of training for both twins together; fixes the step count "
                        "after --calib-steps steps (default: run --steps)")
    p.add_argument("--calib-steps", type=int_flag(lo=CALIB_FIRST + 1), default=12,
                   help=f"steps before the step count is fixed (> {CALIB_FIRST}; default 12)")
    p.add_argument("--batch", type=POS, default=16)
    p.add_argument("--seq-len", type=POS, default=2048,
                   help="tokens per row; at least the shortest passkey example when --p-passkey > 0")
    p.add_argument("--lr", type=POS_FLOAT, default=3e-3)
    p.add_argument("--min-lr-ratio", type=UNIT, default=0.1)
    p.add_argument("--warmup", type=NONNEG, default=100)
    p.add_argument("--weight-decay", type=NONNEG_FLOAT, default=0.1)
    p.add_argument("--grad-clip", type=POS_FLOAT, default=1.0)
    p.add_argument("--p-passkey", type=UNIT, default=0.3)
    p.add_argument("--answer-weight", type=NONNEG_FLOAT, default=5.0)
    p.add_argument("--p-copy", type=UNIT, default=0.0,
                   help="fraction of rows holding a random digit string twice (induction practice); "
                        "--p-passkey + --p-copy <= 1")
    p.add_argument("--init-from", default=None,
                   help="continue from the twins in this folder (a second training stage)")
    p.add_argument("--chunk", type=POS, default=512, help="query block of the entmax attention")
    p.add_argument("--log-every", type=POS, default=25)
    # model shape
    p.add_argument("--d-model", type=POS, default=256)
    p.add_argument("--n-layers", type=POS, default=6)
    p.add_argument("--n-heads", type=POS, default=8, help="query heads, dividing --d-model")
    p.add_argument("--n-kv-heads", type=POS, default=4, help="KV heads, dividing --n-heads")
    p.add_argument("--d-ff", type=POS, default=704)
    p.add_argument("--positions", default="nape", choices=["nape", "rope", "alibi", "nope"])
    p.add_argument("--alpha", type=float_flag(lo=1.0, hi=ALPHA_MAX, lo_open=True), default=1.5,
                   help=f"entmax alpha in (1, {ALPHA_MAX:g}] of every attention layer (default 1.5)")
    p.add_argument("--val-windows", type=POS, default=16, help="held-out windows for the final loss")
    p.add_argument("--no-amp", action="store_true", help="train in float32 (default bf16 autocast on CUDA)")


def check_train_args(args) -> None:
    """ValueError naming the flag for settings that do not fit together,
    before any data or model is loaded."""
    if args.p_passkey + args.p_copy > 1.0:
        raise ValueError(f"--p-copy: expected --p-passkey + --p-copy <= 1, got {args.p_passkey} + {args.p_copy}")
    shortest = BatchRecipe().min_passkey_len
    if (args.p_passkey > 0 or args.p_copy > 0) and args.seq_len < shortest:
        raise ValueError(f"--seq-len: expected at least {shortest} tokens when --p-passkey or --p-copy > 0 "
                         f"(the shortest passkey example), got {args.seq_len}")
    if args.d_model % args.n_heads:
        raise ValueError(f"--n-heads: expected a divisor of --d-model ({args.d_model}), got {args.n_heads}")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(f"--n-kv-heads: expected a divisor of --n-heads ({args.n_heads}), got {args.n_kv_heads}")
    if args.positions == "rope" and (args.d_model // args.n_heads) % 2:
        raise ValueError("--positions: rope needs an even head dim (--d-model / --n-heads)")
    if args.init_from:
        for name in TWINS:
            check_model_dir(Path(args.init_from) / name, "--init-from")
    if Path(args.out).is_file():
        raise ValueError(f"--out: expected a folder, {args.out!r} is a file")


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def weighted_loss(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
    return (ce * w.flatten()).sum() / w.sum()


@torch.no_grad()
def heldout_loss(model: TransformerLM, windows: np.ndarray, device, amp: bool, chunk) -> float:
    """Mean next-token loss (nats/byte) on held-out windows (full attention)."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), 4):
        x = torch.as_tensor(windows[i:i + 4], dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x[:, :-1], chunk=chunk)
        tot += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


@torch.no_grad()
def passkey_probe(model: TransformerLM, stream: np.ndarray, device, amp: bool, chunk,
                  lengths=(512, 1024, 2048), trials: int = 8, seed: int = 12345) -> Dict[str, float]:
    """Teacher-forced passkey digit accuracy with full attention.

    A training diagnostic only: haystacks are random crops of the *train*
    split and keys are training-type keys from a separate seed (the test
    passkeys are never looked at during training)."""
    model.eval()
    rng = np.random.default_rng(seed)
    res = {}
    for L in lengths:
        rows, keys = [], []
        for _ in range(trials):
            key = draw_key(rng, "train")
            start = int(rng.integers(0, len(stream) - L))
            prompt = passkey_prompt(stream[start:start + L], key, float(rng.random()), L - PK_DIGITS)
            rows.append(np.concatenate([prompt, encode(str(key))]))
            keys.append(key)
        x = torch.as_tensor(np.stack(rows), dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x[:, :-1], chunk=chunk)
        pred = logits[:, -PK_DIGITS:].argmax(-1)
        res[str(L)] = float((pred == x[:, -PK_DIGITS:]).all(-1).float().mean())
    model.train()
    return res


def train(args) -> dict:
    check_train_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp = device.type == "cuda" and not args.no_amp
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_stream = load_split("train")
    test_stream = load_split("test")
    recipe = BatchRecipe(seq_len=args.seq_len, p_passkey=args.p_passkey, answer_weight=args.answer_weight,
                         p_copy=args.p_copy)

    models, opts, cfgs = {}, {}, {}
    for name in TWINS:
        cfg = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          n_kv_heads=args.n_kv_heads, d_ff=args.d_ff, attention=name,
                          alpha=args.alpha, positions=args.positions, train_context=args.seq_len)
        torch.manual_seed(args.seed)  # identical initial weights for both twins
        if args.init_from:
            m = load_model(Path(args.init_from) / name, device=device).train()
            cfg = m.cfg
        else:
            m = TransformerLM(cfg).to(device)
        decay = [p for p in m.parameters() if p.dim() >= 2]
        no_decay = [p for p in m.parameters() if p.dim() < 2]
        opts[name] = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
        )
        models[name], cfgs[name] = m, cfg
    n_params = models["entmax"].num_parameters()
    print(f"device {device}, amp {amp}, params per twin {n_params:,}", flush=True)

    rng = np.random.default_rng(args.seed)
    total = args.steps
    history: List[dict] = []
    t_start = time.time()
    t_calib = None
    chunk = {"entmax": args.chunk, "softmax": None}
    ema = {n: None for n in TWINS}
    step = 0
    while step < total:
        xb, wb = sample_batch(train_stream, rng, args.batch, recipe)
        x = torch.as_tensor(xb, dtype=torch.long).to(device, non_blocking=True)
        w = torch.as_tensor(wb).to(device, non_blocking=True)
        lr = lr_at(step, total, args)
        losses = {}
        for name in TWINS:
            m, opt = models[name], opts[name]
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = m(x[:, :-1], chunk=chunk[name])
            loss = weighted_loss(logits, x[:, 1:], w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), args.grad_clip)
            opt.step()
            losses[name] = loss
        step += 1
        if step == CALIB_FIRST:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if args.time_budget is not None and step == args.calib_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / (step - CALIB_FIRST)
            left = args.time_budget - (time.time() - t_start)
            total = min(args.steps, step + max(0, int(left / per_step)))
            print(f"calibration: {per_step * 1000:.0f} ms per twin pair step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            rec = {"step": step, "lr": lr, "time_s": round(time.time() - t_start, 1)}
            for name in TWINS:
                v = losses[name].item()
                ema[name] = v if ema[name] is None else 0.9 * ema[name] + 0.1 * v
                rec[f"loss_{name}"] = round(v, 4)
            history.append(rec)
            toks = step * args.batch * args.seq_len
            print(f"step {step}/{total} lr {lr:.2e} " + " ".join(
                f"{n} {rec['loss_' + n]:.3f}" for n in TWINS) + f" | {toks / (time.time() - t_start):,.0f} tok/s",
                flush=True)
    train_time = time.time() - t_start

    windows = test_windows(test_stream, args.val_windows, args.seq_len + 1, seed=args.seed + 1)
    log = {
        "recipe": {k: v for k, v in vars(args).items()},
        "data": {"corpus": "stdlib311 (CPython 3.11.7 standard library .py files)",
                 "train_bytes": int(len(train_stream)), "test_bytes": int(len(test_stream)),
                 "batch_recipe": asdict(recipe)},
        "steps": step, "tokens_per_twin": step * args.batch * args.seq_len,
        "train_time_s": round(train_time, 1), "params_per_twin": n_params,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "history": history, "final": {},
    }
    for name in TWINS:  # save first: the diagnostics below must not cost the weights
        save_model(models[name], out / name, extra={"steps": step, "seed": args.seed})
    for name in TWINS:
        m = models[name]
        final = {
            "train_loss_last": history[-1][f"loss_{name}"] if history else None,
            "heldout_loss_nats_per_byte": heldout_loss(m, windows, device, amp, chunk[name]),
            "passkey_probe_full_attention": passkey_probe(m, train_stream, device, amp, chunk[name],
                                                          lengths=(512, 1024, args.seq_len)),
        }
        final["heldout_bits_per_byte"] = final["heldout_loss_nats_per_byte"] / math.log(2)
        log["final"][name] = final
        save_model(m, out / name, extra={"steps": step, "final": final, "seed": args.seed})
        print(f"{name}: {json.dumps(final)}", flush=True)
    log_name = "train_log.json" if not args.init_from else "train_log_stage2.json"
    (out / log_name).write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: Optional[List[str]] = None) -> int:
    from ..cli import Parser, run

    p = Parser(prog="python -m entmaxkv.model.train", description="Train the entmax / softmax twin models in lockstep.")
    add_train_args(p)
    p.set_defaults(func=_run_train)
    return run(p, argv)


def _run_train(args) -> int:
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
