"""`entmaxkv bench latency`: end-to-end generation latency, vLLM's conventions.

The flags and the JSON follow `vllm bench latency` (--input-len,
--output-len, --batch-size, --num-iters-warmup, --num-iters, --output-json
with avg_latency, latencies and percentiles), plus the EntmaxKV settings
(--policy, --budget, --alpha, --page-size, --backend). Each iteration
generates --output-len tokens for a batch of random --input-len prompts
(seeded) and is timed whole (the device synchronised at both ends). The
model is a twin checkpoint (``entmaxkv.model`` format: generation through
``entmaxkv.model.generate``) or a transformers model folder (generation
through ``model.generate`` with an ``EntmaxKVCache``; needs entmaxkv[hf]).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ._checks import device_flag, float_flag, int_flag

POSITIVE = int_flag(lo=1)
NONNEG = int_flag(lo=0)
ALPHA = float_flag(lo=1.0, hi=4.0)
PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_bench_args(p) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    lat = sub.add_parser("latency", help="end-to-end generation latency (vLLM's bench latency conventions)",
                         description=__doc__.split("\n\n")[1].replace("\n", " "))
    lat.add_argument("--model", default="checkpoints/entmax",
                     help="a twin checkpoint folder or a transformers model folder (default checkpoints/entmax)")
    lat.add_argument("--input-len", type=POSITIVE, default=32, help="prompt tokens per row (>= 1, default 32)")
    lat.add_argument("--output-len", type=POSITIVE, default=128, help="generated tokens per row (>= 1, default 128)")
    lat.add_argument("--batch-size", type=POSITIVE, default=8, help="rows per batch (>= 1, default 8)")
    lat.add_argument("--num-iters-warmup", type=NONNEG, default=10, help="untimed iterations (>= 0, default 10)")
    lat.add_argument("--num-iters", type=POSITIVE, default=30, help="timed iterations (>= 1, default 30)")
    lat.add_argument("--output-json", default=None, help="write avg_latency, latencies and percentiles here")
    lat.add_argument("--policy", choices=("full", "topk", "gaussian", "certified"), default="topk",
                     help="EntmaxKV decode policy (default topk)")
    lat.add_argument("--budget", type=POSITIVE, default=1024,
                     help="token budget of topk and of certified's seed (>= page size, default 1024)")
    lat.add_argument("--alpha", type=ALPHA, default=None,
                     help="entmax alpha in [1, 4] (default: the model's: the twin's config, or the transformers "
                          "config's entmax_alpha, else 1)")
    lat.add_argument("--page-size", type=int_flag(lo=1, hi=256), default=16, help="tokens per page (1..256)")
    lat.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                     help="decode backend (default auto)")
    lat.add_argument("--device", type=device_flag, default=None, help="device (default: cuda if available)")
    lat.add_argument("--seed", type=NONNEG, default=0, help="prompt seed (>= 0, default 0)")
    lat.set_defaults(cli_prog=lat.prog)


def _policy(args):
    from .model.generate import make_policy

    if args.budget < args.page_size and args.policy in ("topk", "certified"):
        raise ValueError(f"--budget: expected at least --page-size ({args.page_size}), got {args.budget}")
    return make_policy(args.policy, budget=args.budget)


def _runner(args, device):
    """(a function generating for one prompt batch, vocabulary size, model description)."""
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model: expected a folder with a config.json, got {args.model!r}")
    config = json.loads((folder / "config.json").read_text())
    policy = _policy(args)
    if "config" in config and "model_type" not in config:  # a twin checkpoint
        from .model.checkpoint import load_model
        from .model.generate import generate

        model = load_model(folder, device=device)
        if args.alpha is not None and args.alpha != model.cfg.attn_alpha:
            raise ValueError(f"--alpha: the twin was trained with alpha {model.cfg.attn_alpha}; got {args.alpha}")

        def run(prompt):
            return generate(model, prompt, args.output_len, policy=policy, page_size=args.page_size,
                            backend=args.backend).tokens
        return run, model.cfg.vocab_size, f"twin {folder}"
    try:
        from transformers import AutoModelForCausalLM

        from . import hf
    except ImportError as exc:
        raise ValueError(f"--model: a transformers model needs entmaxkv[hf] ({exc})") from None
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=hf.ATTN_IMPLEMENTATION).to(device).eval()

    # one cache, reset per run: its paged cache and CUDA graphs are made once
    cache = hf.EntmaxKVCache(model, policy=policy, alpha=args.alpha, page_size=args.page_size,
                             max_len=args.input_len + args.output_len, backend=args.backend)

    def run(prompt):
        cache.reset()
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                              max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                              pad_token_id=0)
    return run, model.config.vocab_size, f"transformers {folder}"


def run_bench(args) -> int:
    from tqdm import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run, vocab, what = _runner(args, device)
    gen = torch.Generator().manual_seed(args.seed)

    def once():
        prompt = torch.randint(1, vocab, (args.batch_size, args.input_len), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run(prompt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    with torch.no_grad():
        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
            once()
        latencies = [once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    lat = np.array(latencies)
    pct = {str(p): float(np.percentile(lat, p)) for p in PERCENTILES}
    print(f"{what}: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"policy {args.policy}, page {args.page_size}, backend {args.backend}, device {device}")
    print(f"Avg latency: {lat.mean():.6f} seconds")
    for p, v in pct.items():
        print(f"{p}% percentile latency: {v:.6f} seconds")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            dict(avg_latency=float(lat.mean()), latencies=latencies, percentiles=pct), indent=1))
    return 0
