"""A/B of the top-k selection chain (ad hoc, not committed): old chain vs _rowsel_kernel variants."""
import json, math, os, sys, time
import torch
sys.path.insert(0, "benchmarks")
import bench_decode as bd
from entmaxkv import kernels as K
from entmaxkv.kernels import topk as tk

VARIANTS = [
    ("old", dict(ROWSEL=False)),
    ("rowsel", dict(ROWSEL=True)),
    ("nt2", dict(ROWSEL=True, ROWSEL_NT=2)),
    ("small256", dict(ROWSEL=True, ROWSEL_SMALL=256)),
    ("gs128", dict(ROWSEL=True, ROWSEL_GS=128)),
    ("w8", dict(ROWSEL=True, ROWSEL_WARPS=8)),
    ("w4", dict(ROWSEL=True, ROWSEL_WARPS=4)),
]
DEFAULT = {k: getattr(tk, k) for _, v in VARIANTS for k in v}
configs = sys.argv[1].split(",")
methods = sys.argv[2].split(",")
flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
out = []
for cname in configs:
    cfg = bd.CONFIGS[cname]
    cache, ids, q, k4, v4 = bd.build(cfg)
    scale = 1.0 / math.sqrt(cfg[4])
    for meth in methods:
        ref = None
        res_ms = {}
        for rnd in range(2):
            for vname, knobs in VARIANTS:
                for k, v in DEFAULT.items():
                    setattr(tk, k, v)
                for k, v in knobs.items():
                    setattr(tk, k, v)
                step = bd.make_step(K, meth, cache, ids, q, k4, v4, scale)
                g, res = bd.capture(step)
                ms, _ = bd.time_graph(g, flush, 5, 20, 100.0)
                res_ms.setdefault(vname, []).append(ms)
                if rnd == 0:
                    sel = res[1]
                    s = torch.sort(torch.where(torch.arange(sel.pages.shape[-1], device="cuda") < sel.counts[..., None],
                                               sel.pages, -1), dim=-1).values
                    if ref is None:
                        ref = (s, sel.counts.clone(), res[0].float().clone())
                    else:
                        same = torch.equal(s, ref[0]) and torch.equal(sel.counts, ref[1])
                        oerr = (res[0].float() - ref[2]).abs().max().item()
                        if not same or oerr > 0:
                            print(f"MISMATCH {cname} {meth} {vname} same_pages={same} out_maxdiff={oerr}", flush=True)
                del g, res
        line = f"{cname:12s} {meth:16s} " + " ".join(f"{v}={a:.4f}/{b:.4f}" for v, (a, b) in res_ms.items())
        print(line, flush=True)
        out.append(dict(config=cname, method=meth, ms=res_ms))
    del cache, ids, q, k4, v4
    torch.cuda.empty_cache()
for k, v in DEFAULT.items():
    setattr(tk, k, v)
if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "ab_rowsel.json"), "w"), indent=1)
