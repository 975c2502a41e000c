"""transformers' generate() with an EntmaxKVCache against HF's own sdpa attention (a script, GPU).

For each model and prompt length (batch 1, the same random prompt for both):

- ``sdpa``: HF's sdpa attention with its static cache
  (``cache_implementation="static"``); for the twin, whose NAPE heads and
  entmax attention SDPA cannot run, ``eager`` instead: its own dense
  attention with HF's static cache (it materialises T x T scores, so long
  prompts may run out of memory: the row then records the error);
- ``entmaxkv``: the "entmaxkv" attention with an ``EntmaxKVCache(policy)``,
  one cache reset before each generate (as HF keeps its static cache);
  each layer's decode (cache write and attention) replays a CUDA graph;
- ``entmaxkv_eager`` (with ``--eager``): the same with
  ``cuda_graphs=False``, every kernel launched from Python.

Each is timed generating 1 and ``--new`` tokens (median of ``--reps``, the
methods' runs alternating; with ``--apart`` one method after the other, each
one's caches freed before the next is built):
prefill seconds = t(1), decode tokens/s = (new - 1) / (t(new) - t(1)). HF's
own per-token Python work is in both. With ``--compile`` both also run
transformers' compiled decode step (``*_compiled``: torch.compile of the
forward, mode "reduce-overhead"; with a compileable EntmaxKVCache each
layer's decode is one traced custom op inside the compiled graph); the rows
without it pass ``disable_compile=True``.

Models: ``llama8b`` (the Llama-3-8B shape, random weights, bf16: 32 layers,
32 / 8 heads, head dim 128, SwiGLU 14336, vocab 128256) and ``twin`` (the
entmax twin, converted on the fly; --checkpoint). ``tiny`` is a small random
Llama for a CPU dry run of the script.

    python -m benchmarks.bench_hf --models llama8b,twin --lengths 32768,131072 --out benchmarks/results
    python -m benchmarks.bench_hf --models tiny --lengths 64 --new 4 --reps 1 --device cpu   # dry run
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .harness import run_meta, save

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, device, checkpoint: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import entmaxkv.hf as H

    H.register()
    if name == "twin":
        folder = H.convert(checkpoint, Path(tempfile.mkdtemp()) / "twin")
        return AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    if name == "llama8b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=1 << 20,
                          rope_theta=500000.0)
        dtype = torch.bfloat16
    else:  # tiny
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1 << 16)
        dtype = torch.float32
    with torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


BASELINE = {"llama8b": "sdpa", "tiny": "sdpa", "twin": "eager"}  # HF's own attention per model


def generator(model, ids, label: str, *, budget: int, page_size: int, new: int):
    """``make(k)``: a greedy generate of k tokens after the prompt ``ids``
    [1, n] int64 with method ``label`` (an HF attention, "_compiled" for
    HF's compiled static-cache path, or "entmaxkv"). For "entmaxkv" one
    ``EntmaxKVCache(TopK(budget))`` serves every call, reset before each
    (HF keeps its static cache between generate calls too), so its
    per-layer CUDA graphs are captured once and replayed after."""
    import entmaxkv.hf as H
    from entmaxkv import TopK

    mask = torch.ones_like(ids)
    ours = label.startswith("entmaxkv")
    cache = None if not ours else H.EntmaxKVCache(model, policy=TopK(budget), page_size=page_size,
                                                   max_len=ids.shape[1] + new,
                                                   cuda_graphs=not label.endswith("_eager"),
                                                   compileable=label.endswith("_compiled"))
    # HF compiles the decode step of a compileable cache on its own unless told not to.
    kw = {"disable_compile": not label.endswith("_compiled")}
    if ours:
        kw["past_key_values"] = cache
    else:
        kw["cache_implementation"] = "static"

    def make(k: int):
        model.set_attn_implementation(label.split("_")[0])
        if ours:
            cache.reset()
        return model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                              pad_token_id=0, **kw)

    return make


def measure(model, ids, labels, args, device) -> dict:
    """Prefill seconds and decode tokens/s of each method in ``labels`` on one
    prompt ``ids`` [1, n] int64: label -> dict, or {"error": ...} for a
    method that failed. The timed runs alternate between the methods (rep
    after rep), so a drift of the host's speed during the run reaches all
    of them alike."""
    makes, out = {}, {}
    with torch.no_grad():
        for label in labels:
            try:
                makes[label] = generator(model, ids, label, budget=args.budget, page_size=args.page_size,
                                         new=args.new)
                makes[label](args.new)  # warm-up: compiles, sizes HF's static cache, captures our graphs
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                makes.pop(label, None)
                out[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        times = {label: ([], []) for label in makes}
        for _ in range(args.reps):
            for label, make in list(makes.items()):
                try:
                    times[label][0].append(timed(lambda: make(1), device))
                    times[label][1].append(timed(lambda: make(args.new), device))
                except Exception as exc:  # noqa: BLE001 - recorded; the other methods' times are kept
                    makes.pop(label)
                    times.pop(label)
                    out[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    for label, (t1s, tns) in times.items():
        t1, tn = statistics.median(t1s), statistics.median(tns)
        out[label] = {"prefill_s": t1, "decode_tokens_per_s": (args.new - 1) / max(tn - t1, 1e-9),
                      "ms_per_token": 1e3 * (tn - t1) / (args.new - 1)}
    return out


def plot(rows, path):
    """ms per decode token of each method, per model and prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["n"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(cases) * max(len(methods), 1) / 3, 4))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        got = {(r["model"], r["n"]): r.get("ms_per_token") for r in rows if r["method"] == m}
        xs = [x for x, c in enumerate(cases) if got.get(c) is not None]
        ax.bar([x + i * w for x in xs], [got[cases[x]] for x in xs], w, label=m)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(cases))], [f"{m} {n // 1024}k" for m, n in cases])
    ax.set_ylabel("ms per decode token (lower is faster)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama8b,twin", help="comma list of llama8b, twin, tiny")
    ap.add_argument("--lengths", default="32768,131072", help="comma list of prompt lengths")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per timed run (>= 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per measurement (>= 1)")
    ap.add_argument("--budget", type=int, default=1024, help="TopK budget of the EntmaxKV policy")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--compile", action="store_true", help="also time transformers' compiled decode step (both)")
    ap.add_argument("--eager", action="store_true", help="also time EntmaxKVCache(cuda_graphs=False)")
    ap.add_argument("--apart", action="store_true",
                    help="time each method alone, its caches freed before the next (long prompts whose "
                         "methods' caches do not fit the GPU together)")
    ap.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "entmax"), help="the twin checkpoint")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None, help="folder for bench_hf.json and .png")
    args = ap.parse_args(argv)
    if args.new < 2 or args.reps < 1:
        ap.error("--new must be >= 2 and --reps >= 1")
    device = torch.device(args.device)

    rows = []
    for name in args.models.split(","):
        model = build(name, device, args.checkpoint)
        vocab = model.config.vocab_size
        for n in (int(x) for x in args.lengths.split(",")):
            gen = torch.Generator().manual_seed(n)
            ids = torch.randint(1, vocab, (1, n), generator=gen).to(device)
            base = BASELINE[name]
            labels = [base, "entmaxkv"] + [base + "_compiled", "entmaxkv_compiled"] * args.compile \
                + ["entmaxkv_eager"] * args.eager
            runs = {}
            groups = [[label] for label in labels] if args.apart else [labels]
            results = {}
            for group in groups:
                results.update(measure(model, ids, group, args, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for label, res in ((lab, results[lab]) for lab in labels):
                runs[label] = {"model": name, "n": n, "method": label, "new": args.new, **res}
                rows.append(runs[label])
                print(json.dumps(runs[label]), flush=True)
            for ours, ref in (("entmaxkv", base), ("entmaxkv_eager", base),
                              ("entmaxkv_compiled", base + "_compiled")):
                if all("decode_tokens_per_s" in runs.get(k, {}) for k in (ref, ours)):
                    runs[ours]["speedup_vs_" + ref] = (runs[ours]["decode_tokens_per_s"]
                                                       / runs[ref]["decode_tokens_per_s"])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        import transformers

        meta = run_meta("benchmarks.bench_hf", argv, device, transformers=transformers.__version__)
        save(args.out, "bench_hf", meta, rows, plot)
    return rows


if __name__ == "__main__":
    main()
