"""ModelStep (the whole decode step from static buffers; graphs off here) and
prefill_paged, against the per-layer eager path and the full forward."""
from __future__ import annotations

import pytest
import torch

from entmaxkv import CacheFullError, PagedKVCache
from entmaxkv.model.generate import Stops, generate
from entmaxkv.model.lm import ModelConfig, TransformerLM, causal_attention
from entmaxkv.model.step import ModelStep
from entmaxkv.policies import Certified, Full, Gaussian, TopK
from entmaxkv.prefill import gather_row
from entmaxkv.testing import assert_same_state, cache_state


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def tiny(attention="entmax", positions="nape", seed=0, sharpen=6.0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      attention=attention, positions=positions)
    m = TransformerLM(cfg).eval()
    with torch.no_grad():  # peaky attention: small entmax supports, selections that matter
        for blk in m.blocks:
            blk.attn.wq.weight.mul_(sharpen)
            blk.attn.wk.weight.mul_(sharpen)
    return m


def paged(m, B=2, pages=40, P=4):
    cfg = m.cfg
    return PagedKVCache(pages * B, P, cfg.n_kv_heads, cfg.head_dim, max_seqs=B, max_pages_per_seq=pages,
                        dtype=torch.float32, num_layers=cfg.n_layers)


POLICIES = {
    "full": Full(), "topk": TopK(8), "gaussian": Gaussian(q_max=0.9),
    "certified": Certified(seed=TopK(8)),
}


@pytest.mark.parametrize("model", ["nape-entmax", "rope-softmax"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_step_path_equals_the_per_layer_path(model, name):
    """generate() through ModelStep (graphs off) gives the per-layer eager
    path's tokens and logits, for every policy (greedy, 2 rows)."""
    attention, positions = model.split("-")[1], model.split("-")[0]
    if attention == "softmax" and name in ("gaussian", "certified"):
        pytest.skip("entmax policies")
    m = tiny(attention, positions)
    prompt = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(3))
    kw = dict(policy=POLICIES[name], page_size=4, keep_logits=True)
    step = generate(m, prompt, 10, **kw)
    eager = generate(m, prompt, 10, return_stats=True, **kw)
    assert torch.equal(step.tokens, eager.tokens)
    assert rel(step.logits, eager.logits) < 1e-5


def test_rows_of_different_lengths_equal_the_full_forward():
    """Two sequences prefilled to different lengths, then stepped together
    with Full: each row's logits are the full forward's last position."""
    m = tiny()
    cache = paged(m)
    seqs = [cache.allocate(), cache.allocate()]
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 96, (n,), generator=gen) for n in (23, 9)]
    for s, r in zip(seqs, rows):
        m.prefill_paged(r[None], cache, [s])
    run = ModelStep(m, cache, Full())
    for _ in range(6):
        nxt = torch.randint(0, 96, (2,), generator=gen)
        logits = run.step(nxt, seqs).clone()
        rows = [torch.cat([r, t[None]]) for r, t in zip(rows, nxt)]
        for b, r in enumerate(rows):
            assert rel(logits[b], m(r[None])[0, -1]) < 1e-5
    assert [cache.length(s) for s in seqs] == [29, 15]
    assert run.graphs() == []  # no capture off CUDA
    logits, stats = run.step(torch.zeros(2, dtype=torch.long), seqs, return_stats=True)
    assert len(stats) == m.cfg.n_layers and stats[0].tokens_read.tolist() == [[30] * 4, [16] * 4]


def test_stop_token_fills_finished_rows():
    """A row that produced the stop token repeats it while the other row
    goes on unchanged; generation ends once every row has stopped."""
    m = tiny()
    prompt = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(4))
    kw = dict(policy=TopK(8), page_size=4, temperature=1.0, seed=2)  # sampled: rows that vary
    free = generate(m, prompt, 12, **kw).tokens
    stop = int(free[0, 3])
    first = [int((r == stop).nonzero()[0]) if (r == stop).any() else None for r in free]
    got = generate(m, prompt, 12, stop_token=stop, **kw).tokens
    ends = [12 if f is None else f + 1 for f in first]
    assert got.shape[1] == max(ends)
    for b in range(2):
        n = min(ends[b], got.shape[1])
        assert torch.equal(got[b, :n], free[b, :n])
        assert (got[b, n:] == stop).all()
    assert first[0] <= 3 and (got[0, first[0]:] == stop).all()


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_stop_flags_read_late_keep_the_steps_up_to_the_stop(lag):
    """Stops reads each step's flag ``lag`` steps late (generate uses 1 on
    CUDA): the loop runs ``lag`` steps past the first all-stopped step and
    ``kept`` trims them; flags left unread when the loop ends are read by
    ``kept``; with no stop every step is kept."""
    cpu = torch.device("cpu")
    stops, ran = Stops(cpu, lag), 0
    for flag in [False, False, True, True, True, True]:
        ran += 1
        if stops.add(torch.tensor(flag)):
            break
    assert ran == 3 + lag and stops.kept() == 3
    late = Stops(cpu, lag)
    stopped = [late.add(torch.tensor(f)) for f in [False, False, False, True]]
    assert stopped == [False] * 3 + [lag == 0] and late.kept() == 4
    never = Stops(cpu, lag)
    assert not any(never.add(torch.tensor(False)) for _ in range(5)) and never.kept() is None


@pytest.mark.parametrize("attention", ["entmax", "softmax"])
def test_chunked_prefill_equals_one_shot(attention):
    """Any chunking of a prompt gives the same cache and logits."""
    m = tiny(attention)
    prompt = torch.randint(0, 96, (2, 41), generator=torch.Generator().manual_seed(8))
    def contents(cache, seqs):
        """Per layer and sequence: its tokens' K, V and its logical pages' statistics."""
        out = []
        for i in range(m.cfg.n_layers):
            lay = cache.layer(i)
            for s in seqs:
                pages = cache.page_ids(s).long()
                out += [*gather_row(lay, pages, cache.length(s)), lay.k_bounds[pages], lay.k_moments[pages]]
        return out

    ref = m(prompt)[:, -1]
    first = None
    for chunk in (None, 7, 16, 1):
        cache = paged(m)
        seqs = [cache.allocate(), cache.allocate()]
        logits = m.prefill_paged(prompt, cache, seqs, chunk_tokens=chunk)
        assert rel(logits, ref) < 1e-5
        got = contents(cache, seqs)
        first = first or got
        for a, b in zip(got, first):
            assert rel(a, b) < 1e-5


def test_causal_attention_with_cached_context():
    """Queries that are the last Tq of Tk positions equal the last rows of a full pass."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 29, 8, generator=gen, dtype=torch.float64) * 2 for h in (4, 2, 2))
    slopes = torch.tensor([0.5, 0.25, 0.0, 0.0])
    for alpha in (1.0, 1.5):
        full = causal_attention(q, k, v, alpha=alpha, scale=0.4, slopes=slopes)
        part = causal_attention(q[:, :, 20:], k, v, alpha=alpha, scale=0.4, slopes=slopes, chunk=3)
        assert rel(part, full[:, :, 20:]) < 1e-6  # (entmax scores are float32 inside)


def test_certified_switches_to_the_dense_pass():
    """With dense_above ~0 every certified step after the first runs the
    dense pass (probing every 3 steps); the tokens stay Full's."""
    m = tiny()
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    pol = Certified(seed=TopK(8), dense_above=1e-6, probe_every=3)
    cert = generate(m, prompt, 8, policy=pol, page_size=4)
    full = generate(m, prompt, 8, policy=Full(), page_size=4)
    assert torch.equal(cert.tokens, full.tokens)
    cache = paged(m)
    seqs = [cache.allocate(), cache.allocate()]
    m.prefill_paged(prompt, cache, seqs)
    run = ModelStep(m, cache, pol)
    modes = []
    for _ in range(8):
        run.step(torch.zeros(2, dtype=torch.long), seqs)
        modes.append(run.last_dense)
    # the selection first, then dense steps, the selection probed again every third step
    assert modes == [False, True, True, False, True, True, False, True]


def test_full_cache_refused_and_left_intact():
    m = tiny()
    cache = PagedKVCache(3, 4, 2, 16, max_seqs=1, max_pages_per_seq=3, dtype=torch.float32, num_layers=2)
    s = cache.allocate()
    m.prefill_paged(torch.randint(0, 96, (1, 12)), cache, [s])
    run = ModelStep(m, cache, TopK(8))
    before = cache_state(cache)
    with pytest.raises(CacheFullError):
        run.step(torch.zeros(1, dtype=torch.long), [s])
    assert_same_state(cache_state(cache), before)


def test_validation():
    m = tiny()
    cache = paged(m)
    s = cache.allocate()
    with pytest.raises(ValueError, match="model:"):
        ModelStep(object(), cache)
    with pytest.raises(ValueError, match="cache:"):
        ModelStep(m, PagedKVCache(8, 4, 2, 16, max_seqs=1, max_pages_per_seq=8))  # one layer
    with pytest.raises(ValueError, match="cache:"):
        ModelStep(m, object())
    with pytest.raises(ValueError, match="budget"):
        ModelStep(m, cache, TopK(2))  # below the page size
    with pytest.raises(ValueError, match="cuda_graph"):
        ModelStep(m, cache, cuda_graph="yes")
    m.prefill_paged(torch.randint(0, 96, (1, 5)), cache, [s])
    run = ModelStep(m, cache)
    with pytest.raises(ValueError, match="tokens:"):
        run.step(torch.zeros(2, dtype=torch.long), [s])
    with pytest.raises(ValueError, match="tokens:"):
        run.step(torch.zeros(1), [s])
    with pytest.raises(ValueError, match="seqs"):
        m.prefill_paged(torch.zeros(2, 3, dtype=torch.long), cache, [s])


def test_llama8b_shape():
    cfg = ModelConfig.llama8b_shape()
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size) == (
        32, 32, 8, 128, 14336, 128256)
    assert cfg.positions == "rope" and ModelConfig.llama8b_shape(attention="softmax").attn_alpha == 1.0
    with torch.device("meta"):
        m = TransformerLM(cfg)
    # what a decode step reads: every weight but the embedding rows it gathers (tied output head read once)
    assert round(m.num_parameters() / 1e9, 2) == 7.50
