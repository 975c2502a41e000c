"""Context-parallel decode over torch.distributed: one sequence's pages spread
across ranks (NCCL on GPUs, gloo on CPUs), every policy exact across shards.

    import torch.distributed as dist
    from entmaxkv.distributed import ContextParallel, ShardedCache, decode

    dist.init_process_group("nccl")             # or "gloo"
    cache = ShardedCache(num_pages=..., page_size=16, kv_heads=H, head_dim=D, max_seqs=B,
                         max_len=4_000_000, layout="interleaved", device="cuda")
    s = cache.allocate(); cache.prefill(s, k, v)   # the whole prompt's K/V, on every rank
    out = decode(q, cache, [s], TopK(1024), alpha=1.5)   # the same output on every rank

Modules: ``shard`` (which rank holds which page; ShardedCache), ``combine``
(the collectives: softmax merge, the exact entmax threshold, the output),
``step`` (one decode step per policy), ``generate`` (the project's model
decoding across ranks). The algorithm and its cost: docs/distributed.md.
"""
from .combine import ContextParallel
from .generate import generate
from .shard import LAYOUTS, ShardedCache, Sharding
from .step import ShardStats, decode

__all__ = ["ContextParallel", "LAYOUTS", "ShardStats", "ShardedCache", "Sharding", "decode", "generate"]
