"""Every kernel stage against the pure-PyTorch reference on the GPU.

The GPU tests (tests/gpu/) need a CUDA device and are skipped without one.
Run them on the GPU machine from the repository root:

    python -m pytest -m gpu tests/gpu                        # the full sweeps
    ENTMAXKV_GPU_QUICK=1 python -m pytest -m gpu tests/gpu   # a few cases of each

This module sweeps dtypes, head dims 32-256, page sizes 8/16/128, GQA groups,
alpha, ALiBi and per-query-head selection on medium shapes (about 3000
tokens): each stage against the reference (float64 queries), and a CUDA-graph
replay of a whole decode step equal to the eager call. Batch 8 x 512k and
1M tokens are checked by ``python -m benchmarks.bench_decode --check``.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from benchmarks.harness import capture
from entmaxkv import attention as RA
from entmaxkv import policies as RP
from entmaxkv import scoring as RS
from entmaxkv.testing import KERNEL_TOL as TOL, alibi, gpu_quick, page_sets, random_case, rel_err, tau_hat_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DIMS = [32, 64, 128, 256]
if gpu_quick():
    GRID = [(torch.float16, 32, (2, 1), 16), (torch.bfloat16, 128, (2, 4), 16),
            (torch.float32, 64, (2, 4), 8), (torch.float16, 256, (2, 1), 128)]
else:
    GRID = list(itertools.product([torch.float16, torch.bfloat16, torch.float32], DIMS, [(2, 1), (2, 4)],
                                  [8, 16, 128]))
CASES = [(i, *c) for i, c in enumerate(GRID)]
IDS = [f"{i}-{str(dt)[6:]}-d{D}-h{H}g{G}-p{P}" for i, dt, D, (H, G), P in CASES]


def _case(i, dtype, D, heads, P):
    """(cache, ids, q, slopes, scale) of sweep case i, heads = (kv heads H,
    group G): three rows (about 3000 tokens, 1537, one page and a bit); ALiBi
    on odd cases (NAPE: half the heads without position)."""
    H, G = heads
    cache, ids, q, _ = random_case([3000 + 17 * i, 1537, P + 3], H, G, D, P, dtype, seed=i, device="cuda")
    slopes = alibi(H * G).cuda() if i % 2 == 1 else None
    return cache, ids, q, slopes, 1.0 / math.sqrt(D)


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    return _case(*request.param)


def test_scoring(case):
    from entmaxkv import kernels as K

    cache, ids, q, slopes, scale = case
    ub = K.quest_bounds(q, cache, ids, scale=scale, slopes=slopes)
    rub = RS.quest_bounds(q, cache, ids, scale=scale, slopes=slopes)
    fin = torch.isfinite(rub)
    assert torch.equal(torch.isfinite(ub), fin) and rel_err(ub[fin], rub[fin]) < 1e-5
    mu, sg, nt = K.gaussian_stats(q, cache, ids, scale=scale, slopes=slopes)
    rmu, rsg, rnt = RS.gaussian_stats(q, cache, ids, scale=scale, slopes=slopes)
    assert max(rel_err(mu, rmu), rel_err(sg, rsg), rel_err(nt, rnt)) < 1e-5


def check_dense(q, cache, ids, alpha, scale, slopes, config=None):
    """Dense decode (``dense_attend``) against the reference over every page:
    output within the dtype's tolerance, tau within 1e-4."""
    from entmaxkv import kernels as K

    o, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=config)
    full = RP.select(RP.Full(), q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    ro, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=scale, slopes=slopes)
    assert rel_err(o, ro) < TOL[q.dtype]
    assert float((tau.double() - rtau).abs().max()) < 1e-4


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
def test_dense_attention(case, alpha):
    cache, ids, q, slopes, scale = case
    check_dense(q, cache, ids, alpha, scale, slopes)


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
@pytest.mark.parametrize("pol", [RP.TopK(256), RP.TopK(128, sinks=1, window=2, per_query_head=True)],
                         ids=["topk256", "topk128q-sinks-window"])
def test_topk_attention(case, alpha, pol):
    """The kernels' top-k keeps the reference policy's pages; attention over them matches."""
    from entmaxkv import kernels as K

    cache, ids, q, slopes, scale = case
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    assert page_sets(sel) == page_sets(rsel)
    o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes)
    ro, rtau = RA.attend(q.double(), cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
    assert rel_err(o, ro) < TOL[q.dtype] and float((tau.double() - rtau).abs().max()) < 1e-4


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("pol", [RP.Certified(seed=RP.TopK(128)), RP.Gaussian(), RP.Gaussian(pooled=True, margin=0.1),
                                 RP.Certified(seed=RP.Gaussian())],
                         ids=["certified-topk", "gaussian", "gaussian-pooled", "certified-gaussian"])
def test_gaussian_and_certified(case, alpha, pol):
    """At most two pages differ from the reference's selection (borderline
    pages at a tau_hat rounded differently); the output then matches to
    1e-3, else to the dtype's tolerance; tau_hat against a float64 solve
    (the float32 reference loses digits in the Gaussian tail)."""
    from entmaxkv import kernels as K

    cache, ids, q, slopes, scale = case
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    diff = sum(len(a ^ b) for ra, rb in zip(page_sets(sel), page_sets(rsel)) for a, b in zip(ra, rb))
    o, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes, tau_init=sel.tau_hat)
    ro, _ = RA.attend(q.double(), cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
    assert diff <= 2 and rel_err(o, ro) < max(TOL[q.dtype], 1e-3 if diff else 0), diff
    if sel.tau_hat is not None:
        oracle = tau_hat_oracle(q, cache, ids, scale=scale, slopes=slopes, alpha=alpha, pooled=pol.pooled)
        assert float((sel.tau_hat.double() - oracle).abs().max()) < 1e-3


def test_certify(case):
    from entmaxkv import kernels as K

    cache, ids, q, slopes, scale = case
    P = cache.page_size
    ub = K.quest_bounds(q, cache, ids, scale=scale, slopes=slopes)
    sel = K.select(RP.TopK(256), q, cache, ids, alpha=1.5, scale=scale, slopes=slopes)
    _, tau = K.attend(q, cache, ids, sel, alpha=1.5, scale=scale, slopes=slopes)
    lay = RS.page_layout(cache, ids)
    slack = RS.bound_slack(q, cache, ids, scale=scale, slopes=slopes)
    got = K.certify(ub, sel, tau, 1.5, lay.seq_len, page_size=P, slack=slack)
    want = RA.certify(ub, sel, tau, 1.5, lay.seq_len, page_size=P, slack=slack)
    assert torch.equal(got, want)


@pytest.mark.parametrize("sweep", [c for c in CASES if c[0] % 3 == 0], ids=[i for c, i in zip(CASES, IDS)
                                                                           if c[0] % 3 == 0])
def test_graph_replay_equals_eager(sweep):
    """A CUDA graph of a whole top-k decode step replays to the eager output, bit for bit."""
    from entmaxkv import kernels as K

    cache, ids, q, slopes, scale = _case(*sweep)
    pol = RP.TopK(256)

    def step():
        s_ = K.select(pol, q, cache, ids, alpha=1.5, scale=scale, slopes=slopes)
        return K.attend(q, cache, ids, s_, alpha=1.5, scale=scale, slopes=slopes)[0]

    eo = step()
    g, go = capture(step)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(go, eo)


@pytest.mark.parametrize("dtype,D,heads", [(torch.float16, 64, (4, 2)), (torch.bfloat16, 128, (8, 4)),
                                           (torch.float32, 32, (2, 1))], ids=["f16-d64-g2", "bf16-d128-g4", "f32-d32"])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
def test_finish_tail_wide_support(dtype, D, heads, alpha):
    """Nearly flat keys give supports of thousands of tokens, longer than
    finish_own: the tail launch (_attn_vtail_kernel, as many programs per
    head as fill the SMs) gathers them. Dense and through a Certified
    selection, against the reference and the finish alone; a CUDA graph of
    the dense call replays twice to the eager bits (its arrival counters
    start from zero every replay)."""
    from entmaxkv import kernels as K
    from entmaxkv.kernels import AttentionConfig, KernelConfig

    H, G = heads
    flat = 0.0002 if alpha == 2.0 else 0.002  # (sparsemax keeps a narrower band of scores)
    cache, ids, q, _ = random_case([9000, 4100, 40], H, G, D, 16, dtype, seed=D + H, key_scale=flat, device="cuda")
    slopes = alibi(H * G).cuda() * 0.001  # (mild: long supports on every head)
    scale = 1.0 / math.sqrt(D)
    # (the one-launch finish at any split count: the tail follows it only)
    tail = KernelConfig(attention=AttentionConfig(finish_max_splits=128))
    alone = KernelConfig(attention=AttentionConfig(finish_max_splits=128, finish_tail=1))
    full = RP.select(RP.Full(), q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    ro, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=scale, slopes=slopes)
    x = (alpha - 1.0) * RA.selected_scores(q.double(), cache, ids, full, scale=scale, slopes=slopes)[0]
    assert int((x > rtau[..., None]).sum(-1).max()) > 2 * AttentionConfig().finish_own
    for cfg in (tail, alone):
        o, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=cfg)
        assert rel_err(o, ro) < TOL[dtype] and float((tau.double() - rtau).abs().max()) < 1e-4
    pol = RP.Certified(seed=RP.TopK(1024))
    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    o, _ = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes, config=tail)
    so, _ = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes)
    assert rel_err(o, so) < TOL[dtype]

    def step():
        return K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, slopes=slopes, config=tail)[0]

    eo = step()
    g, go = capture(step)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, eo)
