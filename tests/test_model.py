"""The compact LM: checkpoints, paged prefill/decode vs the full forward, generation, data."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from entmaxkv.model.checkpoint import load_model, save_model
from entmaxkv.model.data import (BatchRecipe, PK_DIGITS, draw_key, encode, decode as detok, is_test_file,
                                 is_test_key, passkey_prompt, sample_batch)
from entmaxkv.model.generate import DecodeSession, generate, make_policy
from entmaxkv.model.lm import ModelConfig, TransformerLM, causal_attention
from entmaxkv.policies import Certified, Full, TopK


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def tiny(attention="entmax", positions="nape", seed=0, sharpen=6.0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      attention=attention, positions=positions)
    m = TransformerLM(cfg).eval()
    with torch.no_grad():  # peaky attention: entmax supports become small
        for blk in m.blocks:
            blk.attn.wq.weight.mul_(sharpen)
            blk.attn.wk.weight.mul_(sharpen)
    return m


def test_config_roundtrip_and_validation():
    cfg = ModelConfig(attention="softmax", positions="rope")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.attn_alpha == 1.0 and ModelConfig().attn_alpha == 1.5
    assert ModelConfig(n_heads=8).alibi_slopes()[4:] == [0.0] * 4  # NAPE: half NoPE
    assert all(s > 0 for s in ModelConfig(n_heads=8).alibi_slopes()[:4])
    with pytest.raises(ValueError):
        ModelConfig(attention="linear")
    with pytest.raises(ValueError):
        ModelConfig(n_heads=6, n_kv_heads=4)


def test_save_load_roundtrip(tmp_path):
    m = tiny()
    save_model(m, tmp_path / "exact", dtype=None)
    m2 = load_model(tmp_path / "exact")
    assert m2.cfg == m.cfg
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    save_model(m, tmp_path / "bf16")  # default: bf16 weights
    m3 = load_model(tmp_path / "bf16")
    x = torch.randint(0, 256, (1, 40))
    assert rel(m3(x), m(x)) < 2e-2


@pytest.mark.parametrize("attention", ["entmax", "softmax"])
def test_chunked_attention_matches_unchunked(attention):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 37, 16) * 3, torch.randn(2, 2, 37, 16) * 3, torch.randn(2, 2, 37, 16)
    slopes = torch.tensor([0.25, 0.0625, 0.0, 0.0])
    alpha = 1.5 if attention == "entmax" else 1.0
    a = causal_attention(q, k, v, alpha=alpha, scale=0.25, slopes=slopes)
    b = causal_attention(q, k, v, alpha=alpha, scale=0.25, slopes=slopes, chunk=5)
    assert rel(b, a) < 1e-6


@pytest.mark.parametrize("positions", ["nape", "rope"])
@pytest.mark.parametrize("attention", ["entmax", "softmax"])
def test_paged_decode_matches_full_forward(attention, positions):
    m = tiny(attention, positions)
    x = torch.randint(0, 256, (2, 70))
    ref = m(x)  # [2, 70, V]
    sess = DecodeSession(m, 2, 70, page_size=8)
    last = sess.prefill(x[:, :50])
    assert rel(last, ref[:, 49]) < 1e-5
    for t in range(50, 70):
        lg = sess.step(x[:, t], Full())
        assert rel(lg, ref[:, t]) < 1e-5, t


def test_certified_logits_equal_full_and_topk_differs():
    m = tiny("entmax", "nape", sharpen=8.0)
    x = torch.randint(0, 256, (2, 160))
    sess = DecodeSession(m, 2, 160, page_size=8, copies=3)
    sess.prefill(x[:, :130])
    # (dense_above=1: always the selection, never the dense pass its cost check may choose)
    pols = [Full(), Certified(seed=TopK(budget=16), dense_above=1.0), TopK(budget=16)]
    certified_any = False
    for t in range(130, 160):
        full = sess.step(x[:, t], pols[0], copy=0)
        cert, stats = sess.step(x[:, t], pols[1], copy=1, return_stats=True)
        sess.step(x[:, t], pols[2], copy=2)
        assert rel(cert, full) <= 1e-4
        assert all(bool(s.certified.all()) for s in stats)
        certified_any |= any(float(s.coverage.mean()) < 1.0 for s in stats)
    assert certified_any  # certified really skipped pages somewhere


def test_generate_deterministic_with_seed():
    m = tiny()
    prompt = torch.as_tensor(encode("def f(x):\n    return"), dtype=torch.long)[None]
    a = generate(m, prompt, 12, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    b = generate(m, prompt, 12, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(a.tokens, b.tokens)
    g = generate(m, prompt, 6, keep_logits=True)  # greedy
    assert torch.equal(g.tokens, g.logits.argmax(-1))
    # Greedy through a top-k policy runs and returns valid byte tokens.
    t = generate(m, prompt, 4, policy=make_policy("topk", budget=16), page_size=8)
    assert t.tokens.shape == (1, 4) and int(t.tokens.max()) < 256


def test_passkey_prompt_and_split_rules():
    rng = np.random.default_rng(0)
    hay = np.frombuffer(b"x = 1\n" * 400, dtype=np.uint8)
    p = passkey_prompt(hay, 12345, 0.5, 600)
    assert len(p) == 600 and "The pass key is 12345." in detok(p)
    assert detok(p).endswith("The pass key is ")
    assert all(is_test_key(draw_key(rng, "test")) for _ in range(50))
    assert not any(is_test_key(draw_key(rng, "train")) for _ in range(50))
    assert isinstance(is_test_file("json/decoder.py"), bool)


def test_sample_batch_weights_mark_answers():
    stream = np.frombuffer(b"abc def\n" * 2000, dtype=np.uint8)
    recipe = BatchRecipe(seq_len=400, p_passkey=0.5, p_copy=0.5)
    x, w = sample_batch(stream, np.random.default_rng(3), 8, recipe)
    assert x.shape == (8, 401) and w.shape == (8, 400)
    for b in range(8):
        text = detok(x[b])
        heavy = np.flatnonzero(w[b] == recipe.answer_weight)
        if "pass key" in text:
            assert len(heavy) == PK_DIGITS
            assert detok(x[b][heavy + 1]) in text  # the answer digits follow the question
