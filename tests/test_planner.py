"""The planned decoder (plan once, run per layer) and the functional ops
against the stage functions (``step.run_step``) and ``decode``, on the
reference and on the Triton kernels (interpreter here)."""
from __future__ import annotations

import pytest
import torch

from entmaxkv import Certified, Full, Gaussian, PagedKVCache, TopK, decode
from entmaxkv import ops
from entmaxkv.backend import resolve_backend
from entmaxkv.layout import PagedKV, split_packed
from entmaxkv.planner import Decoder
from entmaxkv.step import run_step
from entmaxkv.testing import alibi, random_case, rel_err

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

POLICIES = {
    "full": Full(), "topk": TopK(24), "quest": TopK(24), "gaussian": Gaussian(),
    # (the certified cost check, which may run the dense pass instead: its own test below)
    "certified": Certified(seed=TopK(16), probe_every=1),
    "certified-gauss": Certified(seed=Gaussian(), per_query_head=True, probe_every=1),
}
ALPHA = {"quest": 1.0}


def _decoder(cache, policy, q, backend, slopes=None, alpha=1.5, **kw):
    return Decoder(policy, q_heads=q.shape[1], kv_heads=cache.kv_heads, head_dim=cache.head_dim,
                   page_size=cache.page_size, alpha=alpha, alibi_slopes=slopes, device=cache.device,
                   backend=backend, **kw)


# The reference runs the whole product; the interpreter a covering sample (each row moves one axis).
REF_CASES = [(p, dt, P, G, al) for p in POLICIES for dt in (torch.float32, torch.float16, torch.bfloat16)
             for P in (4, 16) for G in (1, 3) for al in (False, True)]
TRITON_CASES = [
    ("full", torch.float32, 4, 1, False), ("full", torch.bfloat16, 16, 3, True),
    ("topk", torch.float16, 4, 3, True), ("topk", torch.float32, 16, 1, False),
    ("quest", torch.bfloat16, 4, 1, True), ("gaussian", torch.float32, 4, 3, False),
    ("gaussian", torch.float16, 16, 1, True), ("certified", torch.float32, 4, 1, True),
    ("certified", torch.float16, 16, 3, False), ("certified-gauss", torch.float32, 4, 3, True),
]


def _check_planned(name, dtype, P, G, use_alibi, backend):
    cache, ids, q, sl = random_case([37 * P // 4 + 5, 70, 3], 2, G, 16, P, dtype, seed=P + G, slopes=use_alibi)
    policy, alpha = POLICIES[name], ALPHA.get(name, 1.5)
    dec = _decoder(cache, policy, q, backend, sl, alpha)
    for step in range(2):  # the second run reuses the sized workspace
        out, st = dec.plan_cache(cache, ids).run(q, cache.layer(), return_stats=True)
    ops_ = resolve_backend(backend, cache.device)
    sel, want, tau, _ = run_step(ops_, policy, q, cache, ids, alpha, 1.0 / 4.0, sl)
    assert torch.equal(out, want)
    got, st2 = decode(q, cache, ids, policy, alpha=alpha, alibi_slopes=sl, backend=backend, return_stats=True)
    assert torch.equal(got, out)
    for f in ("pages_read", "tokens_read", "coverage", "tau", "certified"):
        assert torch.equal(getattr(st, f), getattr(st2, f)), f
    if name.startswith("certified"):
        assert bool(st.certified.all())
    full, _ = resolve_backend("reference", cache.device).dense_attend(q.double(), cache, ids, alpha=alpha,
                                                                      scale=0.25, slopes=sl)
    if name in ("full",) or name.startswith("certified"):
        tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert rel_err(out, full) < tol


@pytest.mark.parametrize("name,dtype,P,G,use_alibi", REF_CASES)
def test_planned_equals_stages_reference(name, dtype, P, G, use_alibi):
    """Decoder.run and decode equal the stage functions bit for bit; certified
    (and Full) equal a float64 full-cache truth to the dtype's rounding."""
    _check_planned(name, dtype, P, G, use_alibi, "reference")


@pytest.mark.parametrize("name,dtype,P,G,use_alibi", TRITON_CASES)
def test_planned_equals_stages_triton(name, dtype, P, G, use_alibi):
    """The same through the Triton kernels, whose scratch comes from the
    decoder's workspace."""
    pytest.importorskip("triton")
    _check_planned(name, dtype, P, G, use_alibi, "triton")


def _engine_copy(cache, ids, packed: bool):
    """The cache's content as engine-owned buffers: a PagedKV whose block
    table has one row per batch row (``ids``), over packed [N, H, P, 2D]
    pages (strided K and V views) or separate ones."""
    lay = cache.layer()
    if packed:
        buf = torch.cat((lay.k_pages, lay.v_pages), dim=-1)
        k, v = split_packed(buf)
    else:
        k, v = lay.k_pages.clone(), lay.v_pages.clone()
    idx = ids.long()
    return PagedKV(k, v, lay.k_bounds.clone(), lay.k_moments.clone(), cache.block_table[idx].contiguous(),
                   cache.seq_lens[idx].contiguous())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_functional_decode_over_engine_buffers(packed, backend):
    """ops.decode over engine-owned (strided) buffers, block table [B, M]
    and seq_lens [B], equals decode over the cache."""
    if backend == "triton":
        pytest.importorskip("triton")
    cache, ids, q, sl = random_case([90, 41, 17], 2, 2, 16, 8, torch.float16, seed=3, slopes=True)
    kv = _engine_copy(cache, ids, packed)
    for policy in (Full(), TopK(24), Certified(seed=TopK(16))):
        want = decode(q, cache, ids, policy, alpha=1.5, alibi_slopes=sl, backend=backend)
        got = ops.decode(q, kv, policy, alpha=1.5, alibi_slopes=sl, backend=backend)
        assert torch.equal(got, want), policy
        sub = ops.decode(q[1:], kv, policy, alpha=1.5, alibi_slopes=sl, backend=backend, seq_ids=[1, 2])
        assert torch.equal(sub, want[1:])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_multi_layer_cache_one_plan(backend):
    """One cache for three layers sharing one block table: plan once, run
    each layer; equals decode per layer, and appends reach every layer."""
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(4)
    L, H, D, P = 3, 2, 16, 4
    cache = PagedKVCache(40, P, H, D, max_seqs=3, num_layers=L, dtype=torch.float32)
    for n in (13, 6):
        cache.allocate(torch.randn(L, n, H, D, generator=gen), torch.randn(L, n, H, D, generator=gen))
    cache.append([0, 1], torch.randn(L, 2, H, D, generator=gen), torch.randn(L, 2, H, D, generator=gen))
    q = torch.randn(L, 2, 2 * H, D, generator=gen)
    dec = Decoder(TopK(8), q_heads=2 * H, kv_heads=H, head_dim=D, page_size=P, backend=backend)
    dec.plan_cache(cache, [0, 1])
    outs = [dec.run(q[i], cache.layer(i)) for i in range(L)]
    for i in range(L):
        assert torch.equal(outs[i], decode(q[i], cache, [0, 1], TopK(8), layer=i, backend=backend))
    assert not torch.equal(outs[0], outs[1])


def test_certified_runs_dense_when_it_reads_most_pages():
    """On i.i.d. keys the certified selection keeps nearly every page: the
    next steps run the dense pass (certified, equal to Full), the selection
    is tried again every probe_every steps; on peaked keys it stays sparse."""
    cache, ids, q, _ = random_case([300, 200], 2, 2, 16, 4, torch.float32, seed=1, key_scale=0.3)
    dec = _decoder(cache, Certified(seed=TopK(8), probe_every=3), q, "reference")
    paths = []
    step = dec._step  # (a spy on this object's step: which path each run took)
    dec._step = lambda *a: (paths.append("dense" if a[5] else "sel"), step(*a))[1]
    full = decode(q, cache, ids, Full())
    for _ in range(8):
        out, st = dec.plan_cache(cache, ids).run(q, cache.layer(), return_stats=True)
        assert bool(st.certified.all()) and rel_err(out, full) < 1e-6
    # the first step selects and reads back its coverage; two dense steps, then a probe
    assert paths == ["sel", "dense", "dense", "sel", "dense", "dense", "sel", "dense"]
    assert dec._cert[id(cache.layer())].dense
    # peaked: one key far above the rest in every head, so the seed holds the support
    gen = torch.Generator().manual_seed(2)
    qp = torch.randn(2, 4, 16, generator=gen)
    cache2 = PagedKVCache(200, 4, 2, 16, max_seqs=2, dtype=torch.float32)
    for b, n in enumerate((300, 200)):
        k = torch.randn(n, 2, 16, generator=gen) * 0.05
        k[n - 1] = qp[b].view(2, 2, 16).sum(1) * 2  # the current token, in the last page
        cache2.allocate(k, torch.randn(n, 2, 16, generator=gen))
    dec2 = _decoder(cache2, Certified(seed=TopK(8), probe_every=3), qp, "reference")
    for _ in range(3):
        out, st = dec2.plan_cache(cache2, [0, 1]).run(qp, cache2.layer(), return_stats=True)
        assert bool(st.certified.all()) and float(st.coverage.max()) < 0.1
    assert not dec2._cert[id(cache2.layer())].dense


def test_certified_caller_rule_reads_no_coverage():
    """dense_rule="caller": the caller picks each step's form (``dense``).
    dense=None runs the selection even where the coverage rule switches to
    the dense pass (i.i.d. keys: every page kept), no layer computes or
    reads back its kept fraction, and both forms equal Full, certified."""
    pol = Certified(seed=TopK(8), probe_every=3)
    cache, ids, q, _ = random_case([300, 200], 2, 2, 16, 4, torch.float32, seed=1, key_scale=0.3)
    dec = _decoder(cache, pol, q, "reference", dense_rule="caller")
    full = decode(q, cache, ids, Full())
    for _ in range(4):
        out, st = dec.plan_cache(cache, ids).run(q, cache.layer(), return_stats=True)
        assert bool(st.certified.all()) and rel_err(out, full) < 1e-6
        assert not dec.dense_now([cache.layer()])
    assert dec.switches and dec._cert == {}
    # peaked keys: the selection keeps few pages, the dense pass all of them
    gen = torch.Generator().manual_seed(2)
    qp = torch.randn(2, 4, 16, generator=gen)
    peaked = PagedKVCache(200, 4, 2, 16, max_seqs=2, dtype=torch.float32)
    for b, n in enumerate((300, 200)):
        k = torch.randn(n, 2, 16, generator=gen) * 0.05
        k[n - 1] = qp[b].view(2, 2, 16).sum(1) * 2
        peaked.allocate(k, torch.randn(n, 2, 16, generator=gen))
    dec = _decoder(peaked, pol, qp, "reference", dense_rule="caller")
    full = decode(qp, peaked, [0, 1], Full())
    for dense, kept in ((None, 0.1), (True, 1.0), (False, 0.1)):
        out, st = dec.plan_cache(peaked, [0, 1]).run(qp, peaked.layer(), return_stats=True, dense=dense)
        assert bool(st.certified.all()) and rel_err(out, full) < 1e-6
        assert (float(st.coverage.min()) == 1.0) if kept == 1.0 else (float(st.coverage.max()) < kept)
    assert dec._cert == {}
    with pytest.raises(ValueError, match="dense_rule"):
        _decoder(peaked, pol, qp, "reference", dense_rule="timed")


def test_workspace_sized_once():
    """The first run sizes the workspace; later runs of the same shapes fit."""
    pytest.importorskip("triton")
    cache, ids, q, _ = random_case([64, 33], 2, 2, 16, 4, torch.float16, seed=2)
    dec = _decoder(cache, TopK(16), q, "triton")
    dec.plan_cache(cache, ids).run(q, cache.layer())
    size = dec._ws.nbytes
    assert size > 0
    assert dec.workspace_version == 1
    for _ in range(2):
        dec.plan_cache(cache, ids).run(q, cache.layer())
        assert dec._ws.nbytes == size and not dec._ws.grew and dec.workspace_version == 1
    dec.plan_cache(cache, ids).run(q, cache.layer(), return_stats=True)  # (bounds: more scratch)
    assert dec._ws.nbytes > size and dec.workspace_version == 2


def test_plan_and_run_validation():
    cache, ids, q, _ = random_case([20, 9], 2, 2, 16, 4, torch.float32, seed=0)
    dec = _decoder(cache, TopK(8), q, "reference")
    with pytest.raises(ValueError, match="run: no plan"):
        dec.run(q, cache.layer())
    bt, sl = cache.block_table, cache.seq_lens
    bad = [
        (lambda: dec.plan(bt.long(), sl), "block_table: expected an int32 tensor"),
        (lambda: dec.plan(bt, sl[:1]), "seq_lens: expected 2 entries"),
        (lambda: dec.plan(bt.t(), sl), "block_table: expected a contiguous tensor"),
        (lambda: dec.plan(bt, sl, [0, 9]), r"seq_ids: expected rows in 0..1, got 9"),
        (lambda: dec.plan(bt, sl, []), "seq_ids: expected at least one row"),
        (lambda: dec.plan(bt, sl, ["a"]), "seq_ids: expected a sequence of ints"),
        (lambda: dec.plan_cache(cache, [3]), "seq_ids: sequence 3 is not allocated"),
        (lambda: _decoder(cache, TopK(2), q, "reference"), "budget"),
        (lambda: Decoder(q_heads=3, kv_heads=2, head_dim=4, page_size=4), "q_heads: expected a multiple"),
        (lambda: Certified(dense_above=0), "Certified.dense_above"),
        (lambda: Certified(probe_every=0), "Certified.probe_every"),
        (lambda: Decoder(q_heads=2, kv_heads=2, head_dim=4, page_size=4, alibi_slopes=torch.ones(3)),
         r"alibi_slopes: expected a float tensor of shape \(2,\)"),
    ]
    for fn, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn()
    dec.plan_cache(cache, ids)
    with pytest.raises(ValueError, match=r"q: expected a tensor of shape \(2, 4, 16\)"):
        dec.run(q[:1], cache.layer())
    with pytest.raises(ValueError, match="out: expected a tensor of shape"):
        dec.run(q, cache.layer(), out=torch.empty(2, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="kv: expected a layout.PagedKV or a PagedKVCache"):
        dec.run(q, "kv")
    other = PagedKVCache(8, 8, 2, 16, max_seqs=1)
    with pytest.raises(ValueError, match="kv: expected kv_heads, head_dim, page_size = 2, 16, 4"):
        dec.run(q, other.layer())


# ------------------------------------------------------------- custom ops
def _op_case():
    cache, ids, q, sl = random_case([40, 21], 2, 2, 16, 4, torch.float32, seed=6, slopes=True)
    kv = _engine_copy(cache, ids, packed=False)
    return cache, ids, q, sl, kv


def test_custom_ops_opcheck():
    """torch.library.opcheck: schema (mutation declared), fake tensors,
    autograd registration and AOT dispatch of both ops."""
    cache, ids, q, sl, kv = _op_case()
    spec = ops.policy_spec(Certified(seed=TopK(8)))
    torch.library.opcheck(torch.ops.entmaxkv.decode.default,
                          (q, kv.k_pages, kv.v_pages, kv.k_bounds, kv.k_moments, kv.block_table, kv.seq_lens,
                           None, sl, spec, 1.5, 0.25))
    w = PagedKV.from_buffers(torch.zeros(6, 2, 4, 16), torch.zeros(6, 2, 4, 16))
    k = torch.randn(3, 2, 16)
    torch.library.opcheck(torch.ops.entmaxkv.write_kv.default,
                          (w.k_pages, w.v_pages, w.k_bounds, w.k_moments, w.welford, k, k, torch.tensor([4, 5, 9])))


def test_custom_ops_compile():
    """A step holding both ops compiles into one graph (aot_eager: no C
    compiler needed) and gives the eager result."""
    cache, ids, q, sl, kv = _op_case()
    spec = ops.policy_spec(TopK(8))
    w = PagedKV.from_buffers(torch.zeros(6, 2, 4, 16), torch.zeros(6, 2, 4, 16))
    k = torch.randn(2, 2, 16)

    def step(q, k):
        torch.ops.entmaxkv.write_kv(w.k_pages, w.v_pages, w.k_bounds, w.k_moments, w.welford, k, k * 2,
                                    torch.tensor([1, 5]))
        return torch.ops.entmaxkv.decode(q * 2, kv.k_pages, kv.v_pages, kv.k_bounds, kv.k_moments,
                                         kv.block_table, kv.seq_lens, None, sl, spec, 1.5, 0.25) + 1

    want = step(q, k)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k), want)
    assert torch.equal(w.k_pages[0, :, 1], k[0]) and torch.equal(w.v_pages[1, :, 1], 2 * k[1])


def test_policy_spec_round_trip():
    for pol in (Full(), TopK(64, sinks=1, window=2), Gaussian(q_max=0.9, margin=0.5, pooled=True),
                Certified(seed=Gaussian(), per_query_head=True), Certified(seed=TopK(64), alibi_seed=TopK(16))):
        assert ops.parse_policy(ops.policy_spec(pol)) == pol
    for bad in ("TopK(budget=__import__('os'))", "os.system('x')", "TopK(", "TopK(budget=0)"):
        with pytest.raises(ValueError, match="policy|budget"):
            ops.parse_policy(bad)


def test_alibi_decoder_slopes_checked_once():
    """Slopes are validated when the decoder is built (NaN refused)."""
    bad = alibi(4)
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="alibi_slopes: contains NaN"):
        Decoder(q_heads=4, kv_heads=2, head_dim=8, page_size=4, alibi_slopes=bad)
