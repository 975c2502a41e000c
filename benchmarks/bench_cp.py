"""Context-parallel decode latency across GPUs (a script; run with torchrun).

One process per GPU, NCCL (gloo for a CPU dry run). For each configuration
and total context length it builds a ``ShardedCache`` of standard-normal K/V
(every rank generates the same sequence and keeps its pages), then times
``entmaxkv.distributed.decode`` per policy: the step's median ms (CUDA
events, a barrier before each timed step), the time spent inside the
collectives (events around each all-gather / all-reduce of the step), the
collective payload, and the K/V + metadata bytes this rank read. With one
process it also times the single-GPU ``decode`` on the same data.

    torchrun --nproc-per-node 4 -m benchmarks.bench_cp --out benchmarks/results
    torchrun --nproc-per-node 2 -m benchmarks.bench_cp --configs paper --batches 1 --lengths 1048576
    torchrun --nproc-per-node 2 -m benchmarks.bench_cp --device cpu --backend reference --lengths 4096 \\
        --configs paper --batches 1 --reps 3          # a CPU dry run of the code path (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from entmaxkv import decode
from entmaxkv.distributed import ContextParallel, ShardedCache
from entmaxkv.distributed import decode as cp_decode
from entmaxkv.types import Certified, Full, Gaussian, TopK

CONFIGS = {  # name: (q_heads, kv_heads, head_dim, dtype, page)
    "paper": (24, 24, 32, torch.float16, 16),
    "gqa": (32, 8, 128, torch.bfloat16, 16),
}
POLICIES = {  # name: (alpha, policy)
    "full_softmax": (1.0, Full()),
    "full_entmax": (1.5, Full()),
    "quest1024": (1.0, TopK(1024)),
    "topk1024": (1.5, TopK(1024)),
    "gaussian": (1.5, Gaussian()),
    "certified": (1.5, Certified(seed=TopK(1024), probe_every=1)),
}


class CollectiveTimer:
    """CUDA events around every all-gather / all-reduce while active (the
    benchmark's own instrumentation: torch.distributed's two calls wrapped)."""

    def __init__(self, device):
        self.device, self.events, self.bytes, self.active = device, [], 0, False
        self._orig = (dist.all_gather, dist.all_reduce)
        dist.all_gather = self._wrap(self._orig[0], lambda a: a[1].numel() * a[1].element_size() * len(a[0]))
        dist.all_reduce = self._wrap(self._orig[1], lambda a: a[0].numel() * a[0].element_size())

    def _wrap(self, fn, size):
        def call(*args, **kwargs):
            if not self.active or self.device.type != "cuda":
                if self.active:
                    self.bytes += size(args)
                return fn(*args, **kwargs)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            res = fn(*args, **kwargs)
            e1.record()
            self.events.append((e0, e1))
            self.bytes += size(args)
            return res
        return call

    @contextmanager
    def measure(self):
        self.events, self.bytes, self.active = [], 0, True
        try:
            yield self
        finally:
            self.active = False

    def ms(self) -> float:
        return sum(e0.elapsed_time(e1) for e0, e1 in self.events)

    def close(self):
        dist.all_gather, dist.all_reduce = self._orig


def build(cfg, batch, n, layout, device, group, chunk=1 << 18):
    HQ, H, D, dtype, P = cfg
    world = dist.get_world_size(group)
    span = -(-(-(-n // P)) // world)
    cache = ShardedCache(num_pages=batch * span + batch, page_size=P, kv_heads=H, head_dim=D, max_seqs=batch,
                         max_len=n, layout=layout, dtype=dtype, device=device, group=group)
    gen = torch.Generator(device=device).manual_seed(0)
    slots = []
    for _ in range(batch):
        s = cache.allocate()
        for c0 in range(0, n, chunk):  # the same values on every rank (same seed), bounded memory
            m = min(chunk, n - c0)
            k = torch.randn(m, H, D, generator=gen, device=device, dtype=dtype)
            v = torch.randn(m, H, D, generator=gen, device=device, dtype=dtype)
            cache.prefill(s, k, v, check_finite=False)
        slots.append(s)
    q = torch.randn(batch, HQ, D, generator=gen, device=device, dtype=dtype)
    return cache, slots, q


def time_step(fn, device, warmup, reps, group):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="paper,gqa", help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {list(POLICIES)}")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--lengths", default="1048576,2097152,4194304", help="comma list of total context lengths")
    ap.add_argument("--layout", default="interleaved", choices=["contiguous", "interleaved"])
    ap.add_argument("--candidates", type=int, default=64, help="ContextParallel.candidates (>= 1)")
    ap.add_argument("--fallback-rounds", type=int, default=12, help="ContextParallel.fallback_rounds (>= 0)")
    ap.add_argument("--sync", action="store_true", help="ContextParallel.sync: skip unneeded fallback rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    ap.add_argument("--out", default=None, help="folder for bench_cp_<world>.json (rank 0 writes it)")
    args = ap.parse_args(argv)
    for flag in ("warmup", "reps", "candidates"):
        if getattr(args, flag) < 1:
            ap.error(f"argument --{flag.replace('_', '-')}: expected an int >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cfg_cp = ContextParallel(candidates=args.candidates, fallback_rounds=args.fallback_rounds, sync=args.sync)
    timer = CollectiveTimer(device)
    rows = []
    try:
        for cname in args.configs.split(","):
            cfg = CONFIGS[cname]
            HQ, H, D, dtype, P = cfg
            for batch in (int(b) for b in args.batches.split(",")):
                for n in (int(x) for x in args.lengths.split(",")):
                    try:
                        cache, slots, q = build(cfg, batch, n, args.layout, device, None)
                    except torch.cuda.OutOfMemoryError as exc:
                        rows.append(dict(config=cname, batch=batch, n=n, world=world, error=f"OOM: {exc}"[:200]))
                        torch.cuda.empty_cache()
                        continue
                    local_tokens = sum(cache.sharding.local_tokens(n) for _ in slots)
                    for pname in args.policies.split(","):
                        alpha, policy = POLICIES[pname]
                        row = dict(config=cname, batch=batch, n=n, world=world, rank=rank, policy=pname,
                                   layout=args.layout, local_tokens=local_tokens)
                        step = lambda: cp_decode(q, cache, slots, policy, alpha=alpha, config=cfg_cp,  # noqa: E731
                                                 backend=args.backend, check_finite=False)
                        row["ms"] = time_step(step, device, args.warmup, args.reps, None)
                        with timer.measure():
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                            _, st = cp_decode(q, cache, slots, policy, alpha=alpha, config=cfg_cp,
                                              backend=args.backend, check_finite=False, return_stats=True)
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                        row.update(collective_ms=timer.ms(), collective_bytes=timer.bytes,
                                   collectives=st.collectives, rounds_max=int(st.rounds.max()),
                                   exact=bool(st.exact.all()), certified=bool(st.stats.certified.all()),
                                   coverage=float(st.stats.coverage.mean()))
                        kv_tok = 2 * D * torch.tensor([], dtype=dtype).element_size()
                        read = float(st.stats.tokens_read.double().sum()) / HQ * H / world  # this rank's share
                        meta = local_tokens / P * H * 2 * D * torch.tensor([], dtype=dtype).element_size()
                        row["bytes_per_rank"] = read * kv_tok + (0 if isinstance(policy, Full) else meta)
                        if world == 1:  # the single-GPU step on the same pages
                            one = lambda: decode(q, cache.local, slots, policy, alpha=alpha,  # noqa: E731
                                                 backend=args.backend, check_finite=False)
                            row["single_ms"] = time_step(one, device, args.warmup, args.reps, None)
                        if rank == 0:
                            print(json.dumps(row), flush=True)
                        rows.append(row)
                    del cache, q
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        timer.close()
    if rank == 0 and args.out:
        import triton

        meta = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", world=world,
                    torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                    date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    command="torchrun -m benchmarks.bench_cp " + " ".join(sys.argv[1:] if argv is None else argv))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_cp_{world}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
