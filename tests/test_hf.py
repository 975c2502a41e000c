"""transformers' generate() with an EntmaxKVCache on tiny random stock models
(Llama, Qwen2, Qwen3, Mistral; built offline from configs, float32)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, MistralConfig  # noqa: E402

import entmaxkv.hf as H  # noqa: E402
from entmaxkv import CacheFullError, Certified, Full, TopK  # noqa: E402
from entmaxkv.hf.testing import MODELS, SMALL, generate as _generate, register_dense, tiny_model  # noqa: E402

H.register()
register_dense()
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def _model(name, seed=0):
    return tiny_model(name, seed)


def _prompt(seed=1, batch=3, T=21, pad=(0, 6, 11)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, T), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate(pad[:batch]):
        mask[b, :n] = 0  # left padding
    return ids, mask


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(MODELS))
def test_softmax_full_equals_hf_eager(name):
    """alpha = 1, Full: the tokens and logits of HF's own eager attention,
    on a left-padded batch."""
    model = _model(name)
    ids, mask = _prompt()
    want, want_s = _generate(model, "eager", ids, mask)
    cache = H.EntmaxKVCache(model, policy=Full(), alpha=1.0, page_size=4, max_len=64)
    got, got_s = _generate(model, "entmaxkv", ids, mask, cache)
    assert torch.equal(got, want)
    assert _rel(got_s, want_s) < 1e-4
    # pads never entered the cache: each row holds its real tokens and the new ones
    assert [cache.paged.length(s) for s in cache.slots] == [21 + 7, 15 + 7, 10 + 7]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", [Full(), Certified(seed=TopK(8), dense_above=1.0)], ids=["full", "certified"])
def test_entmax_equals_dense_reference(name, policy):
    """alpha = 1.5 (from the config): Full and Certified give a dense entmax
    attention's tokens and logits (the prompt too is entmax)."""
    model = _model(name, seed=3)
    model.config.entmax_alpha = 1.5
    ids, mask = _prompt(seed=4)
    want, want_s = _generate(model, "entmax_dense", ids, mask)
    cache = H.EntmaxKVCache(model, policy=policy, page_size=4, max_len=64)
    assert cache.alpha == 1.5
    got, got_s = _generate(model, "entmaxkv", ids, mask, cache)
    assert torch.equal(got, want)
    assert _rel(got_s, want_s) < 1e-4


def test_padded_batch_equals_rows_alone():
    model = _model("llama", seed=5)
    ids, mask = _prompt(seed=6)
    batch, _ = _generate(model, "entmaxkv", ids, mask, H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64))
    for b, pad in enumerate((0, 6, 11)):
        row = ids[b:b + 1, pad:]
        alone, _ = _generate(model, "entmaxkv", row, torch.ones_like(row),
                             H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64))
        assert torch.equal(alone[0], batch[b]), b


def test_reset_reuses_the_paged_cache():
    """After ``reset`` a cache generates what a fresh one does, in the same
    paged cache and decoder (their tensors, so captured graphs stay valid);
    a larger batch after a reset gets a new paged cache."""
    model = _model("llama", seed=9)
    cache = H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64)
    held, free_after = [], None
    for seed in (10, 11):
        ids, mask = _prompt(seed=seed, batch=2, pad=(0, 5))
        want, want_s = _generate(model, "entmaxkv", ids, mask,
                                 H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64))
        cache.reset()
        got, got_s = _generate(model, "entmaxkv", ids, mask, cache)
        assert torch.equal(got, want)
        assert _rel(got_s, want_s) < 1e-6
        held.append((cache.paged, cache._decoder))
        if free_after is None:
            free_after = cache.paged.free_pages
        assert cache.paged.free_pages == free_after  # the rows' pages came back and were taken again
    assert held[0][0] is held[1][0] and held[0][1] is held[1][1]
    cache.reset()
    assert cache.paged.free_pages == cache.paged.num_pages
    ids, mask = _prompt(seed=12, batch=3)
    got, _ = _generate(model, "entmaxkv", ids, mask, cache)
    assert cache.paged is not held[0][0] and len(cache.slots) == 3
    want, _ = _generate(model, "entmaxkv", ids, mask, H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64))
    assert torch.equal(got, want)


def test_chunked_prefill_equals_one_shot():
    """A prompt fed in two chunks (the second over cached context) gives the
    one-shot logits, and the same next token through the decode path."""
    model = _model("qwen2", seed=7)
    model.set_attn_implementation("entmaxkv")
    ids, mask = _prompt(seed=8, batch=2, pad=(0, 4))
    with torch.no_grad():
        one = H.EntmaxKVCache(model, page_size=4, max_len=64)
        full = model(ids, attention_mask=mask, past_key_values=one).logits[:, -1]
        two = H.EntmaxKVCache(model, page_size=4, max_len=64)
        model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=two)
        last = model(ids[:, 9:], attention_mask=mask, past_key_values=two).logits[:, -1]
        assert _rel(last, full) < 1e-5
        nxt = full.argmax(-1, keepdim=True)
        step_mask = torch.cat((mask, torch.ones_like(nxt)), 1)
        a = model(nxt, attention_mask=step_mask, past_key_values=one).logits[:, -1]
        b = model(nxt, attention_mask=step_mask, past_key_values=two).logits[:, -1]
    assert _rel(a, b) < 1e-5
    assert [one.paged.length(s) for s in one.slots] == [two.paged.length(s) for s in two.slots] == [22, 18]


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_prefill_in_query_chunks(alpha):
    """A prompt attended in query chunks (a small prefill_scores) gives the
    one-block logits (the dense prefill never holds T x T scores)."""
    model = _model("llama", seed=12)
    model.config.entmax_alpha = alpha
    model.set_attn_implementation("entmaxkv")
    ids, mask = _prompt(seed=13, batch=2, pad=(0, 5))
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, past_key_values=H.EntmaxKVCache(model, page_size=4)).logits
        parts = model(ids, attention_mask=mask,
                      past_key_values=H.EntmaxKVCache(model, page_size=4, prefill_scores=200)).logits
    real = mask.bool()
    assert _rel(parts[real], whole[real]) < 1e-5


def test_sampling_matches_eager():
    model = _model("mistral", seed=9)
    ids, mask = _prompt(seed=10, batch=2)
    outs = []
    for impl, cache in (("eager", None), ("entmaxkv", H.EntmaxKVCache(model, alpha=1.0, page_size=4, max_len=64))):
        model.set_attn_implementation(impl)
        torch.manual_seed(11)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=10,
                                   past_key_values=cache, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def _compile_config(backend, fullgraph=True):
    from transformers import CompileConfig

    cfg = CompileConfig(backend=backend, mode=None, fullgraph=fullgraph)
    cfg._compile_all_devices = True  # (transformers compiles on the GPU only unless told)
    return cfg


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_decode_equals_eager(backend):
    """transformers compiles the decode step of an EntmaxKVCache model (a
    compileable cache; dynamo's "eager" backend, and "aot_eager", which
    traces the custom op's fake, on the CPU) with fullgraph=True: each
    layer's decode is one traced op, no graph break. The tokens and scores
    are the uncompiled generate's, the compileable cache run uncompiled
    (armed after the prefill, disarmed by the first eager step) gives them
    too, and later tokens reuse the graphs (none is traced per token)."""
    from torch._dynamo.utils import counters

    model = _model("qwen2", seed=12)
    ids, mask = _prompt(seed=13, batch=2)
    want, ws = _generate(model, "entmaxkv", ids, mask, H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5,
                                                                        page_size=4, max_len=64), n=10)
    assert not H.EntmaxKVCache(model).is_compileable  # (the default: generate runs the model eagerly)
    cache = H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5, page_size=4, max_len=64, compileable=True)
    assert cache.is_compileable
    got, gs = _generate(model, "entmaxkv", ids, mask, cache, n=10)  # uncompiled
    assert torch.equal(got, want) and _rel(gs, ws) < 1e-6
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for n in (4, 10):
        cache.reset()
        got, gs = _generate(model, "entmaxkv", ids, mask, cache, n=n, compile_config=_compile_config(backend),
                            disable_compile=False)
        assert torch.equal(got, want[:, :n]) and _rel(gs, ws[:, :n]) < 1e-6
        graphs.append(counters["stats"]["unique_graphs"])
        lens = cache.paged.seq_lens[torch.tensor(cache.slots)]
        assert lens.tolist() == [int(r) + n - 1 for r in mask.sum(1)]  # (the device lengths: prompt + decoded)
    assert hasattr(model, "_compiled_call") and 0 < graphs[0] == graphs[1] and not counters["graph_break"]


def test_compiled_decode_follows_moved_tensors():
    """A compiled step's CUDA graphs replay the addresses they were
    captured with, and the decode op is opaque to them. From one generate
    to the next (reset, prefill, arm) every address the op reads stays, so
    the layout keeps its name and nothing is traced again. A larger batch
    builds a new paged cache: the layout is renamed, the step is traced
    again, and the tokens are the uncompiled ones, also back at the first
    batch size. The op called under a stale layout raises."""
    from torch._dynamo.utils import counters

    model = _model("qwen2", seed=12)
    prompts = {2: _prompt(seed=13, batch=2), 3: _prompt(seed=14, batch=3)}
    want = {b: _generate(model, "entmaxkv", ids, mask, H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5,
                                                                        page_size=4, max_len=64), n=6)[0]
            for b, (ids, mask) in prompts.items()}
    cache = H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5, page_size=4, max_len=64, compileable=True)
    torch._dynamo.reset()
    counters.clear()
    kw = dict(compile_config=_compile_config("eager"), disable_compile=False)
    seen = []
    for b in (2, 2, 3, 2):
        cache.reset()
        got, _ = _generate(model, "entmaxkv", *prompts[b], cache, n=6, **kw)
        assert torch.equal(got, want[b])
        seen.append((cache._layout, cache._rows.data_ptr(), counters["stats"]["unique_graphs"]))
    assert seen[1] == seen[0]  # same addresses, same name, no new trace
    assert seen[2][0] != seen[1][0] and seen[2][2] > seen[1][2]  # a new paged cache: renamed, traced again
    assert seen[3][0] not in (seen[0][0], seen[2][0])
    q = torch.zeros(2, cache.q_heads, cache.head_dim)
    k = torch.zeros(2, cache.kv_heads, cache.head_dim)
    with pytest.raises(ValueError, match="layout"):
        torch.ops.entmaxkv.hf_decode_layer(q, k, k, torch.ones(2, dtype=torch.bool), cache._handle, 0, seen[0][0])


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_decode_has_no_per_step_numbers(batch):
    """transformers' compiled generate over an armed cache traces the
    decode step once, and the traced graph takes no integer input: the
    count of positions lives on the device while armed, so nothing changes
    from step to step that CUDA graphs would be recorded again for. The
    host reads the count back (get_seq_length while armed, and after the
    cache is disarmed) equal to the positions processed."""
    model = _model("llama", seed=4)
    ids, mask = _prompt(seed=6, batch=batch, T=15, pad=(0, 5))
    traced, calls = [], []

    def backend(gm, example_inputs):
        traced.append([type(x).__name__ for x in example_inputs])

        def run(*args):
            calls.append(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
            return gm(*args)
        return run

    cfg = _compile_config(backend)
    want, _ = _generate(model, "entmaxkv", ids, mask, H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5, page_size=4,
                                                                      max_len=64), n=6)
    cache = H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5, page_size=4, max_len=64, compileable=True)
    torch._dynamo.reset()
    got, _ = _generate(model, "entmaxkv", ids, mask, cache, n=6, compile_config=cfg, disable_compile=False)
    assert torch.equal(got, want)
    assert len(traced) == 1 and all(t in ("Tensor", "Parameter") for t in traced[0])  # one trace, no numbers
    assert len(calls) == 5 and len(set(calls)) == 1  # every decode step the same inputs
    assert cache._armed and cache.get_seq_length() == 15 + 5 == cache.layers[1].get_seq_length()
    cache._disarm()
    assert [layer.seen for layer in cache.layers] == [20] * cache.num_layers
    assert [cache.paged.length(s) for s in cache.slots] == [15 + 5, 10 + 5][:batch]


def test_mask_reads_the_new_positions_at_the_offset():
    """The "entmaxkv" mask takes the new positions' flags at the query
    offset, given as an int or (inside a compiled step) as a device
    tensor, and counts positions past the given mask as real. Its strides
    are the standard ones (transformers 5.17 passes it to the compiled
    step as is)."""
    from entmaxkv.hf.attention import entmaxkv_mask

    g = torch.Generator().manual_seed(7)
    for B in (3, 1):
        m = torch.randint(0, 2, (B, 11), generator=g)
        for off, q in ((0, 1), (4, 3), (10, 1), (9, 4), (11, 2), (15, 1)):
            want = torch.ones(B, q, dtype=torch.bool)
            have = m[:, off:off + q].bool()
            want[:, :have.shape[1]] = have
            for offset in (off, torch.tensor(off)):
                got = entmaxkv_mask(B, q, 99, q_offset=offset, attention_mask=m)
                assert got.shape == (B, 1, q, 1) and torch.equal(got[:, 0, :, 0], want), (off, q, type(offset))
                # standard strides (ones that follow the mask's length would retrace compiled steps)
                assert got.stride() == torch.empty(got.shape).stride()


def test_compiled_decode_padding_rows():
    """A decode step whose new position is padding for one row (a forward
    call, compiled with fullgraph=True over an armed cache) writes nothing
    for that row and gives it zeros from attention, as the eager path does:
    the logits of that step and of the steps after it are the eager ones,
    and the device lengths count only real tokens."""
    model = _model("llama", seed=3)
    model.set_attn_implementation("entmaxkv")
    ids, mask = _prompt(seed=5, batch=2, T=13, pad=(0, 4))

    def run(cache, step):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            tok, m, res = out.logits[:, -1].argmax(-1, keepdim=True), mask, []
            for real in ([1, 0], [1, 1], [0, 1]):
                m = torch.cat([m, torch.tensor(real)[:, None]], 1)
                pos = (m.cumsum(-1) - 1).clamp(min=0)[:, -1:]
                lg = step(input_ids=tok, attention_mask=m, past_key_values=cache, position_ids=pos,
                          use_cache=True).logits
                res.append(lg.clone())
                tok = lg[:, -1].argmax(-1, keepdim=True)
        return torch.stack(res)

    want = run(H.EntmaxKVCache(model, policy=Full(), alpha=1.5, page_size=4, max_len=64), model.forward)
    cache = H.EntmaxKVCache(model, policy=Full(), alpha=1.5, page_size=4, max_len=64, compileable=True)
    torch._dynamo.reset()
    got = run(cache, torch.compile(model.forward, backend="aot_eager", fullgraph=True))
    assert cache._armed and _rel(got, want) < 1e-6
    assert cache.paged.seq_lens[torch.tensor(cache.slots)].tolist() == [13 + 2, 9 + 2]
    cache._disarm()  # the host takes the device lengths back and frees the pages reserved past them
    assert [cache.paged.length(s) for s in cache.slots] == [15, 11]
    assert cache.paged.free_pages == cache.paged.num_pages - 4 - 3


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_compileable_cache_refuses_past_max_len(compiled):
    """A compileable cache decodes up to max_len tokens per row and then
    raises CacheFullError, compiled (the armed step's count) or not (the
    paged cache's reserve), and serves the next generate after a reset."""
    model = _model("qwen2", seed=12)
    ids, mask = _prompt(seed=13, batch=2)  # 21 real tokens in row 0
    cache = H.EntmaxKVCache(model, policy=TopK(8), alpha=1.5, page_size=4, max_len=24, compileable=True)
    kw = dict(compile_config=_compile_config("eager", fullgraph=False), disable_compile=not compiled)
    torch._dynamo.reset()
    first, _ = _generate(model, "entmaxkv", ids, mask, cache, n=4, **kw)  # 21 + 3 written
    cache.reset()
    with pytest.raises(CacheFullError, match="max_len=24|max_pages_per_seq=6"):
        _generate(model, "entmaxkv", ids, mask, cache, n=5, **kw)
    cache.reset()
    again, _ = _generate(model, "entmaxkv", ids, mask, cache, n=4, **kw)
    assert torch.equal(first, again)


def test_compiled_forward_stops_past_max_len_changing_nothing():
    """A compiled forward called directly over an armed cache (the mask
    built inside the step, so no host check runs first) stops at the step
    that would take a row past max_len, with an error naming max_len, and
    leaves the device lengths and the count of positions as they were."""
    model = _model("llama", seed=8)
    model.set_attn_implementation("entmaxkv")
    ids, mask = _prompt(seed=9, batch=2, T=10, pad=(0, 3))
    cache = H.EntmaxKVCache(model, policy=Full(), alpha=1.5, page_size=4, max_len=12, compileable=True)
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tok, m = out.logits[:, -1].argmax(-1, keepdim=True), mask
        rows = torch.tensor(cache.slots)
        for i in range(3):
            m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
            pos = (m.cumsum(-1) - 1)[:, -1:]
            before = (cache.paged.seq_lens[rows].clone(), cache._seen_dev.clone())
            if i < 2:  # row 0 holds 10 real tokens: room for 2
                tok = step(input_ids=tok, attention_mask=m, past_key_values=cache, position_ids=pos,
                           use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                continue
            with pytest.raises(RuntimeError, match="max_len=12"):
                step(input_ids=tok, attention_mask=m, past_key_values=cache, position_ids=pos, use_cache=True)
            assert torch.equal(cache.paged.seq_lens[rows], before[0]) and torch.equal(cache._seen_dev, before[1])
    assert cache.paged.seq_lens[rows].tolist() == [12, 9] and cache.get_seq_length() == 12


def test_refusals():
    model = _model("llama")
    ids, mask = _prompt(batch=2)
    model.set_attn_implementation("entmaxkv")
    with pytest.raises(H.Unsupported, match="beam search|expanding the batch"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, pad_token_id=0,
                       past_key_values=H.EntmaxKVCache(model, max_len=64))
    with pytest.raises(H.Unsupported, match="sliding-window"):
        H.EntmaxKVCache(MistralConfig(sliding_window=16, **SMALL))
    soft = LlamaConfig(**SMALL)
    soft.attn_logit_softcapping = 30.0
    with pytest.raises(H.Unsupported, match="soft-capped"):
        H.EntmaxKVCache(soft)
    sinks = LlamaConfig(**SMALL)
    sinks.use_sink = True
    with pytest.raises(H.Unsupported, match="attention sinks"):
        H.EntmaxKVCache(sinks)
    with pytest.raises(ValueError, match="needs an entmaxkv.hf.EntmaxKVCache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="budget"):
        H.EntmaxKVCache(model, policy=TopK(2), page_size=4)
    with pytest.raises(ValueError, match="model_or_config"):
        H.EntmaxKVCache("llama")


def test_bad_states_change_nothing():
    """A key/value of the wrong shape is refused before the cache takes rows
    or pages: the cache stays as it was, and generates as before."""
    model = _model("llama", seed=4)
    cache = H.EntmaxKVCache(model, policy=TopK(8), page_size=4, max_len=64)
    ids, mask = _prompt(seed=5, batch=2, pad=(0, 3))
    want, _ = _generate(model, "entmaxkv", ids, mask, cache)
    cache.reset()
    layer = cache.layers[0]
    free, paged = cache.paged.free_pages, cache.paged
    hd = model.config.head_dim
    kv = model.config.num_key_value_heads
    good = torch.zeros(2, kv, 1, hd)
    for k, v, arg in ((torch.zeros(2, kv + 1, 1, hd), torch.zeros(2, kv + 1, 1, hd), "key_states"),
                      (torch.zeros(2, kv, 1, hd + 1), torch.zeros(2, kv, 1, hd + 1), "key_states"),
                      (torch.zeros(kv, 1, hd), torch.zeros(kv, 1, hd), "key_states"),
                      (good, torch.zeros(2, kv, 2, hd), "value_states")):
        with pytest.raises(ValueError, match=arg):
            layer.update(k, v, 0)
        assert cache.slots is None and cache.paged is paged and cache.paged.free_pages == free
        assert layer.get_seq_length() == 0
    got, _ = _generate(model, "entmaxkv", ids, mask, cache)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ the twins as transformers models
@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Both twin checkpoints converted to transformers folders (a few seconds)."""
    out = tmp_path_factory.mktemp("hf")
    return {name: H.convert(CHECKPOINTS / name, out / name) for name in ("entmax", "softmax")}


@pytest.mark.parametrize("name,policy", [("entmax", Full()), ("entmax", Certified(seed=TopK(32), dense_above=1.0)),
                                         ("softmax", Full())], ids=["entmax-full", "entmax-certified", "softmax"])
def test_twin_from_pretrained_equals_entmaxkv_generate(twins, name, policy):
    """AutoModelForCausalLM.from_pretrained(folder) + generate with an
    EntmaxKVCache gives the tokens of `entmaxkv generate` (the exact policies:
    the first new token comes from the prompt's dense attention here, from
    the decode path there, which only exact policies make the same)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entmaxkv.model.checkpoint import load_model
    from entmaxkv.model.generate import generate

    tok = AutoTokenizer.from_pretrained(twins[name])
    model = AutoModelForCausalLM.from_pretrained(twins[name], attn_implementation="entmaxkv").eval()
    text = "def parse(self, data):\n    result = []\n    for line in data.splitlines():\n        "
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode())
    want = generate(load_model(CHECKPOINTS / name), ids[0], 12, policy=policy, page_size=8).tokens
    cache = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128)
    assert cache.alpha == (1.5 if name == "entmax" else 1.0)
    got = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache, pad_token_id=0)
    assert got[:, ids.shape[1]:].tolist() == want.tolist()
    # compiled decode steps (fullgraph, the NAPE heads' ALiBi slopes planned when the cache is armed)
    compiled = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128, compileable=True)
    torch._dynamo.reset()
    got = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=compiled, pad_token_id=0,
                         compile_config=_compile_config("eager"), disable_compile=False)
    assert got[:, ids.shape[1]:].tolist() == want.tolist() and hasattr(model, "_compiled_call")
    model.set_attn_implementation("eager")  # the twin's own dense attention, over a DynamicCache
    eager = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert eager[:, ids.shape[1]:].tolist() == want.tolist()
    assert tok.decode(got[0, ids.shape[1]:]) == bytes(want[0].tolist()).decode("utf-8", errors="replace")


def test_bench_latency_cli(tmp_path):
    """`entmaxkv bench latency` on a twin checkpoint and on a transformers
    folder: vLLM's JSON keys; bad flags are one line and status 2."""
    import json

    from entmaxkv.cli import main

    folder = tmp_path / "llama"
    _model("llama").save_pretrained(folder)
    for model in (str(CHECKPOINTS / "entmax"), str(folder)):
        out = tmp_path / "lat.json"
        assert main(["bench", "latency", "--model", model, "--input-len", "12", "--output-len", "3",
                     "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "2", "--page-size", "4",
                     "--budget", "8", "--output-json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert len(res["latencies"]) == 2 and set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
        assert res["avg_latency"] > 0
    assert main(["bench", "latency", "--model", str(tmp_path / "nothing")]) == 2
    assert main(["bench", "latency", "--budget", "4", "--page-size", "8"]) == 2


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_triton_prefill_equals_reference(alpha):
    """The Triton backend's prefill (SDPA for a softmax prompt, the fused
    kernel for entmax and for a chunk over cached context; here under the
    interpreter) gives the reference backend's logits, whole and chunked."""
    model = _model("llama", seed=21)
    model.config.entmax_alpha = alpha
    model.set_attn_implementation("entmaxkv")
    ids, mask = _prompt(seed=22, batch=2, pad=(0, 5))
    real = mask.bool()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, past_key_values=H.EntmaxKVCache(model, page_size=4)).logits
        tri = model(ids, attention_mask=mask,
                    past_key_values=H.EntmaxKVCache(model, page_size=4, backend="triton")).logits
        two = H.EntmaxKVCache(model, page_size=4, backend="triton")
        model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=two)
        last = model(ids[:, 9:], attention_mask=mask, past_key_values=two).logits[:, -1]
    assert _rel(tri[real], ref[real]) < 1e-5
    assert _rel(last, ref[:, -1]) < 1e-5
