"""The planned decoder and the graph-safe write on the GPU.

- plan + write + run of several layers captured in one CUDA graph and
  replayed over many steps with growing lengths and new pages: outputs equal
  the eager path (``append`` + direct runs), and the cache written by the
  Triton write is bit-equal to the one ``append`` wrote;
- ``Decoder.run``'s own per-layer graphs equal its direct runs, and after
  the warm-up a run allocates no device memory;
- the certified policy's switch to the dense pass stays exact.

``python -m pytest -m gpu tests/gpu/test_planner.py`` on the device
(``ENTMAXKV_GPU_QUICK=1``: fewer steps).
"""
from __future__ import annotations

import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, PagedKVCache, TopK, decode
from entmaxkv import ops
from entmaxkv.planner import Decoder
from entmaxkv.testing import alibi, assert_same_state, cache_state, gpu_quick, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 30 if gpu_quick() else 100
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _twin_caches(L, H, D, P, dtype, lens, gen):
    caches = [PagedKVCache(sum(-(-n // P) for n in lens) + 64, P, H, D, max_seqs=len(lens), num_layers=L,
                           dtype=dtype, device="cuda", max_pages_per_seq=4096) for _ in range(2)]
    for n in lens:
        k = torch.randn(L, n, H, D, generator=gen, device="cuda")
        v = torch.randn(L, n, H, D, generator=gen, device="cuda")
        for c in caches:
            c.allocate(k, v)
    return caches


@pytest.mark.parametrize("policy", [Full(), TopK(256), Gaussian(), Certified(seed=TopK(256), probe_every=1)],
                         ids=["full", "topk", "gaussian", "certified"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_graph_of_layers_over_steps(policy, dtype):
    """One graph holds every layer's write and run; the host reserves pages
    (plan) before each replay. Equal to append + eager runs, step by step."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    L, H, G, D, P = 3, 4, 2, 64, 16
    lens = [1000, 37, 511]
    B = len(lens)
    graphed, eager = _twin_caches(L, H, D, P, dtype, lens, gen)
    slopes = alibi(H * G).cuda()
    kw = dict(q_heads=H * G, kv_heads=H, head_dim=D, page_size=P, alpha=1.5, alibi_slopes=slopes, device="cuda")
    dec = Decoder(policy, cuda_graphs=False, **kw)  # (the graph is ours)
    ref = Decoder(policy, cuda_graphs=False, **kw)
    k_in = torch.zeros(L, B, H, D, dtype=dtype, device="cuda")
    v_in, q_in = torch.zeros_like(k_in), torch.zeros(L, B, H * G, D, dtype=dtype, device="cuda")
    out = torch.zeros_like(q_in)
    slots = torch.zeros(B, dtype=torch.int64, device="cuda")
    seqs = list(range(B))

    def layers():
        for i in range(L):
            ops.write_kv(graphed.layer(i), k_in[i], v_in[i], slots)
            dec.run(q_in[i], graphed.layer(i), out[i])

    def fill():
        k_in.copy_(torch.randn(L, B, H, D, generator=gen, device="cuda"))
        v_in.copy_(torch.randn(L, B, H, D, generator=gen, device="cuda"))
        q_in.copy_(torch.randn(L, B, H * G, D, generator=gen, device="cuda"))

    graph = None
    for step in range(STEPS):
        fill()
        slots.copy_(graphed.reserve(seqs))  # the plan: pages decided on the host
        dec.plan_cache(graphed, seqs)
        if step < 2:  # warm-up (compiles, sizes the workspace), then capture
            layers()
        else:
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    layers()
                # capturing ran nothing: undo the reservation's effect by running this step eagerly
                layers()
            else:
                graph.replay()
        eager.append(seqs, k_in, v_in, check_finite=False)
        ref.plan_cache(eager, seqs)
        want = torch.stack([ref.run(q_in[i], eager.layer(i)) for i in range(L)])
        if isinstance(policy, TopK):
            assert torch.equal(out, want), step
        else:  # (atomics compact the Gaussian / certified pages in any order)
            assert rel_err(out, want) < TOL[dtype], step
    assert_same_state(cache_state(graphed), cache_state(eager))
    assert graphed.length(0) == lens[0] + STEPS and graphed.free_pages == eager.free_pages


@pytest.mark.parametrize("policy", [TopK(1024), Gaussian(), Certified(seed=TopK(1024))],
                         ids=["topk", "gaussian", "certified"])
def test_run_graphs_equal_direct_and_allocate_nothing(policy):
    """Decoder.run's per-layer graphs give the direct path's outputs; once
    warm, a run with ``out`` given allocates no device memory."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    L, H, G, D, P = 2, 8, 4, 128, 16
    cache = PagedKVCache(2400, P, H, D, max_seqs=4, num_layers=L, dtype=torch.bfloat16, device="cuda")
    for n in (9000, 20000, 333):
        cache.allocate(torch.randn(L, n, H, D, generator=gen, device="cuda"),
                       torch.randn(L, n, H, D, generator=gen, device="cuda"))
    kw = dict(q_heads=H * G, kv_heads=H, head_dim=D, page_size=P, alpha=1.5, device="cuda")
    graphs, direct = Decoder(policy, **kw), Decoder(policy, cuda_graphs=False, **kw)
    q = torch.randn(L, 3, H * G, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for step in range(6):
        for dec in (graphs, direct):
            dec.plan_cache(cache, [0, 1, 2])
        for i in range(L):
            graphs.run(q[i], cache.layer(i), out[i])
            want = direct.run(q[i], cache.layer(i))
            assert rel_err(out[i], want) < TOL[torch.bfloat16], (step, i)
    torch.cuda.synchronize()
    for dec in (graphs, direct):
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        dec.plan_cache(cache, [0, 1, 2])
        for i in range(L):
            dec.run(q[i], cache.layer(i), out[i])
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, dec.cuda_graphs


def test_certified_dense_switch_is_exact():
    """On i.i.d. keys the certified policy soon runs as the dense pass:
    still certified, still equal to Full, with decode's own decoder too."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    H, G, D, P = 8, 3, 32, 16
    cache = PagedKVCache(3000, P, H, D, max_seqs=2, dtype=torch.float16, device="cuda")
    for n in (20000, 7001):
        cache.allocate(torch.randn(n, H, D, generator=gen, device="cuda"),
                       torch.randn(n, H, D, generator=gen, device="cuda"))
    q = torch.randn(2, H * G, D, generator=gen, device="cuda", dtype=torch.float16)
    full = decode(q, cache, [0, 1], Full())
    for step in range(40):
        out, st = decode(q, cache, [0, 1], Certified(seed=TopK(512)), return_stats=True, check_finite=False)
        torch.cuda.synchronize()
        assert bool(st.certified.all()) and rel_err(out, full) < TOL[torch.float16], step
    (dec,) = [d for _, d in cache._decoders.values() if isinstance(d.policy, Certified)]
    assert dec._cert[id(cache.layer())].dense
