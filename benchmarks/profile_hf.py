"""Where the host time of transformers' generate() goes, with EntmaxKVCache or HF's sdpa.

A script (GPU machine; ``--device cpu`` for a dry run). Builds the model of
``bench_hf``, prefills a random prompt, then profiles ``generate`` of
``--new`` tokens with cProfile and prints the functions with the most own
time per decode token (a generate of ``--new`` tokens less one of a
single token, so the prefill is left out), and how many host
synchronisations one decode token makes (CUDA's sync debug mode), so host
work has a measured target.

    python -m benchmarks.profile_hf --model llama8b --length 32768 --method entmaxkv
    python -m benchmarks.profile_hf --model tiny --length 64 --new 4 --device cpu   # dry run
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import warnings

import torch

from .bench_hf import BASELINE, build, generator


def sync_count(call, device) -> int:
    """Host synchronisations CUDA's sync debug mode reports during ``call()`` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama8b", choices=["llama8b", "twin", "tiny"])
    ap.add_argument("--length", type=int, default=32768, help="prompt tokens (>= 1)")
    ap.add_argument("--new", type=int, default=16, help="generated tokens profiled (>= 2)")
    ap.add_argument("--method", default="entmaxkv", choices=["entmaxkv", "baseline"],
                    help="EntmaxKVCache(TopK(--budget)) or the model's HF baseline (bench_hf.BASELINE)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--top", type=int, default=30, help="rows printed (>= 1)")
    ap.add_argument("--checkpoint", default="checkpoints/entmax", help="the twin checkpoint")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    if args.length < 1 or args.new < 2 or args.top < 1:
        ap.error("--length must be >= 1, --new >= 2 and --top >= 1")
    device = torch.device(args.device)
    model = build(args.model, device, args.checkpoint)
    ids = torch.randint(1, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    # one cache, reset per generate (bench_hf.generator): its graphs are captured in the warm-up
    generate = generator(model, ids, "entmaxkv" if args.method == "entmaxkv" else BASELINE[args.model],
                         budget=args.budget, page_size=16, new=args.new)

    with torch.no_grad():
        generate(args.new)  # warm-up (compiles kernels, captures graphs)
        prof = cProfile.Profile()
        prof.enable()
        generate(args.new)
        prof.disable()
        prefill = cProfile.Profile()
        prefill.enable()
        generate(1)
        prefill.disable()
        syncs = sync_count(lambda: generate(2), device) - sync_count(lambda: generate(1), device)
    full, first = pstats.Stats(prof).stats, pstats.Stats(prefill).stats
    per = args.new - 1
    rows = []  # (own s, cumulative s, calls) per decode token: generate(new) less generate(1)
    for fn, (_, nc, tt, ct, _) in full.items():
        _, nc1, tt1, ct1, _ = first.get(fn, (0, 0, 0.0, 0.0, None))
        rows.append(((tt - tt1) / per, (ct - ct1) / per, (nc - nc1) / per, fn))
    total = sum(r[0] for r in rows)
    print(f"{args.model} n={args.length} {args.method}: host {1e3 * total:.2f} ms per decode token "
          f"(cProfile, its overhead included: generate of {args.new} tokens less generate of 1); "
          f"host syncs per decode token: {syncs}")
    print(f"{'own ms':>9} {'cum ms':>9} {'calls':>7}  function (per decode token)")
    for tt, ct, nc, (file, line, name) in sorted(rows, key=lambda r: -r[0])[:args.top]:
        print(f"{1e3 * tt:9.3f} {1e3 * ct:9.3f} {nc:7.1f}  {file}:{line}({name})")


if __name__ == "__main__":
    main()
