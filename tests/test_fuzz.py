"""Property tests of the decode step against an independent float64 oracle.

Random caches (page sizes 1..256, GQA groups 1..8, odd lengths, freed and
reused pages, every storage dtype), random alpha, scales and ALiBi slopes in
the supported range, adversarial rows (ties, a single token, peaked, huge,
tiny scores), every policy, and failures injected in the middle of cache
writes. Invariants:

- the output is finite;
- ``certified`` => the output equals full-cache attention (the oracle) to the
  dtype's tolerance;
- a selection holding the whole support => relative error <= 1e-6 in float64;
- after any failed write the cache equals the cache before it.

The oracle reads keys and values through the block table as the layout is
documented, and finds the entmax threshold by bisection in float64; it
shares no code with the library. Kernels run the same properties on
Triton's interpreter for small shapes.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from entmaxkv import CacheFullError, Certified, Full, Gaussian, PagedKVCache, TopK, decode
from entmaxkv.backend import REFERENCE
from entmaxkv.step import run_step
from entmaxkv.scoring import page_layout
from entmaxkv.attention import selection_mask
from entmaxkv.testing import assert_same_state, cache_state

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rounding of the output to its dtype, relative to the largest |v|.
OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The largest |alpha - 1| * |score| the properties draw: inside the range the
# library supports (docs/limits.md) with room for ALiBi terms.
ALPHA_MAX = 4.0
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ oracle

def stored_tokens(cache: PagedKVCache, slot: int):
    """float64 keys and values [n, H, D] of ``slot``, read through the block table."""
    n = int(cache.seq_lens[slot])
    P = cache.page_size
    j = torch.arange(n)
    phys = cache.block_table[slot].long().cpu()[j // P]
    k = cache.k_pages.cpu()[phys, :, j % P].double()
    v = cache.v_pages.cpu()[phys, :, j % P].double()
    return k, v


def entmax64(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha-entmax of a float64 vector (alpha = 1: softmax), by bisection."""
    if alpha == 1.0:
        e = torch.exp(s - s.max())
        return e / e.sum()
    x = (alpha - 1.0) * s
    x = x - x.max()  # the shifted threshold lies in [-1, 0]
    beta = 1.0 / (alpha - 1.0)
    lo, hi = -1.0, 0.0
    for _ in range(120):
        mid = 0.5 * (lo + hi)
        if float(torch.clamp(x - mid, min=0.0).pow(beta).sum()) >= 1.0:
            lo = mid
        else:
            hi = mid
    p = torch.clamp(x - lo, min=0.0).pow(beta)
    return p / p.sum()


def oracle(q, cache, slots, *, alpha, scale, slopes):
    """Full-cache attention in float64: (out [B, HQ, D], max |score| [B, HQ],
    support page sets [B][HQ])."""
    B, HQ, D = q.shape
    G = HQ // cache.kv_heads
    out = torch.zeros(B, HQ, D, dtype=torch.float64)
    smax = torch.zeros(B, HQ, dtype=torch.float64)
    supports = []
    for b, slot in enumerate(slots):
        k, v = stored_tokens(cache, slot)
        n = k.shape[0]
        rel = torch.arange(n, dtype=torch.float64) - (n - 1)
        rows = []
        for h in range(HQ):
            s = (k[:, h // G] @ q[b, h].double().cpu()) * scale
            if slopes is not None:
                s = s + float(slopes[h]) * rel
            p = entmax64(s, alpha)
            out[b, h] = p @ v[:, h // G]
            smax[b, h] = s.abs().max()
            rows.append(set((torch.nonzero(p > 0).flatten() // cache.page_size).tolist()))
        supports.append(rows)
    return out, smax, supports


def tolerance(dtype, alpha: float, smax: torch.Tensor, vmax: float) -> torch.Tensor:
    """Allowed |out - oracle| per head [B, HQ]: the output's rounding plus the
    float32 rounding of the scores, amplified by the entmax map's slope."""
    slope = max(1.0, 1.0 / (alpha - 1.0)) if alpha > 1 else 1.0
    score_err = 4e-7 * (1.0 + (max(alpha - 1.0, 1e-3)) * smax) * slope * 8
    return vmax * (OUT_TOL[dtype] + score_err)


# ------------------------------------------------------------------ caches

@st.composite
def cases(draw, small=False):
    """A cache with scattered, partly reused pages and a decode problem on it."""
    dtype = draw(st.sampled_from(DTYPES))
    P = draw(st.sampled_from((1, 2, 3, 7, 16, 64) if small else (1, 2, 3, 7, 16, 64, 256)))
    H = draw(st.integers(1, 2))
    G = draw(st.sampled_from((1, 2, 3, 4, 8)))
    D = draw(st.sampled_from((1, 3, 8, 16) if not small else (3, 8)))
    B = draw(st.integers(1, 2 if small else 3))
    n_max = 48 if small else 300
    lens = [draw(st.integers(1, n_max)) for _ in range(B)]
    kind = draw(st.sampled_from(("random", "ties", "single", "peaked", "huge", "tiny")))
    if kind == "single":
        lens = [1] * B
    decoys = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)

    def keys(n):
        k = torch.randn(n, H, D, generator=gen)
        if kind == "ties":
            k = k[:1].expand(n, H, D).clone()
        elif kind == "huge":
            k = k * 30.0
        elif kind == "tiny":
            k = k * 1e-30
        elif kind == "peaked":
            k[torch.randint(n, (1,), generator=gen)] *= 25.0
        return k

    pages = sum(-(-n // P) for n in lens) + decoys * 3 + 2
    cache = PagedKVCache(pages, P, H, D, max_seqs=B + decoys, dtype=dtype)
    # Decoys take pages first and are freed later, so the real sequences'
    # last pages come from the free list in a scattered order and inherit
    # pages whose statistics belonged to someone else.
    decoy = []
    for _ in range(decoys):
        s = cache.allocate()
        cache.prefill(s, torch.randn(min(2 * P, 5), H, D, generator=gen) * 50,
                      torch.randn(min(2 * P, 5), H, D, generator=gen))
        decoy.append(s)
    slots, ks = [], []
    for n in lens:
        s = cache.allocate()
        head = n // 2
        kn = keys(n)
        cache.prefill(s, kn[:head], torch.randn(head, H, D, generator=gen))
        slots.append(s)
        ks.append(kn)
    for s in decoy:
        cache.free(s)
    for s, n, kn in zip(slots, lens, ks):  # the rest token by token, as decoding does
        for j in range(n // 2, n):
            cache.append([s], kn[j:j + 1], torch.randn(1, H, D, generator=gen))

    q = torch.randn(B, H * G, D, generator=gen)
    if kind == "peaked":
        q = q * 3.0
    q = q.to(dtype)
    alpha = draw(st.one_of(st.sampled_from((1.0, 1.5, 2.0)),
                           st.floats(1.0 + 1e-6, ALPHA_MAX, allow_nan=False)))
    scale = draw(st.floats(0.05, 4.0)) / math.sqrt(D)
    slopes = None
    if draw(st.booleans()):
        slopes = torch.rand(H * G, generator=gen) * draw(st.sampled_from((0.01, 0.1, 1.0)))
        slopes[draw(st.integers(0, H * G - 1)):] = 0.0  # NAPE: some heads have no position
    return dict(cache=cache, slots=slots, q=q, alpha=alpha, scale=scale, slopes=slopes, dtype=dtype)


@st.composite
def policies(draw, alpha: float, P: int):
    side = dict(sinks=draw(st.integers(0, 2)), window=draw(st.integers(0, 2)),
                per_query_head=draw(st.booleans()))
    topk = TopK(budget=P * draw(st.integers(1, 12)), **side)
    if alpha == 1.0:
        return draw(st.sampled_from((Full(per_query_head=side["per_query_head"]), topk)))
    gauss = Gaussian(q_max=draw(st.floats(0.5, 0.9999)), margin=draw(st.sampled_from((0.0, 0.1))),
                     pooled=draw(st.booleans()), **side)
    seed = draw(st.sampled_from((topk, gauss)))
    return draw(st.sampled_from((Full(), topk, gauss, Certified(seed=seed, **side))))


def check_decode(c, policy, backend):
    cache, slots, q = c["cache"], c["slots"], c["q"]
    out, stats = decode(q, cache, slots, policy, alpha=c["alpha"], scale=c["scale"],
                        alibi_slopes=c["slopes"], return_stats=True, backend=backend)
    assert torch.isfinite(out).all(), "non-finite output"
    truth, smax, _ = oracle(q, cache, slots, alpha=c["alpha"], scale=c["scale"], slopes=c["slopes"])
    vmax = max(float(cache.v_pages.abs().max()), 1e-30)
    err = (out.double() - truth).abs().amax(-1)  # [B, HQ]
    tol = tolerance(c["dtype"], c["alpha"], smax, vmax)
    bad = stats.certified & (err > tol)
    assert not bad.any(), (
        f"certified heads differ from full-cache attention: err {err[bad].tolist()} "
        f"tol {tol[bad].tolist()} policy {policy} alpha {c['alpha']}")
    if isinstance(policy, Full):
        assert stats.certified.all(), "Full reads every page, so it is exact"


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_reference_certified_means_exact(data):
    c = data.draw(cases())
    policy = data.draw(policies(c["alpha"], c["cache"].page_size))
    check_decode(c, policy, "reference")


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_support_held_means_exact_float64(data):
    """A selection that holds every support token gives the full-cache output
    to float64 rounding (relative error <= 1e-6)."""
    c = data.draw(cases())
    cache, slots = c["cache"], c["slots"]
    policy = data.draw(policies(c["alpha"], cache.page_size))
    q = c["q"].double()
    ids = torch.tensor(slots, dtype=torch.int32)
    slopes = None if c["slopes"] is None else c["slopes"].float()
    sel, out, _, _ = run_step(REFERENCE, policy, q, cache, ids, c["alpha"], c["scale"], slopes,
                              need_bounds=True)
    truth, _, supports = oracle(q, cache, slots, alpha=c["alpha"], scale=c["scale"], slopes=slopes)
    M = page_layout(cache, ids).n_tok.shape[1]
    keep = selection_mask(sel, M)  # [B, S, M]
    G = q.shape[1] // sel.sel_heads
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kept = set(torch.nonzero(keep[b, h // G]).flatten().tolist())
            if supports[b][h] <= kept:
                o, t = out[b, h], truth[b, h]
                r = float((o - t).norm() / t.norm().clamp(min=1e-300))
                assert r <= 1e-6 or float((o - t).norm()) <= 1e-12, (b, h, r, policy, c["alpha"])


# -------------------------------------------------------- failed writes

class _FailAt(TorchFunctionMode):
    """Raise on the ``n``-th torch call (counting only, with ``n`` = None)."""

    def __init__(self, n=None):
        super().__init__()
        self.n, self.calls = n, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.n is not None and self.calls == self.n:
            raise RuntimeError("injected failure")
        return func(*args, **(kwargs or {}))


def _write(cache, slots, op, gen):
    H, D = cache.kv_heads, cache.head_dim
    if op == "append":
        cache.append(slots, torch.randn(len(slots), H, D, generator=gen),
                     torch.randn(len(slots), H, D, generator=gen))
    else:
        n = int(torch.randint(1, 3 * cache.page_size + 2, (1,), generator=gen))
        cache.prefill(slots[0], torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen))


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_failed_write_leaves_cache_unchanged(data):
    c = data.draw(cases(small=True))
    cache, slots = c["cache"], c["slots"]
    op = data.draw(st.sampled_from(("append", "prefill")))
    seed = data.draw(st.integers(0, 2**31 - 1))
    counter = _FailAt()
    trial = copy.deepcopy(cache)
    with counter:
        try:
            _write(trial, slots, op, torch.Generator().manual_seed(seed))
        except CacheFullError:
            pass
    n = data.draw(st.integers(1, max(counter.calls, 1)))
    before = cache_state(cache)
    try:
        with _FailAt(n):
            _write(cache, slots, op, torch.Generator().manual_seed(seed))
    except (RuntimeError, CacheFullError):
        assert_same_state(before, cache_state(cache))
    else:
        pytest.fail("the injected failure did not surface")


# ------------------------------------------------------------------ kernels

triton = pytest.importorskip("triton")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@settings(max_examples=12, **SETTINGS)
@given(data=st.data())
def test_kernels_certified_means_exact(data):
    """The same property on the Triton backend (the interpreter on the CPU)."""
    from entmaxkv.kernels import is_available

    if not is_available():
        pytest.skip("Triton cannot run here")
    c = data.draw(cases(small=True))
    policy = data.draw(policies(c["alpha"], c["cache"].page_size))
    check_decode(c, policy, "triton")
