"""What the benchmarks share: cases on the GPU, CUDA-graph capture, timing, configs.

``build`` makes a paged cache of standard-normal K/V with shuffled block
tables (and contiguous copies for the dense baseline); ``capture`` puts one
step in a CUDA graph; ``time_graph`` times replays with CUDA events (warm-up,
L2 flushed before each timed replay, median). ``kernel_config`` turns
command-line options into a KernelConfig (the kernels' launch choices).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from entmaxkv.cache import PagedKVCache


def kernel_config(items, base=None):
    """A KernelConfig from "FIELD=VALUE" / "STAGE.FIELD=VALUE" options (VALUE a
    Python literal), e.g. ``pdl=False`` or ``attention.finish=False``, applied
    to ``base`` (None: the defaults); None when there are neither."""
    if not items:
        return base
    from entmaxkv.kernels.config import KernelConfig

    cfg = KernelConfig() if base is None else base
    for item in items:
        target, _, text = item.partition("=")
        value = ast.literal_eval(text)
        stage, _, name = target.rpartition(".")
        if not stage:
            if name not in {f.name for f in dataclasses.fields(cfg)}:
                raise ValueError(f"--config: KernelConfig has no field {name!r}")
            cfg = dataclasses.replace(cfg, **{name: value})
            print(f"# config {target} = {value!r}")
            continue
        sub = getattr(cfg, stage, None)
        if not dataclasses.is_dataclass(sub) or name not in {f.name for f in dataclasses.fields(sub)}:
            raise ValueError(f"--config: no field {target!r} in KernelConfig")
        cfg = dataclasses.replace(cfg, **{stage: dataclasses.replace(sub, **{name: value})})
        print(f"# config {target} = {value!r}")
    return cfg


def build(cfg, seed=0):
    """Paged cache + contiguous [B, H, n, D] copies of K and V + queries."""
    B, n, HQ, H, D, dtype, P = cfg
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k4 = torch.randn(B, H, n, D, device="cuda", dtype=dtype, generator=gen)
    v4 = torch.randn(B, H, n, D, device="cuda", dtype=dtype, generator=gen)
    npages = -(-n // P)
    cache, slots = PagedKVCache.from_dense(
        k4.transpose(1, 2), v4.transpose(1, 2), [n] * B, P, dtype=dtype, spare_pages=B,
        shuffle=True, generator=torch.Generator().manual_seed(seed), device="cuda",
        max_pages_per_seq=npages,
    )
    q = torch.randn(B, HQ, D, device="cuda", dtype=dtype, generator=gen)
    ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    return cache, ids, q, k4, v4


def capture(step):
    """Warm up (compiles) on a side stream, then capture one step in a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = step()
    torch.cuda.synchronize()
    return g, res


def time_graph(g, flush, warmup, reps, warm_ms=0.0):
    """(median ms, sorted ms) of ``reps`` replays, each after an L2 flush,
    following at least ``warmup`` untimed replays and at least ``warm_ms`` of
    them: a GPU that has just been idle runs the first milliseconds slower
    (single-method runs read 5-7% slower than the same step timed after
    other methods, experiments/logs/experiments.log)."""
    t0 = time.perf_counter()
    i = 0
    while i < warmup or (time.perf_counter() - t0) * 1e3 < warm_ms:
        g.replay()
        i += 1
        if i % 4 == 0:  # the host clock follows the device, not the launch queue
            torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in evs:
        flush.zero_()
        e0.record()
        g.replay()
        e1.record()
    torch.cuda.synchronize()
    ts = sorted(e0.elapsed_time(e1) for e0, e1 in evs)
    return ts[len(ts) // 2], ts


def run_meta(module: str, argv, device: torch.device, **extra) -> dict:
    """What a result file records about its run: the GPU (or "cpu"), the
    versions, the date and the exact command (``python -m <module> ...``)."""
    return {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv), **extra}


def save(out: str, stem: str, meta: dict, rows: list, plot) -> None:
    """Write ``<out>/<stem>.json`` ({"meta", "rows"}) and the plot
    ``plot(rows, path)`` draws to ``<out>/<stem>.png``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(out, stem + ".png"))


def sketched(cache: PagedKVCache, dims: int) -> PagedKVCache:
    """``cache`` with per-token key sketches of ``dims`` coordinates (basis
    fitted to a sample of its keys): a shallow copy that shares the pages
    and the host state, with sketched layers of its own, so the original
    stays without sketches."""
    view = copy.copy(cache)
    view.enable_sketches(dims)
    return view
