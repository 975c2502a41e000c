"""Shared pieces of the evaluations: models, policies, certified check, output."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from .._checks import device_flag, float_flag, int_flag
from ..backend import BACKENDS
from ..model.checkpoint import check_model_dir, load_model
from ..model.data import passkey_min_length
from ..model.lm import ModelConfig, TransformerLM
from ..policies import Certified, Full, Gaussian, TopK

TWINS = ("entmax", "softmax")
# Certified decoding must reproduce full-cache logits to rounding (float32).
CERT_TOL = 1e-4


POS = int_flag(lo=1)
NONNEG = int_flag(lo=0)
Q_MAX = float_flag(lo=0.0, hi=1.0, lo_open=True, hi_open=True)
NONNEG_FLOAT = float_flag(lo=0.0)


def add_common_args(p: argparse.ArgumentParser, *, out_default: str) -> None:
    g = p.add_argument_group("models and output")
    g.add_argument("--checkpoints", default="checkpoints",
                   help="folder holding the twins entmax/ and softmax/ (default checkpoints)")
    g.add_argument("--random-tiny", action="store_true",
                   help="use randomly initialised tiny twins instead of checkpoints (CI smoke runs)")
    g.add_argument("--out", default=out_default, help=f"output JSON path (default {out_default}); "
                   "the plot goes next to it with a .png suffix")
    g.add_argument("--device", type=device_flag, default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="entmaxkv.decode backend (default auto)")
    g.add_argument("--page-size", type=POS, default=16, help="tokens per cache page (default 16)")
    g.add_argument("--seed", type=NONNEG, default=0, help="seed of the evaluation data (default 0)")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")


def add_gaussian_args(g) -> None:
    """--q-max and --margin of the Gaussian policy (argument group ``g``)."""
    g.add_argument("--q-max", type=Q_MAX, default=0.995, help="Gaussian page-max quantile in (0, 1)")
    g.add_argument("--margin", type=NONNEG_FLOAT, default=0.0, help="Gaussian threshold margin >= 0")


def check_common_args(args) -> None:
    """ValueError naming the flag for a --checkpoints folder without the twins
    (unless --random-tiny) or an --out that is a folder; before any work."""
    if not args.random_tiny:
        for name in TWINS:
            check_model_dir(Path(args.checkpoints) / name, "--checkpoints")
    if Path(args.out).is_dir():
        raise ValueError(f"--out: expected a JSON file path, {args.out!r} is a folder")


def check_prompt_lengths(flag: str, lengths, stream_len: Optional[int] = None) -> None:
    """ValueError naming ``flag`` for a passkey prompt length below the
    shortest prompt, or (``stream_len`` given) not below the test split's size."""
    lo = passkey_min_length()
    for L in lengths:
        if L < lo or (stream_len is not None and L >= stream_len):
            hi = f" and < {stream_len} (the test split's bytes)" if stream_len is not None else ""
            raise ValueError(f"{flag}: expected passkey prompt lengths >= {lo}{hi}, got {L}")


def setup(args) -> torch.device:
    """Device and float32 numerics (no TF32: certified vs full is checked to 1e-4).
    Run it after the command's checks: it changes global torch settings."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def tiny_config(attention: str) -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, attention=attention,
                       positions="nape", train_context=256)


def load_twins(args, device) -> Dict[str, TransformerLM]:
    """The two models, float32, eval mode. ``--random-tiny`` builds random
    tiny twins (same seed, so identical weights) with sharpened attention."""
    models = {}
    for name in TWINS:
        if args.random_tiny:
            torch.manual_seed(1234)
            m = TransformerLM(tiny_config(name))
            with torch.no_grad():  # peakier scores so entmax is sparse, as in a trained model
                for blk in m.blocks:
                    blk.attn.wq.weight.mul_(6.0)
                    blk.attn.wk.weight.mul_(6.0)
            models[name] = m.to(device).eval()
        else:
            models[name] = load_model(Path(args.checkpoints) / name, device=device)
    return models


def model_info(models: Dict[str, TransformerLM], args) -> dict:
    m = next(iter(models.values()))
    return {
        "checkpoints": None if args.random_tiny else str(args.checkpoints),
        "random_tiny": bool(args.random_tiny),
        "config": {n: mm.cfg.to_dict() for n, mm in models.items()},
        "params": m.num_parameters(),
    }


def device_info(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| per row, max over rows (rows = leading dim)."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-300)).max())


def mean_std(xs) -> Dict[str, float]:
    x = np.asarray([float(v) for v in xs], dtype=np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if x.size > 1 else 0.0, "n": int(x.size)}


def stats_coverage(stats_per_layer) -> float:
    """Mean coverage over layers, batch rows and heads of one decode step."""
    return float(torch.stack([s.coverage.float().mean() for s in stats_per_layer]).mean())


def stats_certified(stats_per_layer) -> float:
    return float(torch.stack([s.certified.float().mean() for s in stats_per_layer]).mean())


def certified_check(per_length: Sequence[dict]) -> dict:
    """The result entry for "certified == full-cache logits": one dict per
    length with "ok" and "max_rel_err"; all_ok when every length passed."""
    return {"tolerance": CERT_TOL, "all_ok": all(c["ok"] for c in per_length), "per_length": list(per_length)}


def certified_line(cc: dict) -> str:
    """One printed line summarising a certified_check entry."""
    worst = max([c["max_rel_err"] for c in cc["per_length"]] or [0])
    return f"certified == full logits: {'OK' if cc['all_ok'] else 'FAILED'} (max rel err {worst:.2e})"


def write_json(path: str, obj: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1, allow_nan=True) + "\n")
    return out


def png_path(json_path: str) -> Path:
    return Path(json_path).with_suffix(".png")


class Timer:
    def __init__(self) -> None:
        self.t0 = time.time()

    def __call__(self) -> float:
        return round(time.time() - self.t0, 2)


def twin_policies(twin: str, budgets: Sequence[int], L: int, args, seed_budget: int):
    """(method, budget, policy) rows evaluated for one twin at context L: full,
    top-k at every budget below L, and for entmax also Gaussian and certified
    (seeded by TopK(seed_budget))."""
    rows = [("full", None, Full())]
    rows += [("topk", b, TopK(budget=b)) for b in budgets if b < L]
    if twin == "entmax":
        rows.append(("gaussian", None, Gaussian(q_max=args.q_max, margin=args.margin)))
        rows.append(("certified", None, Certified(seed=TopK(budget=seed_budget))))
    return rows
