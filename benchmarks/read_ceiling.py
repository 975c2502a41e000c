"""How fast can the page metadata be read at all? (a script, not a test; GPU only)

    PYTHONPATH=.:benchmarks python3 benchmarks/read_ceiling.py --configs paper_b1_2m,paper_1m

For each configuration, times (CUDA graph, L2 flushed, median) reads of the
whole k_bounds (k_min/k_max) table, the bytes the Quest keys pass and (as
k_moments) the Gaussian stats pass must move:

* ``torch.sum`` of the table (a vendor reduction over contiguous memory);
* a plain contiguous Triton read (BLOCK values x STEPS per program, a
  running max, so that nothing is optimised away);
* a Triton gather of whole pages through the benchmark's (shuffled) block
  table and through the identity table, in runs of RUN values, BLOCK_M pages
  per step and NSUB steps per program: what a pass that reads the metadata
  through a block table can reach;
* the keys pass as ``select_topk`` launches it.

Prints microseconds and TB/s per line; the ceiling for the kernels of
``entmaxkv.kernels`` is the best gather line.

With ``--kv`` it reads the K and V pages instead (the bytes of a dense
decode step), next to the step of torch SDPA over the contiguous
[B, H, n, D] copies and our dense softmax step, all in the same call:

    PYTHONPATH=.:benchmarks python3 benchmarks/read_ceiling.py --kv --configs gqa_128k,gqa_512k

* contiguous Triton reads of the [B, H, n, D] copies of K and V;
* whole pages (every KV head of a page: H * P * D values, one contiguous
  run) gathered through the block table;
* one KV head's run of each page (P * D values: what a program per KV head
  reads), a row's pages in order for each head in turn.

TB/s counts the K and V bytes of the batch (2 B H n D e) for every line.

With ``--skeleton`` it times what a top-k step must read and nothing else,
to bound how close to its floor such a step can come on this GPU:

    PYTHONPATH=.:benchmarks python3 benchmarks/read_ceiling.py --skeleton --configs paper_128k,gqa_128k,paper_b1_2m

* the metadata of every page gathered through the shuffled block table
  (whole pages, the best gather shapes of the default mode);
* the K and V runs of BUDGET // P random pages per (sequence, KV head)
  (a top-k selection's pages) gathered in one launch, for a few shapes;
* the two in one CUDA graph, the second launch after the first (a step
  with no selection work and no arithmetic: its read skeleton);
* our Quest and entmax top-k 1024 steps, in the same call;

each with its ratio to the step's bytes floor (metadata + selected K and V
+ outputs, at the 4.26 TB/s copy bandwidth, as ``bench_decode`` counts it).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench_decode import CONFIGS, build, capture, time_graph
from tune_keys import _read_kernel  # the plain contiguous read (a running max)


@triton.jit
def _gather_kernel(bt_ptr, x_ptr, y_ptr, out_ptr, NP, E: tl.constexpr, RUN: tl.constexpr,
                   BLOCK_M: tl.constexpr, NSUB: tl.constexpr, TWO: tl.constexpr = False):
    """Largest value of NSUB * BLOCK_M pages (E values each, read as runs of
    RUN) whose physical rows come from the table bt (NP entries); with TWO,
    the same rows of y as well (K and V pages in one launch)."""
    i_c = tl.program_id(0)
    NR: tl.constexpr = (E + RUN - 1) // RUN
    acc = tl.full([BLOCK_M, RUN], float("-inf"), tl.float32)
    for s in range(NSUB * NR):
        o_m = i_c * (NSUB * BLOCK_M) + (s // NR) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_m = o_m < NP
        phys = tl.load(bt_ptr + o_m, mask=m_m, other=0).to(tl.int64)
        o_e = (s % NR) * RUN + tl.arange(0, RUN)
        off = phys[:, None] * E + o_e[None, :]
        m = m_m[:, None] & (o_e < E)[None, :]
        acc = tl.maximum(acc, tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32))
        if TWO:
            acc = tl.maximum(acc, tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32))
    tl.store(out_ptr + i_c, tl.max(tl.max(acc, axis=1), axis=0))


def timed(fn, flush: torch.Tensor, reps: int, warm_ms: float = 0.0) -> float:
    """Median microseconds of ``fn`` captured in a CUDA graph (L2 flushed before each replay)."""
    g, _ = capture(fn)
    ms, _ = time_graph(g, flush, 5, reps, warm_ms=warm_ms)
    del g
    return ms * 1e3


def line(cname, what, us, nbytes):
    print(f"{cname:12s} {what:48s} {us:8.1f} us  {nbytes / us / 1e6:5.2f} TB/s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_b1_2m,paper_1m")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer Triton variants")
    ap.add_argument("--kv", action="store_true", help="read the K/V pages instead of the metadata")
    ap.add_argument("--skeleton", action="store_true",
                    help="a top-k step's reads alone (metadata, then the selected K/V) against our steps")
    args = ap.parse_args(argv)
    from entmaxkv.kernels import topk as T
    from entmaxkv.kernels._common import as_slopes, num_sms

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.kv or args.skeleton:
        for cname in args.configs.split(","):
            (skeleton if args.skeleton else kv_ceiling)(cname, args.reps, flush)
        return

    def us_of(fn):
        return timed(fn, flush, args.reps)

    for cname in args.configs.split(","):
        cache, ids, q, k4, v4 = build(CONFIGS[cname])
        del k4, v4
        torch.cuda.empty_cache()
        B, HQ, D = q.shape
        H = cache.kv_heads
        M = cache.block_table.shape[1]
        meta = cache.k_bounds  # [num_pages, H, 2, D], contiguous
        E = meta[0].numel()
        nb = meta.numel() * meta.element_size()
        used = B * M * E * meta.element_size()  # the pages the batch's block tables name
        print(f"## {cname}: table {nb / 2**20:.0f} MiB, {B} x {M} pages named ({used / 2**20:.0f} MiB), "
              f"{E} values per page", flush=True)
        line(cname, "torch.sum (whole table)", us_of(lambda: torch.sum(meta, dtype=torch.float32)), nb)
        flat = meta.view(-1)
        N = flat.numel()
        reads = ((2048, 16, 8), (4096, 8, 8), (8192, 4, 8), (1024, 16, 4), (2048, 8, 4))
        if args.quick:
            reads = reads[:2]
        for block, steps, w in reads:
            out = torch.empty(triton.cdiv(N, block * steps), device="cuda")
            us = us_of(lambda: _read_kernel[(out.numel(),)](flat, out, N, BLOCK=block, STEPS=steps, num_warps=w))
            line(cname, f"contiguous read {block} x {steps}, {w} warps", us, nb)
        bt = cache.block_table[ids.long()].reshape(-1).contiguous()
        ident = torch.arange(bt.numel(), dtype=torch.int32, device="cuda")
        NP = bt.numel()
        gathers = [(512, 8, 1, 4), (512, 8, 4, 4), (512, 16, 2, 8), (512, 32, 1, 8), (2048, 4, 2, 8),
                   (2048, 8, 1, 8), (512, 4, 8, 4), (256, 16, 4, 4), (512, 2, 16, 1), (256, 4, 8, 1)]
        if args.quick:
            gathers = gathers[:4]
        for run, bm, nsub, w in gathers:
            npg = bm * nsub
            out = torch.empty(triton.cdiv(NP, npg), device="cuda")
            for name, table in (("shuffled", bt), ("identity", ident)):
                us = us_of(lambda: _gather_kernel[(out.numel(),)](table, meta, meta, out, NP, E=E, RUN=run, BLOCK_M=bm,
                                                                   NSUB=nsub, num_warps=w))
                line(cname, f"gather {name} run {run} x {bm} pages x {nsub}, {w} warps", us, used)
        if HQ == H:
            k_pages, W = T.topk_width(M, cache.page_size, 1024, 0, 0)
            cfg = T.topk_plan(M, W, 1, D, q.dtype, cache.dtype, B * H, num_sms(q.device), cap=T.SELECT_CH)
            MK = cfg["NCH"] * cfg["CH"]
            keys = torch.empty(B * H * MK, dtype=torch.int32, device="cuda")
            sl = as_slopes(None, HQ, q.device)
            scale = D ** -0.5
            us = us_of(lambda: T.launch_keys(q, sl, ids, cache, keys, None, MK, scale, 0, 0, k_pages,
                                             has_alibi=False))
            line(cname, "topk._keys_kernel (select_topk's launch)", us, used)
        del cache, meta
        torch.cuda.empty_cache()


def kv_ceiling(cname: str, reps: int, flush: torch.Tensor, rounds: int = 2):
    """The --kv lines of one configuration (see the module docstring)."""
    import math

    import entmaxkv.kernels as K
    from bench_decode import make_step
    from tune_keys import _read_kernel as read

    def us_of(fn):
        return timed(fn, flush, reps, warm_ms=50)

    B, n, HQ, H, D, dtype, P = CONFIGS[cname]
    cache, ids, q, k4, v4 = build(CONFIGS[cname])
    M = cache.block_table.shape[1]
    kp, vp = cache.k_pages, cache.v_pages
    nb = 2 * B * H * n * D * k4.element_size()
    bt = cache.block_table[ids.long()].reshape(-1).contiguous()  # [B * M] physical pages
    # one KV head's run of each page as its own "page" of P * D values: rows (b, h), pages in order
    bth = (bt.view(B, 1, M).long() * H + torch.arange(H, device="cuda").view(1, H, 1)).reshape(-1)
    bth = bth.to(torch.int32).contiguous()
    N = k4.numel()

    def gather(table, e, run, bm, nsub, w):
        npg = bm * nsub
        out = torch.empty(triton.cdiv(table.numel(), npg), device="cuda")
        src = (kp.view(-1, e), vp.view(-1, e))
        return lambda: [_gather_kernel[(out.numel(),)](table, x, x, out, table.numel(), E=e, RUN=run, BLOCK_M=bm,
                                                       NSUB=nsub, num_warps=w) for x in src]

    for _ in range(rounds):
        for meth in ("sdpa", "full_softmax"):
            line(cname, f"step {meth}", us_of(make_step(K, meth, cache, ids, q, k4, v4, 1 / math.sqrt(D))), nb)
        for block, steps, w in ((2048, 8, 4), (4096, 8, 8), (2048, 16, 8)):
            out = torch.empty(triton.cdiv(N, block * steps), device="cuda")
            us = us_of(lambda: [read[(out.numel(),)](x.view(-1), out, N, BLOCK=block, STEPS=steps, num_warps=w)
                                for x in (k4, v4)])
            line(cname, f"contiguous K, V {block} x {steps}, {w} warps", us, nb)
        for run, bm, nsub, w in ((4096, 1, 4, 4), (4096, 1, 8, 8), (8192, 1, 4, 8), (4096, 2, 4, 8), (2048, 2, 8, 4)):
            line(cname, f"whole pages run {run} x {bm} pages x {nsub}, {w} warps",
                 us_of(gather(bt, H * P * D, run, bm, nsub, w)), nb)
        for run, bm, nsub, w in ((2048, 2, 8, 4), (2048, 4, 4, 4), (2048, 4, 8, 8), (2048, 8, 4, 8), (2048, 1, 16, 2)):
            line(cname, f"one head per page run {run} x {bm} pages x {nsub}, {w} warps",
                 us_of(gather(bth, P * D, run, bm, nsub, w)), nb)
    del cache, k4, v4
    torch.cuda.empty_cache()


def skeleton(cname: str, reps: int, flush: torch.Tensor, budget: int = 1024, rounds: int = 2):
    """The --skeleton lines of one configuration (see the module docstring)."""
    import math

    import entmaxkv.kernels as K
    from bench_decode import COPY_BW, make_step, nbytes

    def us_of(fn):
        return timed(fn, flush, reps, warm_ms=50)

    cfg = CONFIGS[cname]
    B, n, HQ, H, D, dtype, P = cfg
    cache, ids, q, k4, v4 = build(cfg)
    del k4, v4
    torch.cuda.empty_cache()
    M = cache.block_table.shape[1]
    es = cache.k_pages.element_size()
    bt = cache.block_table[ids.long()].reshape(-1).contiguous()  # [B * M] physical pages
    meta = cache.k_bounds
    E = meta[0].numel()  # every KV head's k_min and k_max of a page
    kp = budget // P
    gen = torch.Generator(device="cuda").manual_seed(1)
    # kp distinct random logical pages per (sequence, KV head), as physical page * H + head
    pick = torch.rand(B, H, M, device="cuda", generator=gen).argsort(dim=-1)[..., :kp]
    phys = bt.view(B, M).long().gather(1, pick.reshape(B, -1)).view(B, H, kp)
    sel = (phys * H + torch.arange(H, device="cuda").view(1, H, 1)).reshape(-1).to(torch.int32).contiguous()
    ek = P * D
    kv = (cache.k_pages.view(-1, ek), cache.v_pages.view(-1, ek))
    meta_bytes = B * M * E * meta.element_size()
    kv_bytes = 2 * sel.numel() * ek * es
    floor_bytes = meta_bytes + kv_bytes + B * HQ * D * es  # bench_decode's count for top-k (checked below)

    def checked(fn, out, probes):
        """fn, after checking that it reads the last value of each probed row
        (x, row): a large value planted there must come out as the maximum."""
        for x, r in probes:
            old = x[r, -1].clone()
            x[r, -1] = 1e4
            fn()
            assert out.max() == x[r, -1].float(), "a gather missed some of its rows"
            x[r, -1] = old
        return fn

    def meta_read(run=2048, bm=4, nsub=2, w=8):
        out = torch.empty(triton.cdiv(bt.numel(), bm * nsub), device="cuda")
        return checked(lambda: _gather_kernel[(out.numel(),)](bt, meta, meta, out, bt.numel(), E=E, RUN=run,
                                                              BLOCK_M=bm, NSUB=nsub, num_warps=w), out,
                       [(meta.view(-1, E), int(bt[0])), (meta.view(-1, E), int(bt[-1]))])

    def kv_read(bm, nsub, w):
        out = torch.empty(triton.cdiv(sel.numel(), bm * nsub), device="cuda")
        run = min(ek, 2048)
        return checked(lambda: _gather_kernel[(out.numel(),)](sel, kv[0], kv[1], out, sel.numel(), E=ek, RUN=run,
                                                              BLOCK_M=bm, NSUB=nsub, TWO=True, num_warps=w),
                       out, [(kv[0], int(sel[0])), (kv[1], int(sel[-1]))])

    def show(what, us, nbytes_):
        fl = floor_bytes / COPY_BW * 1e6
        print(f"{cname:12s} {what:48s} {us:8.1f} us  {nbytes_ / us / 1e6:5.2f} TB/s  {us / fl:5.2f}x floor",
              flush=True)

    print(f"## {cname}: metadata {meta_bytes / 1e6:.1f} MB, K/V of {kp} pages per (sequence, KV head) "
          f"{kv_bytes / 1e6:.1f} MB, floor {floor_bytes / COPY_BW * 1e6:.1f} us", flush=True)
    kv_shapes = ((1, 4, 4), (2, 2, 4), (4, 1, 4), (1, 1, 1), (2, 4, 8), (1, 2, 2))
    scale = 1 / math.sqrt(D)
    for _ in range(rounds):
        show("metadata gather (run 2048 x 4 pages x 2, 8 warps)", us_of(meta_read()), meta_bytes)
        best = None
        for bm, nsub, w in kv_shapes:
            us = us_of(kv_read(bm, nsub, w))
            show(f"selected K+V gather ({bm} pages x {nsub}, {w} warps)", us, kv_bytes)
            best = min(best or (us, bm, nsub, w), (us, bm, nsub, w))
        m_fn, kv_fn = meta_read(), kv_read(*best[1:])
        show(f"skeleton: metadata, then K+V ({best[1]} x {best[2]}, {best[3]} w)",
             us_of(lambda: (m_fn(), kv_fn())), meta_bytes + kv_bytes)
        for meth in ("quest_topk1024", "entmax_topk1024"):
            step = make_step(K, meth, cache, ids, q, None, None, scale)
            _, s_, _ = step()
            assert nbytes(cfg, meth, s_)[0] == floor_bytes, "floor bytes differ from bench_decode's"
            show(f"step {meth}", us_of(step), floor_bytes)
    del cache
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
