"""The whole-model decode step on the GPU: graph replays against eager steps.

- ``generate`` with ``cuda_graph=True`` (one replayed graph per step) gives
  the eager steps' tokens and, to rounding, their logits, for every policy,
  on the NAPE entmax model and a RoPE softmax model, batch 3;
- certified gives Full's tokens, through its dense switch too; with
  graphs it times both forms and runs each, Full's logits throughout;
- after the first steps nothing is captured again and a replayed step
  allocates no device memory;
- prefill on the GPU (fused kernel / SDPA), one-shot and chunked, gives the
  reference prefill's logits;
- the fused elementwise kernels (entmaxkv/kernels/model.py, the default
  here) give the PyTorch step's logits, replayed, in float32 and bfloat16,
  and each kernel compiled at the Llama-8B sizes equals its torch form.

``python -m pytest -m gpu tests/gpu/test_model_step.py`` on the device.
"""
from __future__ import annotations

import pytest
import torch

from entmaxkv import PagedKVCache
from entmaxkv.model.generate import generate
from entmaxkv.kernels.model import add_rms_norm, rope_qk, silu_mul
from entmaxkv.model.lm import ModelConfig, RMSNorm, TransformerLM, rope_inv_freq, rope_rotate
from entmaxkv.model.step import ModelStep
from entmaxkv.policies import Certified, Full, Gaussian, TopK
from entmaxkv.testing import gpu_quick, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW = 16 if gpu_quick() else 48


def model(attention, positions, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=3, n_heads=8, n_kv_heads=4, d_ff=512,
                      attention=attention, positions=positions)
    m = TransformerLM(cfg).eval()
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.wq.weight.mul_(4.0)
            blk.attn.wk.weight.mul_(4.0)
    return m.to("cuda", dtype)


POLICIES = {"full": Full(), "topk": TopK(64), "gaussian": Gaussian(), "certified": Certified(seed=TopK(64))}


@pytest.mark.parametrize("kind", ["nape-entmax", "rope-softmax"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_graph_steps_equal_eager_steps(kind, name):
    positions, attention = kind.split("-")
    if attention == "softmax" and name in ("gaussian", "certified"):
        pytest.skip("entmax policies")
    m = model(attention, positions)
    prompt = torch.randint(0, 512, (3, 700), generator=torch.Generator().manual_seed(1))
    kw = dict(policy=POLICIES[name], page_size=16, keep_logits=True)
    graph = generate(m, prompt, NEW, cuda_graph=True, **kw)
    eager = generate(m, prompt, NEW, cuda_graph=False, **kw)
    assert torch.equal(graph.tokens, eager.tokens)
    assert rel_err(graph.logits, eager.logits) < 1e-5


def test_certified_equals_full_through_the_dense_switch():
    m = model("entmax", "nape")
    prompt = torch.randint(0, 512, (2, 900), generator=torch.Generator().manual_seed(2))
    full = generate(m, prompt, NEW, policy=Full(), page_size=16)
    for pol in (Certified(seed=TopK(64)), Certified(seed=TopK(64), dense_above=1e-6, probe_every=4)):
        assert torch.equal(generate(m, prompt, NEW, policy=pol, page_size=16).tokens, full.tokens)


def test_stop_token_on_cuda_reads_flags_late_and_trims():
    """Greedy generation with a stop token on CUDA (each step's flag read a
    step later): the rows equal the run without a stop up to their stop,
    repeat it after, and the generation ends at the step every row had
    stopped, not the step after."""
    m = model("entmax", "nape")
    prompt = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(7))
    free = generate(m, prompt, 24, policy=TopK(64), page_size=16).tokens
    stop = int(free[0, 3])
    first = [int((r == stop).nonzero()[0]) if (r == stop).any() else None for r in free]
    got = generate(m, prompt, 24, policy=TopK(64), page_size=16, stop_token=stop).tokens
    ends = [24 if f is None else f + 1 for f in first]
    assert got.shape[1] == max(ends)
    for b in range(2):
        assert torch.equal(got[b, :ends[b]], free[b, :ends[b]]) and (got[b, ends[b]:] == stop).all()


def test_certified_replays_time_both_forms_and_equal_full():
    """With graphs the certified step times its selection and its dense
    pass (CUDA events, read without waiting: the synchronisations here only
    make the order of the choices fixed) and runs both: the selection
    until it has a time, the dense pass until it has one (each timed from
    its second replay), then the faster with probes of the other
    (probe_every=4: two probes in the 18 steps left); both graphs
    are captured and every step's logits are Full's to rounding."""
    m = model("entmax", "nape")
    cfg = m.cfg
    prompt = torch.randint(0, 512, (2, 900), generator=torch.Generator().manual_seed(3)).cuda()
    toks = torch.randint(0, 512, (24, 2), generator=torch.Generator().manual_seed(4)).cuda()
    out, forms = {}, []
    for name, pol in (("full", Full()), ("certified", Certified(seed=TopK(64), probe_every=4))):
        cache = PagedKVCache(300, 16, cfg.n_kv_heads, cfg.head_dim, max_seqs=2, max_pages_per_seq=120,
                             device="cuda", num_layers=cfg.n_layers)
        seqs = [cache.allocate(), cache.allocate()]
        m.prefill_paged(prompt, cache, seqs)
        run = ModelStep(m, cache, pol)
        logits = []
        for t in toks:
            logits.append(run.step(t, seqs).clone())
            forms.append(run.last_dense)
            torch.cuda.synchronize()
        out[name] = torch.stack(logits)
    forms = forms[len(toks):]  # the certified steps'
    assert run.graphs() == [(2, False), (2, True)]
    # the switch decides: no layer computed or read back its kept fraction
    assert run.decoder.dense_rule == "caller" and run.decoder._cert == {}
    # warm-up, capture (and its replay, not timed), a timed replay; the dense pass likewise
    assert forms[:6] == [False, False, False, True, True, True]
    # probes are due 4 and 8 steps after the first choice by time (then 16)
    later = forms[6:]
    assert min(later.count(True), later.count(False)) >= 2
    assert rel_err(out["certified"], out["full"]) < 1e-5


def test_replays_capture_once_and_allocate_nothing():
    m = model("entmax", "nape", torch.bfloat16)
    cfg = m.cfg
    cache = PagedKVCache(400, 16, cfg.n_kv_heads, cfg.head_dim, max_seqs=2, max_pages_per_seq=200,
                         dtype=torch.bfloat16, device="cuda", num_layers=cfg.n_layers)
    seqs = [cache.allocate(), cache.allocate()]
    m.prefill_paged(torch.randint(0, 512, (2, 500), device="cuda"), cache, seqs)
    run = ModelStep(m, cache, TopK(64))
    tok = torch.zeros(2, dtype=torch.long, device="cuda")
    for _ in range(3):
        run.step(tok, seqs)
    assert run.graphs() == [(2, False)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(40):  # crosses page boundaries: new pages come from reserve, on the host
        run.step(tok, seqs)
    torch.cuda.synchronize()
    # the host half's small index tensors only (an eager step allocates dozens per layer)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before <= 40 * 8
    assert run.graphs() == [(2, False)]


def _graph_and_eager(policy, rows: int, seed: int):
    """Two ModelSteps of the bfloat16 NAPE entmax model with ``policy``, on
    two caches prefilled alike (rows 0 .. rows-1, 300 tokens each): with
    CUDA graphs, and eager."""
    m = model("entmax", "nape", torch.bfloat16)
    cfg = m.cfg
    prompt = torch.randint(0, 512, (rows, 300), generator=torch.Generator().manual_seed(seed)).cuda()
    runs = []
    for graph in (True, False):
        cache = PagedKVCache(400, 16, cfg.n_kv_heads, cfg.head_dim, max_seqs=rows, max_pages_per_seq=120,
                             dtype=torch.bfloat16, device="cuda", num_layers=cfg.n_layers)
        m.prefill_paged(prompt, cache, [cache.allocate() for _ in range(rows)])
        runs.append(ModelStep(m, cache, policy, cuda_graph=graph))
    return runs


def test_graphs_follow_the_plan_across_batch_sizes():
    """A batch of 1, then 3 (the decoder's row-id buffer grows, so the graph
    of the batch of 1 reads a freed buffer), then 1 again: the graph of the
    batch of 1 is captured again under the new plan, and every step's
    logits equal eager steps' on a copy of the cache."""
    runs = _graph_and_eager(TopK(64), rows=3, seed=2)
    for batch in ([0], [0], [0], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0], [0], [0]):
        tok = torch.full((len(batch),), 7, dtype=torch.long, device="cuda")
        got, want = (run.step(tok, batch).clone() for run in runs)
        assert rel_err(got.float(), want.float()) < 1e-6
    assert runs[0].graphs() == [(1, False), (3, False)]


def test_graphs_follow_the_workspace_after_a_step_with_statistics():
    """A step with statistics runs eagerly and asks the decoder's scratch
    for more (the bounds it reports), which replaces the arena the graph
    was captured over. The graph is captured again rather than replayed
    over freed memory: every step's logits equal eager steps' on a copy of
    the cache, before and after."""
    runs = _graph_and_eager(Full(), rows=2, seed=3)
    seqs = [0, 1]
    tok = torch.full((2,), 5, dtype=torch.long, device="cuda")
    versions = []
    for stats in (False, False, False, True, False, False):
        versions.append(runs[0].decoder.workspace_version)
        if stats:
            (got, _), (want, _) = (run.step(tok, seqs, return_stats=True) for run in runs)
        else:
            got, want = (run.step(tok, seqs).clone() for run in runs)
        assert rel_err(got.float(), want.float()) < 1e-6
    assert versions[4] > versions[3]  # the statistics step replaced the arena
    assert runs[0].graphs() == [(2, False)]


def test_graph_captured_again_under_the_profiler():
    """The benchmark's order: graph steps, a step with statistics (the
    arena is replaced, the only graph dropped), then steps under
    torch.profiler while the old graph's output is still held. The graph
    is captured again (in a new pool: the allocator refuses to reopen one
    whose graphs were all dropped) and equals eager steps."""
    from torch.profiler import ProfilerActivity, profile

    runs = _graph_and_eager(Full(), rows=2, seed=5)
    seqs = [0, 1]
    tok = torch.full((2,), 7, dtype=torch.long, device="cuda")
    held = [run.step(tok, seqs) for run in runs for _ in range(3)]
    for run in runs:
        run.step(tok, seqs, return_stats=True)
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(2):
            got, want = (run.step(tok, seqs).clone() for run in runs)
            assert rel_err(got.float(), want.float()) < 1e-6
    assert runs[0].graphs() == [(2, False)] and len(held) == 6


@pytest.mark.parametrize("kind", ["nape-entmax", "rope-softmax", "nape-softmax"])
def test_gpu_prefill_equals_reference(kind):
    positions, attention = kind.split("-")
    m = model(attention, positions)
    prompt = torch.randint(0, 512, (2, 1500), generator=torch.Generator().manual_seed(3)).cuda()
    ref = m.prefill_logits(prompt, tail=1, chunk=256)  # (fused on CUDA) against the CPU reference below
    cpu = m.to("cpu").prefill_logits(prompt.cpu(), tail=1, chunk=256)
    m = m.to("cuda")
    assert rel_err(ref[:, 0].cpu(), cpu[:, 0]) < 1e-4
    for chunk in (None, 512):
        cache = PagedKVCache(400, 16, m.cfg.n_kv_heads, m.cfg.head_dim, max_seqs=2, max_pages_per_seq=200,
                             dtype=torch.float32, device="cuda", num_layers=m.cfg.n_layers)
        seqs = [cache.allocate(), cache.allocate()]
        got = m.prefill_paged(prompt, cache, seqs, chunk_tokens=chunk)
        assert rel_err(got.cpu(), cpu[:, 0]) < 1e-4


@pytest.mark.parametrize("kind", ["rope-softmax", "nape-entmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_the_unfused_step(kind, dtype):
    positions, attention = kind.split("-")
    m = model(attention, positions, dtype)
    with torch.no_grad():
        for n in [m.norm, *(b.attn_norm for b in m.blocks), *(b.mlp_norm for b in m.blocks)]:
            n.weight.copy_(1.0 + 0.5 * torch.randn(m.cfg.d_model, device="cuda"))
    prompt = torch.randint(0, 512, (3, 300), generator=torch.Generator().manual_seed(5)).cuda()
    toks = torch.randint(0, 512, (8, 3), generator=torch.Generator().manual_seed(6)).cuda()  # teacher forced
    out = {}
    for fused in (True, False):
        cache = PagedKVCache(200, 16, m.cfg.n_kv_heads, m.cfg.head_dim, max_seqs=3, max_pages_per_seq=60,
                             dtype=dtype, device="cuda", num_layers=m.cfg.n_layers)
        seqs = [cache.allocate() for _ in range(3)]
        m.prefill_paged(prompt, cache, seqs)
        run = ModelStep(m, cache, Full(), fused=None if fused else False)
        assert run.fused == fused
        out[fused] = torch.stack([run.step(t, seqs).clone() for t in toks]).float()
        assert run.graphs() == [(3, False)]  # the later steps replayed
    assert rel_err(out[True], out[False]) < (1e-5 if dtype == torch.float32 else 3e-2)


def test_model_kernels_at_the_llama8b_sizes():
    gen = torch.Generator(device="cuda").manual_seed(7)
    dt = torch.bfloat16
    ulp = 2.0 ** -7

    def close(got, want, ulps=1.0):
        g, w = got.double(), want.double()
        return bool(((g - w).abs() <= 1e-6 + ulps * ulp * w.abs()).all())

    x, d = (torch.randn(5, 1, 4096, generator=gen, device="cuda").to(dt) for _ in range(2))
    norm = RMSNorm(4096, 1e-5).cuda().to(dt)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(4096, generator=gen, device="cuda"))
        y, r = add_rms_norm(x, d, norm.weight, 1e-5)
        assert torch.equal(r, x + d) and close(y, norm(x + d))
        g, u = (torch.randn(5, 1, 14336, generator=gen, device="cuda").to(dt) * 3 for _ in range(2))
        assert close(silu_mul(g, u), torch.nn.functional.silu(g) * u, ulps=2)
        qkv = torch.randn(5, 1, 48, 128, generator=gen, device="cuda").to(dt)
        q, k = qkv[:, :, :32], qkv[:, :, 32:40]
        pos = torch.randint(0, 131072, (5, 1), generator=gen, device="cuda")
        qo, ko = rope_qk(q, k, pos, rope_inv_freq(128, 500000.0, "cuda"))
        assert close(qo, rope_rotate(q, pos, 500000.0)) and close(ko, rope_rotate(k, pos, 500000.0))
