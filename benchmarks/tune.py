"""Block-size sweep for the split attention kernel (dense softmax / entmax).

Times ``kernels.dense_attend`` (or, with ``--sparse``, ``kernels.attend``
over every page in shuffled order, the path a selection takes; with
``--pages N`` over N of them, a top-k-sized selection; with ``--full-width``
too, N pages counted in a list as wide as the cache, as a Gaussian or
certified selection keeps them) for
(BLOCK_T, num_warps, num_stages) x split factor x tile Newton steps x
bound-update mode (``--lb-modes``; other settings with ``--config``) on the
given configurations (one head per program: paper config; tl.dot path: GQA
config), each variant an ``AttentionConfig``, and prints a table; the chosen
values then become the ``AttentionConfig`` defaults by hand.

    python -m benchmarks.tune --configs gqa_128k --alphas 1.0
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from .bench_decode import CONFIGS
from .harness import build, capture, kernel_config, time_graph

VARIANTS = {  # (BLOCK_T, num_warps, num_stages) per code path
    "one_head": [(256, 4, 3), (256, 8, 3), (512, 4, 3), (512, 8, 3), (1024, 8, 2), (512, 8, 4)],
    "dot": [(64, 4, 5), (32, 4, 6), (32, 4, 4), (32, 2, 6), (128, 4, 4)],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k,gqa_32k")
    ap.add_argument("--alphas", default="1.0,1.5")
    ap.add_argument("--factors", default="4,8")
    ap.add_argument("--newton", default="1")
    ap.add_argument("--lb-modes", default=None, metavar="M,M",
                    help="bound-update modes (0, 1) to time on every path (entmax; default: the config's lb_mode_*)")
    ap.add_argument("--sparse", action="store_true", help="time attend over a shuffled full page list")
    ap.add_argument("--pages", type=int, default=0,
                    help="with --sparse: keep only the first N pages of each shuffled list (a top-k-sized selection)")
    ap.add_argument("--full-width", action="store_true",
                    help="with --pages: keep the page list's full width (as a Gaussian or certified selection has, "
                         "so the split count is the dense one) and count N pages in it")
    ap.add_argument("--gaussian", action="store_true",
                    help="time attend over the pages the Gaussian policy keeps (alpha 1.5 selection)")
    ap.add_argument("--variants", default=None, metavar="BT,WARPS,STAGES;...",
                    help="(BLOCK_T, num_warps, num_stages) triples to time instead of the built-in list")
    ap.add_argument("--config", action="append", default=[], metavar="[STAGE.]FIELD=VALUE",
                    help="a KernelConfig field under every variant, e.g. attention.prefetch_pages=False")
    args = ap.parse_args(argv)
    from entmaxkv import kernels as K
    from entmaxkv.kernels import KernelConfig
    from entmaxkv.kernels.select import select_full
    from entmaxkv.types import Selection

    base = kernel_config(args.config) or KernelConfig()
    lb_modes = [int(x) for x in args.lb_modes.split(",")] if args.lb_modes else [None]

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    alphas = [float(a) for a in args.alphas.split(",")]
    out = []
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        B, n, HQ, H, D, dtype, P = cfg
        cache, ids, q, k4, v4 = build(cfg)
        ng = HQ // H
        sel = None
        if args.gaussian:
            from entmaxkv import Gaussian
            sel = K.select(Gaussian(), q, cache, ids, alpha=1.5, scale=1 / math.sqrt(D))
        elif args.sparse:
            full = select_full(q, cache, ids)
            gen = torch.Generator(device="cuda").manual_seed(1)
            perm = torch.argsort(torch.rand(full.pages.shape, device="cuda", generator=gen), dim=-1)
            pages = torch.gather(full.pages, -1, perm.to(torch.int32)).contiguous()
            if args.pages:
                if not args.full_width:
                    pages = pages[..., :args.pages].contiguous()
                sel = Selection(pages, torch.full_like(full.counts, min(args.pages, pages.shape[-1])))
            else:
                sel = Selection(pages, full.counts)
        variants = VARIANTS["dot" if ng >= 2 else "one_head"]
        if args.variants:
            variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
        for alpha in alphas:
            for factor in (float(f) for f in args.factors.split(",")):
                for newton, lb_mode in ((nw, lm) for nw in (int(x) for x in args.newton.split(","))
                                        for lm in lb_modes):
                    if alpha == 1.0 and (newton, lb_mode) != (int(args.newton.split(",")[0]), lb_modes[0]):
                        continue  # softmax has no lower bound
                    for v in variants:
                        # programs per SM (the tl.dot entmax pass: exactly, rounded down)
                        c = dataclasses.replace(base.attention, split_factor=factor, dot_entmax_per_sm=factor,
                                                tile_newton=newton, tune=(((ng, D, alpha == 1.0), v),))
                        if lb_mode is not None:
                            c = dataclasses.replace(c, lb_mode_one_head=lb_mode, lb_mode_dot_folded=lb_mode,
                                                    lb_mode_dot_rows=lb_mode)
                        cfg_v = dataclasses.replace(base, attention=c)
                        try:
                            if sel is None:
                                g, _ = capture(lambda: K.dense_attend(q, cache, ids, alpha=alpha, scale=1 / math.sqrt(D),
                                                                      config=cfg_v))
                            else:
                                g, _ = capture(lambda: K.attend(q, cache, ids, sel, alpha=alpha, scale=1 / math.sqrt(D),
                                                                config=cfg_v))
                            ms, _ = time_graph(g, flush, 5, 15)
                            del g
                        except Exception as exc:  # noqa: BLE001
                            ms = float("nan")
                            print(cname, alpha, v, "ERROR", str(exc)[:200])
                        out.append((cname, alpha, factor, (newton, lb_mode), v, ms))
                        print(f"{cname:11s} a{alpha} f{factor:g} nw{newton} lb{lb_mode} {v} {ms:.4f}", flush=True)
        del cache, ids, q, k4, v4
        torch.cuda.empty_cache()
    print("\nbest per (config, alpha):")
    for cname in args.configs.split(","):
        for alpha in alphas:
            rows = [r for r in out if r[0] == cname and r[1] == alpha and r[5] == r[5]]
            rows.sort(key=lambda r: r[5])
            for r in rows[:3]:
                print(f"  {r[0]:11s} a{r[1]} factor {r[2]:g} (newton, lb mode) {r[3]} (BT, warps, stages) {r[4]}: "
                      f"{r[5]:.4f} ms")


if __name__ == "__main__":
    main()
