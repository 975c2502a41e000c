"""Whole-model generation speed: tokens per second of the project's model (a script, GPU).

For each model, batch and prompt length, in one process:

- ours: the prompt prefilled into a paged cache (``prefill_paged``, timed),
  then every policy decoding greedily through ``ModelStep`` (one replayed
  CUDA graph per step): ``--steps`` timed steps after ``--warmup`` (which
  include the capture), each timed with CUDA events around the whole call
  (host half + replay, then a synchronisation), median (``ms_per_step``);
  then ``--steps`` more back to back, the next token fed from the last
  step's logits on the device and one synchronisation at the end, as
  ``generate`` runs without a stop token (the host half of a step overlaps
  the device half of the one before): their mean is ``ms_per_token_piped``;
- ``full``: our dense paged kernel in the same captured model (the strongest
  dense decode: the targets are against it); ``full_softmax`` the same at
  alpha 1, the dense decode of Quest's attention (each row's
  ``speedup_vs_dense`` is against the dense row of its own alpha);
- ``certified_sketch`` (twin): the certified policy with a TopK(256) seed on
  the ALiBi heads over the same pages with 8-dim key sketches, fitted after
  the prefill (``sketch_fit_s``); its floor counts the page summaries in
  place of the page boxes, not the token sketches it reads;
- ``sdpa_static``: the same model with a contiguous static KV cache and torch
  SDPA decode, the whole step captured in a CUDA graph (what gpt-fast does);
  softmax (on the entmax twin a timing reference only), run after ours once
  the paged cache is freed.

Each row carries its end-to-end bytes floor at ``--bandwidth`` (weights +
page statistics read + selected K/V, from one eager step's DecodeStats; for
SDPA the weights and the whole static cache) and its ratio to it.

Models: ``twin`` (the entmax twin, checkpoints/entmax; prompts are test-split
text, so the selections see real activations), ``llama8b``
(``ModelConfig.llama8b_shape``, random bf16 weights; top-k and Full at
alpha 1.5, Quest = top-k and ``full_softmax`` = Full at alpha 1),
``tiny`` (a small random model for a CPU dry run).

    python -m benchmarks.bench_generate --out benchmarks/results
    python -m benchmarks.bench_generate --suite llama8b --lengths 32768 --batches 1
    python -m benchmarks.bench_generate --suite tiny --device cpu --lengths 64 --steps 3 --warmup 1   # dry run

``--variant LABEL:ITEM[;ITEM]`` times every paged method a second time
under the base config plus the ITEMs (``[STAGE.]FIELD=VALUE``), on the same
prefilled cache, as rows named ``METHOD@LABEL``: an A/B of a kernel option
without a second prefill.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

from entmaxkv import PagedKVCache
from entmaxkv.model.lm import ModelConfig, TransformerLM, prefill_attention
from entmaxkv.model.step import ModelStep
from entmaxkv.policies import Certified, Full, Gaussian, TopK

from .harness import kernel_config, run_meta, save, sketched

SUITES = {
    # suite: (methods, [(batch, lengths)])
    "twin": (["full", "topk1024", "gaussian", "certified", "certified_sketch", "sdpa_static"],
             [(1, [16384, 131072, 1048576]), (4, [16384, 131072])]),
    "llama8b": (["full", "full_softmax", "topk1024", "quest1024", "sdpa_static"], [(1, [32768, 131072, 524288])]),
    "tiny": (["full", "full_softmax", "topk1024", "gaussian", "certified", "certified_sketch", "quest1024",
              "sdpa_static"], [(1, [64]), (2, [64])]),
}
METHODS = {
    # name: (alpha, policy); alpha None: the model's own
    "full": (None, Full()),
    # the dense paged kernel at alpha 1: the dense decode that Quest's selection stands in for
    "full_softmax": (1.0, Full()),
    "topk1024": (None, TopK(1024)),
    "quest1024": (1.0, TopK(1024)),
    "gaussian": (None, Gaussian()),
    "certified": (None, Certified(seed=TopK(1024))),
    # the certified policy over the same pages with 8-dim key sketches (fitted after the prefill)
    "certified_sketch": (None, Certified(seed=TopK(1024), alibi_seed=TopK(256))),
}
SKETCH_DIMS = 8


# ----------------------------------------------------------------- models
# weights and cache dtype per suite: the twin as served on a GPU (float16: its
# trained float32 weights fit that range), the 8B shape in bfloat16
DTYPES = {"twin": torch.float16, "llama8b": torch.bfloat16, "tiny": torch.float32}


def build_model(suite: str, device, checkpoint: str, dtype=None) -> TransformerLM:
    """The suite's model in ``dtype`` (None: DTYPES[suite]); its ALiBi slopes stay float32."""
    dtype = DTYPES[suite] if dtype is None else dtype
    if suite == "twin":
        from entmaxkv.model.checkpoint import load_model

        model = load_model(checkpoint, device=device)
    else:
        cfg = ModelConfig.llama8b_shape() if suite == "llama8b" else ModelConfig(
            vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, positions="nape")
        torch.manual_seed(0)
        with torch.device(device):
            model = TransformerLM(cfg)
    slopes = model.slopes.clone()
    model = model.to(dtype).eval()
    model.slopes = slopes  # (a buffer: .to cast it)
    return model


def prompt_tokens(suite: str, B: int, n: int, vocab: int) -> torch.Tensor:
    """long [B, n]: test-split text for the twin (repeated past the split's end), random ids otherwise."""
    if suite == "twin":
        from entmaxkv.model.data import load_split

        stream = torch.as_tensor(load_split("test").astype("int64"))
        reps = -(-(B * n) // len(stream))
        return stream.repeat(reps)[: B * n].view(B, n)
    return torch.randint(0, vocab, (B, n), generator=torch.Generator().manual_seed(n))


@contextlib.contextmanager
def alpha_as(model: TransformerLM, alpha):
    """The model's attention at ``alpha`` inside the block (1: softmax; None:
    as it is), its own (attention, alpha) put back after."""
    old = (model.cfg.attention, model.cfg.alpha)
    if alpha is not None:
        model.cfg.attention, model.cfg.alpha = ("softmax", old[1]) if alpha == 1.0 else ("entmax", alpha)
    try:
        yield
    finally:
        model.cfg.attention, model.cfg.alpha = old


def paged_cache(model: TransformerLM, B: int, tokens: int, page_size: int) -> PagedKVCache:
    """A paged cache of every layer with room for B rows of ``tokens`` tokens, in the model's dtype and device."""
    cfg, p = model.cfg, next(model.parameters())
    per = -(-tokens // page_size)
    return PagedKVCache(B * per, page_size, cfg.n_kv_heads, cfg.head_dim, max_seqs=B, max_pages_per_seq=per,
                        dtype=p.dtype, device=p.device, num_layers=cfg.n_layers)


# ----------------------------------------------------------------- timing
class Clock:
    """Per-call device time: CUDA events around the call on CUDA, wall time elsewhere."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, call) -> float:
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            call()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1)
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e3

    def wall(self, call) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = call()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out


def kernel_profile(call, steps: int, top: int = 32) -> dict:
    """{kernel name: mean device microseconds per step} of the ``top`` costliest
    kernels over ``steps`` calls, from torch.profiler's device events (graph
    replays included), and under ``"(all kernels)"`` their sum over every
    kernel: without PDL (``--config pdl=False``), a step's time less that sum
    is what lies between its launches. With PDL a kernel's time includes its
    wait for the launch before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / steps
    ranked = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    out = {name[:80]: round(us, 2) for name, us in ranked}
    out["(all kernels)"] = round(sum(per.values()), 2)
    return out


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def floor_bytes_paged(model, stats, cache, method: str) -> int:
    """Bytes one step must read: weights, the page statistics the selection
    reads (none for Full), the selected K and V (from DecodeStats)."""
    total = param_bytes(model)
    it = torch.tensor([], dtype=cache.dtype).element_size()
    KV, D = cache.kv_heads, cache.head_dim
    for st in stats:
        tokens = st.tokens_read.float().mean(-1).sum().item()  # per row, over its heads, summed over rows
        total += int(tokens * KV * D * 2 * it)
        if not isinstance(METHODS[method][1], Full):
            pages = sum(-(-int(n) // cache.page_size) for n in cache.seq_lens.tolist())
            # page boxes, or with sketches the page summaries (the token sketches read are not counted)
            total += pages * KV * ((2 * SKETCH_DIMS + 4) if method == "certified_sketch" else 2 * D * it)
    return total


# ----------------------------------------------------------------- dense baseline
class StaticSDPA:
    """The model with a contiguous static KV cache [B, KV, max_len, D] per
    layer and torch SDPA decode (softmax), the whole step in one CUDA graph."""

    def __init__(self, model: TransformerLM, B: int, max_len: int) -> None:
        cfg, p = model.cfg, next(model.parameters())
        self.model, self.B, self.max_len = model, B, max_len
        shape = (cfg.n_layers, B, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.tok = torch.zeros(B, dtype=torch.long, device=p.device)
        self.pos = torch.zeros(B, dtype=torch.long, device=p.device)
        self.logits = None
        self.graph = None

    def prefill(self, tokens: torch.Tensor, chunk: int = 32768) -> None:
        """Fill the static cache from ``tokens`` [B, T]. Attention runs over
        the whole prompt at once (SDPA's causal kernel); the projections and
        the MLP run ``chunk`` tokens at a time, because their activations
        over a whole long prompt would not fit beside the cache."""
        m = self.model
        B, T = tokens.shape
        x = m.embed(tokens)
        for i, blk in enumerate(m.blocks):
            qs = []
            for s in range(0, T, chunk):
                e = min(T, s + chunk)
                q, k, v = blk.attn.project(blk.attn_norm(x[:, s:e]), torch.arange(s, e, device=tokens.device))
                self.k[i, :, :, s:e] = k.transpose(1, 2)
                self.v[i, :, :, s:e] = v.transpose(1, 2)
                qs.append(q.transpose(1, 2))
            q = torch.cat(qs, dim=2)
            del qs
            o = prefill_attention(q, self.k[i, :, :, :T], self.v[i, :, :, :T], alpha=1.0,
                                  scale=m.scale, slopes=m.slopes).transpose(1, 2).reshape(B, T, -1)
            del q
            for s in range(0, T, chunk):
                h = x[:, s:s + chunk] + blk.attn.wo(o[:, s:s + chunk])
                x[:, s:s + chunk] = h + blk.mlp(blk.mlp_norm(h))
            del o
        self.pos.fill_(T)

    def _body(self) -> torch.Tensor:
        m = self.model
        H, KV = m.cfg.n_heads, m.cfg.n_kv_heads
        x = m.embed(self.tok)[:, None]
        keys = torch.arange(self.max_len, device=x.device)
        rel = (keys[None, :] - self.pos[:, None]).to(torch.float32)  # [B, max_len]
        bias = (m.slopes.view(1, H, 1, 1) * rel[:, None, None, :]).masked_fill(rel[:, None, None, :] > 0, -torch.inf)
        rows = torch.arange(self.B, device=x.device)
        for i, blk in enumerate(m.blocks):
            q, k, v = blk.attn.project(blk.attn_norm(x), self.pos[:, None])  # [B, 1, *, D]
            self.k[i, rows, :, self.pos] = k[:, 0]
            self.v[i, rows, :, self.pos] = v[:, 0]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[i], self.v[i], attn_mask=bias.to(q.dtype),
                                               scale=m.scale, enable_gqa=H != KV)
            x = x + blk.attn.wo(o.transpose(1, 2).reshape(self.B, 1, -1))
            x = x + blk.mlp(blk.mlp_norm(x))
        return m._logits(x[:, 0])

    def step_fn(self, tokens: torch.Tensor):
        """The call a timer runs: one step on ``tokens``."""
        return lambda: self.step(tokens)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tokens)
        if self.k.device.type != "cuda":
            out = self._body()
        elif self.graph is None:
            self.logits = self._body()  # warm-up (this step is real)
            self.graph = torch.cuda.CUDAGraph()
            self.pos += 1
            self.tok.copy_(self.logits.argmax(-1))
            with torch.cuda.graph(self.graph):
                self.logits = self._body()
            self.graph.replay()
            out = self.logits
        else:
            self.graph.replay()
            out = self.logits
        self.pos += 1
        return out


def piped_steps(step, tok: torch.Tensor, seqs, n: int) -> None:
    """``n`` greedy steps back to back: each step's token is the argmax of
    the last step's logits, on the device (no synchronisation)."""
    for _ in range(n):
        tok = step(tok, seqs).argmax(-1)


def warm_prefill(model, prompt, args) -> None:
    """Prefill a short prompt in two chunks first, so the timed prefill does
    not include compiling its kernels (a whole-prompt chunk and one over
    cached context)."""
    chunk = min(args.prefill_chunk, 1024, max(1, prompt.shape[1] // 2))
    n = min(prompt.shape[1], 2 * chunk)
    warm = paged_cache(model, prompt.shape[0], n, args.page_size)
    model.prefill_paged(prompt[:, :n], warm, [warm.allocate() for _ in range(prompt.shape[0])], chunk_tokens=chunk)


# ----------------------------------------------------------------- one case
def run_case(model, suite, B, n, methods, args, clock, bandwidth):
    device = next(model.parameters()).device
    cfg = model.cfg
    prompt = prompt_tokens(suite, B, n, cfg.vocab_size).to(device)
    rows = []
    paged_methods = [m for m in methods if m != "sdpa_static"]
    if paged_methods:
        total = n + len(paged_methods) * len(args.variants) * (args.warmup + 2 * args.steps + args.profile + 2)
        cache = paged_cache(model, B, total, args.page_size)
        seqs = [cache.allocate() for _ in range(B)]
        with alpha_as(model, args.prefill_alpha):
            warm_prefill(model, prompt, args)
            prefill_s, logits = clock.wall(lambda: model.prefill_paged(prompt, cache, seqs,
                                                                       chunk_tokens=args.prefill_chunk))
        tok = logits.argmax(-1)
        # profiled after every method is timed: timings taken after a
        # torch.profiler session in the same process come out slower
        profiles = []
        for name, label, kcfg in [(m, lab, c) for m in paged_methods for lab, c in args.variants]:
            alpha, policy = METHODS[name]
            row = {"model": suite, "batch": B, "n": n, "method": name + (f"@{label}" if label else ""),
                   "dtype": str(cache.dtype).split(".")[-1],
                   "prefill_s": prefill_s,
                   "prefill_alpha": args.prefill_alpha if args.prefill_alpha is not None else cfg.attn_alpha}
            try:
                with alpha_as(model, alpha):
                    if name == "certified_sketch":
                        t0 = time.perf_counter()
                        with_sketch = sketched(cache, SKETCH_DIMS)
                        row["sketch_fit_s"] = time.perf_counter() - t0
                    run = ModelStep(model, with_sketch if name == "certified_sketch" else cache, policy,
                                    cuda_graph=not args.no_cuda_graph, fused=False if args.no_fused else None,
                                    kernel_config=kcfg)
                    for _ in range(args.warmup):
                        tok = run.step(tok, seqs).argmax(-1)
                    ts, out = [], {}
                    for _ in range(args.steps):
                        def call(run=run, tok=tok, out=out):
                            out["logits"] = run.step(tok, seqs)

                        ts.append(clock.time(call))
                        tok = out["logits"].argmax(-1)
                    piped = clock.time(lambda: piped_steps(run.step, tok, seqs, args.steps)) / args.steps
                    if args.profile and device.type == "cuda":
                        profiles.append((row, run, tok))
                    _, stats = run.step(tok, seqs, return_stats=True)
                    ms = statistics.median(ts)
                    floor_ms = floor_bytes_paged(model, stats, cache, name) / bandwidth * 1e3
                    cov = float(torch.stack([s.coverage.float().mean() for s in stats]).mean())
                    row.update(ms_per_step=ms, tokens_per_s=B * 1e3 / ms, ms_per_token_piped=piped,
                               tokens_per_s_piped=B * 1e3 / piped, floor_ms=floor_ms,
                               ratio_to_floor=ms / floor_ms, graphs=len(run.graphs()), coverage=cov)
            except Exception as exc:  # noqa: BLE001 - recorded; the other methods still run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        for row, run, tok in profiles:
            try:
                with alpha_as(model, METHODS[row["method"].split("@")[0]][0]):
                    row["kernels_us"] = kernel_profile(lambda run=run, tok=tok: run.step(tok, seqs), args.profile)
            except Exception as exc:  # noqa: BLE001 - recorded; the timed rows are kept and written
                row["profile_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps({"method": row["method"], "kernels_us": row.get("kernels_us"),
                              "profile_error": row.get("profile_error")}), flush=True)
        del profiles, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "sdpa_static" in methods:
        row = {"model": suite, "batch": B, "n": n, "method": "sdpa_static"}
        try:
            with alpha_as(model, 1.0):
                base = StaticSDPA(model, B, n + args.warmup + 2 * args.steps + 2)
                row["prefill_s"], _ = clock.wall(lambda: base.prefill(prompt, args.prefill_chunk))
                tok = prompt[:, -1]
                for _ in range(args.warmup):
                    tok = base.step(tok).argmax(-1)
                ts = [clock.time(base.step_fn(tok)) for _ in range(args.steps)]
                ms = statistics.median(ts)
                piped = clock.time(lambda: piped_steps(lambda t, _: base.step(t), tok, None, args.steps)) / args.steps
                floor_ms = (param_bytes(model) + base.k.numel() * base.k.element_size() * 2) / bandwidth * 1e3
                row.update(ms_per_step=ms, tokens_per_s=B * 1e3 / ms, ms_per_token_piped=piped,
                           tokens_per_s_piped=B * 1e3 / piped, floor_ms=floor_ms, ratio_to_floor=ms / floor_ms)
                del base
        except Exception as exc:  # noqa: BLE001 - recorded (e.g. out of memory at the longest prompts)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    speedups(rows)
    return rows


def speedups(rows) -> None:
    """Add each timed row's speed-ups, per step and piped: over ``full``
    (``speedup_vs_full``), over the dense paged row of its own alpha and
    variant (``speedup_vs_dense``: Quest against ``full_softmax``, the
    model's-alpha policies against ``full``) and over ``sdpa_static``."""
    timed = {r["method"]: r for r in rows if "ms_per_step" in r}

    def ratio(r, ref, key):
        for src, dst in (("ms_per_step", ""), ("ms_per_token_piped", "_piped")):
            if src in r and src in ref:
                r[key + dst] = ref[src] / r[src]

    for r in timed.values():
        name, _, label = r["method"].partition("@")
        suffix = f"@{label}" if label else ""
        alpha = METHODS[name][0] if name in METHODS else 1.0  # (sdpa_static: softmax)
        dense = next((timed.get(d + suffix) for d, (a, pol) in METHODS.items()
                      if isinstance(pol, Full) and a == alpha and d + suffix in timed), None)
        for ref, key in ((timed.get("full"), "speedup_vs_full"), (dense, "speedup_vs_dense"),
                         (timed.get("sdpa_static"), "speedup_vs_sdpa")):
            if ref is not None:
                ratio(r, ref, key)


def plot(rows, path):
    """tokens/s against prompt length, per method, one panel per (model, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, B) in zip(axes[0], panels):
        sub = [r for r in rows if (r["model"], r["batch"]) == (model, B) and "tokens_per_s" in r]
        for method in dict.fromkeys(r["method"] for r in sub):
            pts = sorted((r["n"], r["tokens_per_s"]) for r in sub if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}, batch {B}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="twin,llama8b", help=f"comma list of {list(SUITES)}")
    ap.add_argument("--methods", default=None, help=f"comma list of {list(METHODS) + ['sdpa_static']} "
                    "(default: the suite's)")
    ap.add_argument("--lengths", default=None, help="comma list of prompt lengths (default: the suite's)")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default: the suite's)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per method (>= 1)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first, capture included (>= 1)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=32768, help="prefill chunk in tokens")
    ap.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s of the floor (H200: 4.26e12)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="eager steps (the host-bound path)")
    ap.add_argument("--prefill-alpha", type=float, default=None,
                    help="alpha of the prompt's prefill (default: the model's; 1: softmax through SDPA, "
                         "for decode timings of random-weight models only: prefill_s is then SDPA's)")
    ap.add_argument("--no-fused", action="store_true",
                    help="the model's PyTorch elementwise code in the step (not entmaxkv/kernels/model.py's kernels)")
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                    help="weights and cache (default: float16 for the twin, bfloat16 for llama8b, float32 for tiny)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also record each method's 32 costliest kernels and the sum over all "
                         "its kernels, µs per step over STEPS profiled steps (CUDA)")
    ap.add_argument("--config", action="append", default=[], metavar="[STAGE.]FIELD=VALUE",
                    help="a KernelConfig field of the attention kernels, e.g. attention.finish_prune=True (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:ITEM[;ITEM]",
                    help="also time every paged method with these --config items added, as METHOD@LABEL "
                         "(repeatable), e.g. gqa:topk.keys_gqa=True")
    ap.add_argument("--checkpoint", default="checkpoints/entmax", help="the twin checkpoint")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None, help="folder for bench_generate.json and .png")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.profile < 0:
        ap.error("--steps and --warmup must be >= 1 and --profile >= 0")
    args.kernel_config = kernel_config(args.config)  # parsed (and checked) once
    args.variants = [("", args.kernel_config)]
    for text in args.variant:
        label, sep, items = text.partition(":")
        if not sep or not label or not items or "@" in label:
            ap.error(f"argument --variant: expected LABEL:ITEM[;ITEM], got {text!r}")
        args.variants.append((label, kernel_config(args.config + items.split(";"))))
    device = torch.device(args.device)
    clock = Clock(device)
    rows, t0 = [], time.time()
    for suite in args.suite.split(","):
        if suite not in SUITES:
            ap.error(f"argument --suite: unknown suite {suite!r} (expected one of {list(SUITES)})")
        methods, cases = SUITES[suite]
        methods = args.methods.split(",") if args.methods else methods
        if args.lengths or args.batches:
            bs = [int(b) for b in args.batches.split(",")] if args.batches else sorted({b for b, _ in cases})
            ls = [int(n) for n in args.lengths.split(",")] if args.lengths else sorted({n for _, ns in cases
                                                                                       for n in ns})
            cases = [(b, ls) for b in bs]
        model = build_model(suite, device, args.checkpoint,
                            None if args.dtype is None else getattr(torch, args.dtype))
        with torch.no_grad():
            for B, lengths in cases:
                for n in lengths:
                    rows += run_case(model, suite, B, n, methods, args, clock, args.bandwidth)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = run_meta("benchmarks.bench_generate", argv, device, bandwidth=args.bandwidth, kernel_config=args.config,
                    variants=args.variant,
                    seconds=round(time.time() - t0, 1))
    if args.out:
        save(args.out, "bench_generate", meta, rows, plot)
    return rows


if __name__ == "__main__":
    main()
