"""Block-size sweep for the split attention kernel (dense softmax / entmax).

Times ``kernels.dense_attend`` for a few (BLOCK_T, num_warps, num_stages,
split factor, tile Newton steps) choices on one configuration per code path
(one head per program: paper config; tl.dot path: GQA config) and prints a
table; the chosen values are then written into ``_plan`` by hand.

    PYTHONPATH=. python benchmarks/tune.py
"""
from __future__ import annotations

import math

import torch

from bench_decode import CONFIGS, build, capture, time_graph  # noqa: E402


def main():
    from entmaxkv.kernels import attention as A

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    plans = {
        "paper_128k": [(256, 4, 3), (512, 4, 3), (512, 8, 3), (1024, 8, 3)],
        "gqa_32k": [(32, 4, 3), (64, 4, 3), (128, 4, 3), (64, 8, 3)],
    }
    out = []
    for cname, variants in plans.items():
        cfg = CONFIGS[cname]
        B, n, HQ, H, D, dtype, P = cfg
        cache, ids, q, k4, v4 = build(cfg)
        ng = HQ // H
        for alpha in (1.0, 1.5):
            for factor in (4, 8):
                A.SPLIT_FACTOR = factor
                for newton in (1,):
                    A.TILE_NEWTON = newton
                    for v in variants:
                        A.TUNE.clear()
                        A.TUNE[(ng, D, alpha == 1.0)] = v
                        try:
                            g, _ = capture(lambda: A.dense_attend(q, cache, ids, alpha=alpha, scale=1 / math.sqrt(D)))
                            ms, _ = time_graph(g, flush, 5, 15)
                            del g
                        except Exception as exc:  # noqa: BLE001
                            ms = float("nan")
                            print(cname, alpha, v, "ERROR", str(exc)[:200])
                        out.append((cname, alpha, factor, newton, v, ms))
                        print(f"{cname:11s} a{alpha} f{factor} nw{newton} {v} {ms:.4f}", flush=True)
        del cache, ids, q, k4, v4
        torch.cuda.empty_cache()
    print("\nbest per (config, alpha):")
    for cname in plans:
        for alpha in (1.0, 1.5):
            rows = [r for r in out if r[0] == cname and r[1] == alpha and r[5] == r[5]]
            rows.sort(key=lambda r: r[5])
            for r in rows[:3]:
                print(f"  {r[0]:11s} a{r[1]} factor {r[2]} newton {r[3]} (BT, warps, stages) {r[4]}: {r[5]:.4f} ms")


if __name__ == "__main__":
    main()
