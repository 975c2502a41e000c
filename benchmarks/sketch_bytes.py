"""Bytes the certified step reads, with and without key sketches, on the twin.

A measurement on captured activations (reference backend, float32, runs on
the CPU): the entmax twin prefills held-out text (test split) of each
length, then decodes ``--steps`` tokens with Full; at every layer and step
the query is run through

- ``box``: today's certified policy, Certified(TopK(seed)), page boxes only;
- ``sketch``: Certified(TopK(seed), alibi_seed=TopK(alibi_seed)) on the
  same cache with per-token sketches (``dims`` int8 coordinates, basis
  fitted to the prefill): every page's summary, the token sketches of the
  pages the summary does not rule out, K of the kept pages, V only for
  pages that hold support;
- ``oracle``: the pages that hold the support (what an exact method must
  read at the least).

Bytes are per query head, as a fraction of reading its whole K+V in float16
(2 * D * 2 bytes per token): K and V of the kept tokens + the page boxes
(2 * D * 2 bytes per page) (box); K of the kept tokens + V of the support
pages + every page's summary (2 dims + 4 bytes) + the token sketches read
(dims + 4 bytes a token) (sketch). Every row is split by
head type (ALiBi: slope > 0; NoPE: slope 0). All three outputs are checked
against Full: certified heads must match it.

    python -m benchmarks.sketch_bytes --out benchmarks/results
    python -m benchmarks.sketch_bytes --lengths 1024 --seqs 1 --steps 1   # a quick look
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def sketchless(cache):
    """A view of ``cache`` (a one-layer PagedKVCache) without its sketches."""
    bare = copy.copy(cache)
    bare._layers = tuple(dataclasses.replace(lay, sketch=None) for lay in cache._layers)
    bare.sketch = None
    return bare


def measure(q, cache, slots, *, model, args, sink, length):
    """One layer's query [B, HQ, D]: bytes of each method per head into ``sink``."""
    from entmaxkv import Certified, Full, TopK, decode
    from entmaxkv.scoring import page_layout
    from entmaxkv.attention import selected_scores
    from entmaxkv.policies import certified_parts

    cfg = model.cfg
    alpha, scale, slopes = cfg.attn_alpha, model.scale, model.slopes
    B, HQ, D = q.shape
    P = cache.page_size
    ids = torch.as_tensor(slots)
    kw = dict(alpha=alpha, alibi_slopes=slopes, backend="reference", return_stats=True)
    full, st_full = decode(q, cache, slots, Full(), **kw)
    box, st_box = decode(q, sketchless(cache), slots, Certified(seed=TopK(args.seed)), **kw)
    pol = Certified(seed=TopK(args.seed), alibi_seed=TopK(args.alibi_seed))
    sk, st_sk = decode(q, cache, slots, pol, **kw)
    for name, out, st in (("box", box, st_box), ("sketch", sk, st_sk)):
        if not bool(st.certified.all()):
            raise RuntimeError(f"{name}: a head was not certified")
        err = float((out - full).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"{name}: differs from Full by {err}")

    # the support's pages: scores over every page, p > 0 where (alpha-1) s > tau
    lay = page_layout(cache, ids)
    sel = Full()
    from entmaxkv.policies import select

    every = select(sel, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, layout=lay)
    s, _ = selected_scores(q, cache, ids, every, scale=scale, slopes=slopes, layout=lay)  # [B, HQ, W*P]
    M = lay.n_tok.shape[1]
    s = s.reshape(B, HQ, -1, P)[:, :, :M]
    support = ((alpha - 1.0) * s > st_full.tau[..., None, None]).any(-1)  # [B, HQ, M]
    n = lay.seq_len.double()[:, None]  # [B, 1]
    row = 2.0 * D * 2  # one token's K+V in float16
    pages = lay.num_pages.double()[:, None]
    meta = pages * 2 * D * 2  # page boxes (min, max) in float16
    n_support_tok = (support * lay.n_tok[:, None, :]).sum(-1).double()
    k_half = D * 2.0
    total = n * row
    # what the sketched policy read besides K and V: every page's summary
    # (2 m + 4 bytes) and the token sketches (m + 4 bytes a token) of the
    # pages it read them for
    parts = certified_parts(pol, q, cache, ids, lay, cache.kv_heads, alpha=alpha, scale=scale, slopes=slopes)
    sketched_pages = parts.sketched.repeat_interleave(HQ // cache.kv_heads, dim=1).sum(-1).double()
    summaries = pages * (2 * args.dims + 4)
    token_sketches = sketched_pages * P * (args.dims + 4)
    res = {
        "box": (st_box.tokens_read.double() * row + meta) / total,
        "box_k_tokens": st_box.tokens_read.double() / n,
        "sketch": (st_sk.tokens_read.double() * k_half + n_support_tok * k_half + summaries + token_sketches)
        / total,
        "sketched_pages": sketched_pages / pages,
        "sketch_k_tokens": st_sk.tokens_read.double() / n,
        "oracle": n_support_tok * row / total,
        "support_pages": support.sum(-1).double() / pages,
    }
    kind = ["alibi" if float(x) > 0 else "nope" for x in slopes.tolist()]
    for h in range(HQ):
        for key, val in res.items():
            sink[(length, kind[h])][key] += val[:, h].tolist()
            sink[(length, "all")][key] += val[:, h].tolist()


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="prompt lengths")
    ap.add_argument("--seqs", type=int, default=3, help="prompts per length")
    ap.add_argument("--steps", type=int, default=2, help="decode steps measured per prompt")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dims", type=int, default=8, help="sketch coordinates per token")
    ap.add_argument("--seed", type=int, default=1024, help="top-k seed budget (NoPE heads; all heads for box)")
    ap.add_argument("--alibi-seed", type=int, default=256, help="top-k seed budget of the ALiBi heads")
    ap.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "entmax"))
    ap.add_argument("--rng", type=int, default=0, help="where the prompts start in the test split")
    ap.add_argument("--out", default=None, help="folder for sketch_bytes.json and .png")
    args = ap.parse_args(argv)
    from entmaxkv import Full
    from entmaxkv.model.checkpoint import load_model
    from entmaxkv.model.data import load_split
    from entmaxkv.model.generate import DecodeSession

    t0 = time.time()
    torch.manual_seed(0)
    model = load_model(args.checkpoint)
    stream = load_split("test")
    rng = np.random.default_rng(args.rng)
    sink = defaultdict(lambda: defaultdict(list))
    for L in args.lengths:
        starts = rng.integers(0, len(stream) - L - 1, size=args.seqs)
        prompts = torch.as_tensor(np.stack([stream[s:s + L] for s in starts]).astype(np.int64))
        sess = DecodeSession(model, args.seqs, L + args.steps, page_size=args.page_size, backend="reference")
        sess.prefill(prompts[:, :-1], chunk=1024)
        for c in sess.caches:
            c.enable_sketches(args.dims)  # basis fitted to the prefill's keys
        slots = sess.slots[0]

        def hook(layer, q, cache, seq_ids, _L=L):
            measure(q, cache, slots, model=model, args=args, sink=sink, length=_L)

        cur = prompts[:, -1]
        for _ in range(args.steps):
            cur = sess.step(cur, Full(), layer_hook=hook).argmax(-1)
        print(f"# {L}: {time.time() - t0:.0f} s", file=sys.stderr)
    rows = []
    for (L, kind), rec in sorted(sink.items()):
        row = {"length": L, "heads": kind, "samples": len(rec["box"])}
        row.update({k: float(np.mean(v)) for k, v in rec.items()})
        rows.append(row)
        print(json.dumps(row))
    result = {"bench": "sketch_bytes", "command": "python -m benchmarks.sketch_bytes " + " ".join(argv or sys.argv[1:]),
              "device": "cpu (reference backend, float32)", "checkpoint": args.checkpoint,
              "setup": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
              "wall_s": time.time() - t0}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sketch_bytes.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(rows, out / "sketch_bytes.png")
    return 0


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["nope", "alibi", "all"]
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        for i, method in enumerate(("box", "sketch", "oracle")):
            vals = [next(r[method] for r in rows if r["length"] == L and r["heads"] == k) for k in kinds]
            ax.bar(np.arange(3) + 0.27 * (i - 1), [100 * v for v in vals], 0.27, label=method)
        ax.set_xticks(range(3), kinds)
        ax.set_title(f"twin, {L} tokens, page 16")
        ax.set_ylabel("% of full K+V bytes (float16)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
