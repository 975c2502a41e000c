"""The project's model generating with a context-parallel cache.

Every rank runs the whole model on the same tokens (the dense layers are
replicated); each layer's KV cache is a ``ShardedCache``, so a rank stores
and reads only its share of every sequence, and attention is one
``entmaxkv.distributed.decode`` per layer. Every rank returns the same
tokens, those one process would produce.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import as_bool, as_choice, as_float, as_int
from ..backend import BACKENDS
from ..model.generate import SEED_MAX, _check_cache_dtype, _check_model, _prompt_tensor, sample_next
from ..policies import Full, check_policy
from .combine import ContextParallel
from .shard import LAYOUTS, ShardedCache
from .step import decode

__all__ = ["generate"]


@torch.no_grad()
def generate(model, prompt, max_new_tokens: int, *, policy=None, layout: str = "contiguous", page_size: int = 16,
             cache_dtype: Optional[torch.dtype] = None, backend: str = "auto",
             config: ContextParallel = ContextParallel(), temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, group=None, return_stats: bool = False):
    """Continue each prompt row by ``max_new_tokens`` tokens, attention sharded
    over the ranks of ``group`` (every rank calls this with the same arguments).

    As ``entmaxkv.model.generate``: the first T - 1 prompt tokens are
    prefilled, the last one and every new token go through the decode path
    with ``policy``; ``temperature`` 0 is greedy, sampling uses a CPU
    generator seeded with ``seed`` (the same draws on every rank).
    ``layout``: how the pages are spread ("contiguous" or "interleaved").

    Returns long [B, max_new_tokens] on the CPU (and, with ``return_stats``,
    one list of per-layer ``ShardStats`` per step).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    _check_model(model)
    cfg = model.cfg
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", lo=1)
    page_size = as_int(page_size, "page_size", lo=1, hi=256)
    as_choice(layout, "layout", LAYOUTS)
    as_choice(backend, "backend", BACKENDS)
    cache_dtype = _check_cache_dtype(cache_dtype)
    temperature = as_float(temperature, "temperature", lo=0.0)
    top_k = as_int(top_k, "top_k", lo=0)
    top_p = as_float(top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
    seed = as_int(seed, "seed", lo=0, hi=SEED_MAX)
    return_stats = as_bool(return_stats, "return_stats")
    policy = Full() if policy is None else policy
    check_policy(policy, alpha=cfg.attn_alpha, page_size=page_size)
    prompt = _prompt_tensor(prompt, cfg.vocab_size)
    B, T = prompt.shape
    p = next(model.parameters())
    max_len = T + max_new_tokens
    ranks = dist.get_world_size(group)
    span = -(-(-(-max_len // page_size)) // ranks)
    caches = [ShardedCache(num_pages=B * span, page_size=page_size, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           max_seqs=B, max_len=max_len, layout=layout, dtype=cache_dtype or p.dtype,
                           device=p.device, group=group) for _ in range(cfg.n_layers)]
    slots = [caches[0].allocate() for _ in range(B)]
    for c in caches[1:]:
        assert [c.allocate() for _ in range(B)] == slots
    if T > 1:
        model.prefill(prompt[:, :-1].to(p.device), caches, slots)
    attend = functools.partial(decode, config=config)
    gen = torch.Generator().manual_seed(seed)
    cur = prompt[:, -1].to(p.device)
    out, stats = [], []
    for i in range(max_new_tokens):
        pos = torch.full((B,), T - 1 + i, dtype=torch.long, device=p.device)
        res = model.decode_step(cur, caches, slots, policy, positions=pos, backend=backend, attend=attend,
                                return_stats=return_stats)
        logits = res[0] if return_stats else res
        if return_stats:
            stats.append(res[1])
        cur = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        out.append(cur)
    tokens = torch.stack(out, 1).cpu()
    return (tokens, stats) if return_stats else tokens
