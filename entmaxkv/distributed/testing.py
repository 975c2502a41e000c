"""Multi-process checks of context-parallel decode against one process.

``run(world, check, *args)`` starts ``world`` processes on this machine
(torch.multiprocessing spawn, gloo on loopback), each calling
``check(rank, world, *args)`` inside an initialised process group; an
assertion in any rank fails the call. The checks build the same random
(seeded) sequences on every rank, decode them once over an ordinary
``PagedKVCache`` (the single-process truth) and once over a
``ShardedCache``, and compare. Used by tests/test_distributed.py; kept in
the package so that spawned processes can import them.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache import PagedKVCache
from ..decode import decode
from ..policies import Certified, Full, Gaussian, TopK
from ..testing import alibi, rel_err
from .combine import ContextParallel
from .shard import ShardedCache
from .step import decode as cp_decode

__all__ = ["run", "check_policies", "check_fallback", "check_generate"]

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, check, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (ranks share this machine's cores)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        check(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, check, *args) -> None:
    """Run ``check(rank, world, *args)`` in ``world`` processes (gloo)."""
    mp.spawn(_entry, args=(world, _free_port(), check, args), nprocs=world, join=True)


def _caches(world, layout, lens, H, D, P, dtype, backend, seed):
    """(single-process cache and slots, sharded cache and slots, the sequences' K/V)."""
    g = torch.Generator().manual_seed(seed)
    ks = [(torch.randn(n, H, D, generator=g) * 1.5) for n in lens]
    vs = [torch.randn(n, H, D, generator=g) for n in lens]
    max_len = max(lens) + 8
    full = PagedKVCache(sum(-(-n // P) for n in lens) + len(lens), P, H, D, max_seqs=len(lens), dtype=dtype)
    ids = [full.allocate(k, v) for k, v in zip(ks, vs)]
    span = -(-(-(-max_len // P)) // world)
    sc = ShardedCache(num_pages=len(lens) * span, page_size=P, kv_heads=H, head_dim=D, max_seqs=len(lens),
                      max_len=max_len, layout=layout, dtype=dtype)
    sids = [sc.allocate() for _ in lens]
    for s, k, v in zip(sids, ks, vs):  # a prefill, then appends across page boundaries
        cut = max(1, len(k) - 3)
        sc.prefill(s, k[:cut], v[:cut])
        for j in range(cut, len(k)):
            sc.append([s], k[j:j + 1], v[j:j + 1])
    return full, ids, sc, sids


POLICIES = [
    (Full(), 1.0), (Full(), 1.5), (TopK(16), 1.0), (TopK(16, sinks=1, window=1), 1.5), (TopK(8), 2.0),
    (Gaussian(), 1.5), (Gaussian(pooled=True, per_query_head=True), 1.5),
    (Certified(seed=TopK(8)), 1.5), (Certified(seed=Gaussian(), per_query_head=True), 2.0),
]


# the policies whose selection both backends make alike (the kernels' Gaussian
# tau_hat is iterated differently, so a borderline page may differ there)
KERNEL_POLICIES = [(Full(), 1.0), (Full(), 1.5), (TopK(16), 1.0), (TopK(16, sinks=1, window=1), 1.5),
                   (Certified(seed=TopK(8)), 1.5)]


def check_policies(rank, world, layout, backend, dtype, G):
    """Every policy, with and without ALiBi: the same output (to the dtype's
    rounding), the same pages read, the same tau, certified where the
    single-process step is, on every rank. The sequences have uneven
    lengths; the short one leaves ranks without a token of it."""
    H, D, P = 2, 16, 4
    lens = [4 * P * world + 3, 9, 2 * P * world + 1]
    full, ids, sc, sids = _caches(world, layout, lens, H, D, P, dtype, backend, seed=world)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(len(lens), H * G, D, generator=g) * 1.5).to(dtype)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for policy, alpha in (POLICIES if backend == "reference" else KERNEL_POLICIES):
        for slopes in (None, alibi(H * G)):
            want, ws = decode(q, full, ids, policy, alpha=alpha, alibi_slopes=slopes, backend=backend,
                              return_stats=True)
            got, gs = cp_decode(q, sc, sids, policy, alpha=alpha, alibi_slopes=slopes, backend=backend,
                                return_stats=True)
            tag = (layout, backend, str(dtype), policy, alpha, slopes is not None)
            assert bool(gs.exact.all()), tag
            if isinstance(policy, (Full, Certified)):  # exact: equal whatever the pages
                assert bool(gs.stats.certified.all()) and bool(ws.certified.all()), tag
                assert rel_err(got, want) < tol, tag
            gaussian = isinstance(policy, Gaussian) or isinstance(getattr(policy, "seed", None), Gaussian)
            if gaussian:
                # tau_hat is a root summed in another order: a borderline page may flip
                assert int((gs.stats.pages_read - ws.pages_read).abs().max()) <= 1, tag
                if not torch.equal(gs.stats.pages_read, ws.pages_read):
                    continue
            assert torch.equal(gs.stats.pages_read, ws.pages_read), tag
            assert torch.equal(gs.stats.tokens_read, ws.tokens_read), tag
            assert rel_err(got, want) < tol, tag
            assert torch.allclose(gs.stats.tau, ws.tau, rtol=1e-4, atol=1e-4), tag
            assert torch.equal(gs.stats.certified, ws.certified), tag
    # the same result on every rank
    seen = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(seen, got)
    assert all(torch.equal(s, seen[0]) for s in seen)


def check_fallback(rank, world, layout):
    """Flat scores: a support far wider than the candidates each rank sends,
    so the first collective cannot certify tau: the Newton rounds find it
    (exact, certified); too few rounds are reported inexact, never certified."""
    H, D, P = 2, 16, 4
    lens = [23 * world + 5, 11 * world]
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(n, H, D, generator=g) * 0.01 for n in lens]
    vs = [torch.randn(n, H, D, generator=g) for n in lens]
    q = torch.randn(2, 2 * H, D, generator=g)
    full = PagedKVCache(64, P, H, D, max_seqs=2, dtype=torch.float32)
    ids = [full.allocate(k, v) for k, v in zip(ks, vs)]
    sc = ShardedCache(num_pages=64, page_size=P, kv_heads=H, head_dim=D, max_seqs=2, max_len=max(lens) + 4,
                      layout=layout, dtype=torch.float32)
    sids = [sc.allocate() for _ in lens]
    for s, k, v in zip(sids, ks, vs):
        sc.prefill(s, k, v)
    for alpha in (1.5, 2.0, 1.25, 3.0):
        want, ws = decode(q, full, ids, Full(), alpha=alpha, return_stats=True)
        for cfg in (ContextParallel(candidates=4), ContextParallel(candidates=4, sync=True)):
            got, gs = cp_decode(q, sc, sids, Full(), alpha=alpha, config=cfg, return_stats=True)
            assert rel_err(got, want) < 2e-6 and bool(gs.exact.all()), (alpha, cfg)
            assert int(gs.rounds.min()) > 0 and bool(gs.stats.certified.all()), (alpha, cfg)
            assert torch.allclose(gs.stats.tau, ws.tau, rtol=1e-6, atol=1e-6), (alpha, cfg)
        _, short = cp_decode(q, sc, sids, Full(), alpha=alpha, config=ContextParallel(candidates=4, fallback_rounds=1),
                             return_stats=True)
        assert not bool(short.exact.all()) and not bool(short.stats.certified[~short.exact].any()), alpha


def check_generate(rank, world, layout, policy_name):
    """The entmax twin decoding across ranks gives the tokens one process gives."""
    from ..model.checkpoint import load_model
    from ..model.generate import generate, make_policy
    from .generate import generate as cp_generate

    model = load_model(CHECKPOINTS / "entmax")
    policy = make_policy(policy_name, budget=32)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(32, 127, (2, 70), generator=g)
    want = generate(model, prompt, 6, policy=policy, page_size=8).tokens
    got = cp_generate(model, prompt, 6, policy=policy, page_size=8, layout=layout)
    assert torch.equal(got, want), (layout, policy_name, got, want)
