"""The fused causal prefill kernels (kernels/prefill/) on the GPU at long shapes.

GPU only (skipped without CUDA); ``ENTMAXKV_GPU_QUICK=1`` shortens the
sweep (tests/gpu/test_stages.py says how to run them). The reference is
float64, computed from the definitions one block of queries at a time
(entmax through ``entmaxkv.entmax.entmax``), so it never holds more than a
[H, chunk, T] score block.
"""
from __future__ import annotations

import math

import pytest
import torch

from entmaxkv.testing import KERNEL_TOL as TOL, alibi, gpu_quick, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def chunked_reference(q, k, v, alpha, scale, slopes=None, chunk=256):
    """float64 causal attention [B, H, Tq, D] of the last Tq of Tk positions."""
    from entmaxkv.entmax import entmax

    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    G = H // KV
    kd = k.double().repeat_interleave(G, dim=1)
    vd = v.double().repeat_interleave(G, dim=1)
    out = torch.empty(B, H, Tq, D, dtype=torch.float64, device=q.device)
    j = torch.arange(Tk, device=q.device)
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        pos = torch.arange(Tk - Tq + c0, Tk - Tq + c1, device=q.device)[:, None]
        s = torch.einsum("bhid,bhjd->bhij", q[:, :, c0:c1].double(), kd) * scale
        if slopes is not None:
            s = s + slopes.double().view(1, H, 1, 1) * (j[None, :] - pos).double()
        s = s.masked_fill(j[None, :] > pos, float("-inf"))
        p = torch.softmax(s, dim=-1) if alpha == 1.0 else entmax(s, alpha, dim=-1)
        out[:, :, c0:c1] = torch.einsum("bhij,bhjd->bhid", p, vd)
    return out


def _inputs(B, H, KV, Tq, Tk, D, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, Tq, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(B, KV, Tk, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(B, KV, Tk, D, device="cuda", generator=gen).to(dtype)
    return q, k, v


# (dtype, D, H, KV, alpha, slopes, Tq, Tk)
if gpu_quick():
    CASES = [
        (torch.bfloat16, 32, 8, 4, 1.5, "nape", 4096, 4096),
        (torch.float16, 128, 8, 2, 1.0, "none", 4096, 4096),
        (torch.bfloat16, 32, 8, 4, 1.0, "nape", 1000, 4096),
    ]
else:
    CASES = [
        (dt, D, H, KV, alpha, sl, Tq, 4096)
        for dt in (torch.bfloat16, torch.float16)
        for D, H, KV in ((32, 8, 4), (128, 8, 2))
        for alpha in (1.0, 1.5)
        for sl in ("nape", "none")
        for Tq in (4096, 1000)
    ] + [
        (torch.float32, 32, 8, 4, 1.5, "nape", 4096, 4096),
        (torch.float32, 64, 4, 4, 2.0, "all", 2048, 2048),
        (torch.float32, 96, 4, 1, 1.25, "none", 2048, 2048),
        (torch.bfloat16, 256, 4, 2, 1.5, "nape", 2048, 2048),
    ]
IDS = [f"{str(dt)[6:]}-d{D}-h{H}kv{KV}-a{a}-{sl}-q{Tq}k{Tk}" for dt, D, H, KV, a, sl, Tq, Tk in CASES]


@pytest.mark.parametrize("dtype,D,H,KV,alpha,sl,Tq,Tk", CASES, ids=IDS)
def test_long_prefill_matches_reference(dtype, D, H, KV, alpha, sl, Tq, Tk):
    from entmaxkv.kernels.prefill import causal_attention

    q, k, v = _inputs(1, H, KV, Tq, Tk, D, dtype, seed=Tq + D + H)
    slopes = {"none": None, "nape": alibi(H, nape=True), "all": alibi(H, nape=False)}[sl]
    slopes = None if slopes is None else slopes.cuda()
    scale = 1.0 / math.sqrt(D)
    out = causal_attention(q, k, v, alpha=alpha, scale=scale, slopes=slopes)
    ref = chunked_reference(q, k, v, alpha, scale, slopes)
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < tol


def test_softmax_matches_sdpa():
    """Without ALiBi the softmax kernel gives torch's causal SDPA output."""
    from entmaxkv.kernels.prefill import causal_attention

    q, k, v = _inputs(2, 8, 2, 4096, 4096, 128, torch.bfloat16, seed=1)
    out = causal_attention(q, k, v, alpha=1.0, scale=128 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1), is_causal=True)
    assert rel_err(out, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_graph_replay_equals_eager(alpha):
    """No host synchronisation in the launch path: the call is captured in a
    CUDA graph, and a replay on new inputs (copied into the captured
    buffers) gives the eager output."""
    from benchmarks.harness import capture
    from entmaxkv.kernels.prefill import causal_attention

    q, k, v = _inputs(1, 8, 4, 2048, 2048, 32, torch.bfloat16, seed=3)
    slopes = alibi(8, nape=True).cuda()
    out = torch.empty_like(q)
    g, _ = capture(lambda: causal_attention(q, k, v, alpha=alpha, scale=0.2, slopes=slopes, out=out))
    q2, k2, v2 = _inputs(1, 8, 4, 2048, 2048, 32, torch.bfloat16, seed=4)
    q.copy_(q2)
    k.copy_(k2)
    v.copy_(v2)
    g.replay()
    torch.cuda.synchronize()
    want = causal_attention(q2, k2, v2, alpha=alpha, scale=0.2, slopes=slopes)
    assert torch.equal(out, want)
