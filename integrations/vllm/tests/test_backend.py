"""The backend's parts against EntmaxKV's own reference: settings, the page
spec, the batch split, and one layer's writes + attention over a page
tensor shaped as vLLM allocates it."""
from __future__ import annotations

import math

import pytest
import torch

from entmaxkv import Certified, Full, PagedKVCache, TopK, decode
from entmaxkv.layout import row_width
from entmaxkv.prefill import paged_prefill
from entmaxkv.testing import rel_err

from entmaxkv_vllm.config import Settings, settings_from

H, HQ, D, P = 2, 4, 8, 4


# ---------------------------------------------------------------- settings
def test_settings_defaults_and_values():
    s = settings_from({})
    assert (s.policy, s.alpha, s.backend) == ("full", 1.0, "auto") and s.policy_obj == Full()
    s = settings_from({"entmaxkv": {"policy": "certified", "budget": 64, "alpha": 1.5}})
    assert s.policy_obj == Certified(seed=TopK(64)) and s.alpha == 1.5
    assert settings_from({"entmaxkv": {"alpha": 1 + 1e-12}}).alpha == 1.0  # runs as softmax
    assert settings_from(None) == Settings()


@pytest.mark.parametrize("raw, word", [
    ({"entmaxkv": {"policy": "dense"}}, r"entmaxkv\.policy"),
    ({"entmaxkv": {"budget": 0}}, r"entmaxkv\.budget"),
    ({"entmaxkv": {"budget": "8"}}, r"entmaxkv\.budget"),
    ({"entmaxkv": {"alpha": 0.5}}, r"entmaxkv\.alpha"),
    ({"entmaxkv": {"alpha": 9.0}}, r"entmaxkv\.alpha"),
    ({"entmaxkv": {"q_max": 1.0}}, r"entmaxkv\.q_max"),
    ({"entmaxkv": {"backend": "cuda"}}, r"entmaxkv\.backend"),
    ({"entmaxkv": {"prefill_scores": 0}}, r"entmaxkv\.prefill_scores"),
    ({"entmaxkv": {"page_size": 16}}, r"unknown keys \['page_size'\]"),
    ({"entmaxkv": "topk"}, r"additional_config\['entmaxkv'\]"),
    ("topk", "additional_config: expected a mapping"),
])
def test_settings_refused(raw, word):
    with pytest.raises(ValueError, match=word):
        settings_from(raw)


# ---------------------------------------------------------------- vLLM objects
@pytest.fixture(scope="module")
def vllm_config(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", max_model_len=64, block_size=P,
                      additional_config={"entmaxkv": {"policy": "topk", "budget": 8, "alpha": 1.5}}
                      ).create_engine_config()


def _spec(dtype=torch.float32, **kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=P, num_kv_heads=H, head_size=D, dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_spec_rows_hold_the_statistics(dtype):
    from entmaxkv_vllm.backend import EntmaxKVBackend

    spec = EntmaxKVBackend.customize_spec(_spec(dtype))
    item = torch.tensor([], dtype=dtype).element_size()
    assert spec.state_content_bytes == row_width(P, D, dtype) * item > 2 * D * item
    assert spec.page_size_bytes == H * P * row_width(P, D, dtype) * item  # vLLM accounts for every byte
    assert EntmaxKVBackend.customize_spec(spec) == spec


def test_spec_refuses_a_different_value_head_size():
    from entmaxkv_vllm.backend import EntmaxKVBackend, Unsupported

    with pytest.raises(Unsupported, match="head_size_v"):
        EntmaxKVBackend.customize_spec(_spec(head_size_v=2 * D))


def _common(block_table, seq_lens, q_lens, prefilling=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens), num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=torch.zeros(T, dtype=torch.int64),
        is_prefilling=None if prefilling is None else torch.tensor(prefilling))


def _builder(vllm_config):
    from vllm.config import set_current_vllm_config

    from entmaxkv_vllm.backend import EntmaxKVBackend, EntmaxKVMetadataBuilder

    with set_current_vllm_config(vllm_config):
        return EntmaxKVMetadataBuilder(EntmaxKVBackend.customize_spec(_spec()), ["layer0"], vllm_config,
                                       torch.device("cpu"))


def test_builder_splits_decode_and_prefill_rows(vllm_config):
    b = _builder(vllm_config)
    table = torch.arange(12, dtype=torch.int32).view(4, 3)
    # row 0 decodes; row 1 is the last token of a prompt (prefix cache hit); rows 2, 3 prefill chunks
    md = b.build(0, _common(table, [9, 5, 7, 12], [1, 1, 3, 5], prefilling=[False, True, True, True]))
    assert md.decode_rows == (0,) and md.decode_tokens.tolist() == [0]
    assert md.prefills == ((1, 1, 2, 5), (2, 2, 5, 7), (3, 5, 10, 12))
    md = b.build(0, _common(table, [9, 5, 7, 12], [1, 1, 1, 1]))  # no prompt flags: one token decodes
    assert md.decode_rows == (0, 1, 2, 3) and md.prefills == ()


def test_builder_refuses_rows_past_the_block_table(vllm_config):
    b = _builder(vllm_config)
    table = torch.zeros(2, 3, dtype=torch.int32)  # 3 pages of 4 tokens per row
    with pytest.raises(ValueError, match=r"seq_lens: request row 1 holds 13 tokens.*3 pages of 4"):
        b.build(0, _common(table, [4, 13], [1, 1]))


@pytest.mark.parametrize("kw, word", [
    (dict(sliding_window=8), "sliding_window"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap"),
    (dict(sinks=torch.zeros(HQ)), "sinks"),
    (dict(attn_type="encoder_only"), "attn_type"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
])
def test_impl_refuses_what_it_does_not_do(vllm_config, kw, word):
    from vllm.config import set_current_vllm_config

    from entmaxkv_vllm.backend import EntmaxKVImpl, Unsupported

    with set_current_vllm_config(vllm_config), pytest.raises(Unsupported, match=word):
        EntmaxKVImpl(HQ, D, D ** -0.5, H, **kw)


@pytest.mark.parametrize("slopes", [None, [0.5, 0.25, 0.0, 0.0]], ids=["nope", "alibi"])
def test_layer_writes_and_attends_like_entmaxkv(vllm_config, slopes):
    """One layer over a vLLM-shaped page tensor: a 6-token prompt chunk after
    5 cached tokens (row 1) beside a decode row (row 0), written through the
    slot mapping, against a PagedKVCache holding the same tokens."""
    from vllm.config import set_current_vllm_config

    from entmaxkv_vllm.backend import EntmaxKVImpl

    gen = torch.Generator().manual_seed(0)
    with set_current_vllm_config(vllm_config):
        impl = EntmaxKVImpl(HQ, D, 0.3, H, alibi_slopes=slopes)
        b = _builder(vllm_config)
    C = row_width(P, D, torch.float32)
    kv_cache = torch.zeros(16, H, P, C)
    table = torch.tensor([[3, 9, 0], [7, 1, 12]], dtype=torch.int32)
    lens = [10, 11]
    k = torch.randn(11, 2, H, D, generator=gen)
    v = torch.randn(11, 2, H, D, generator=gen)

    def slots(row, a, b_):
        return torch.tensor([int(table[row, t // P]) * P + t % P for t in range(a, b_)])

    # history: row 0's first 9 tokens, row 1's first 5
    impl.do_kv_cache_update(None, torch.cat([k[:9, 0], k[:5, 1]]), torch.cat([v[:9, 0], v[:5, 1]]), kv_cache,
                            torch.cat([slots(0, 0, 9), slots(1, 0, 5)]))
    # this step: row 0 decodes token 9, row 1 prefills tokens 5..10
    step_k, step_v = torch.cat([k[9:10, 0], k[5:11, 1]]), torch.cat([v[9:10, 0], v[5:11, 1]])
    smap = torch.cat([slots(0, 9, 10), slots(1, 5, 11)])
    impl.do_kv_cache_update(None, step_k, step_v, kv_cache, smap)
    q = torch.randn(7, HQ, D, generator=gen)
    md = b.build(0, _common(table, lens, [1, 6], prefilling=[False, True]))
    out = impl.forward(None, q, step_k, step_v, kv_cache, md, torch.full((7, HQ, D), math.nan))

    ref = PagedKVCache(16, P, H, D, max_seqs=2, max_pages_per_seq=3, dtype=torch.float32)
    seqs = [ref.allocate(), ref.allocate()]
    for s, n in zip(seqs, lens):
        ref.prefill(s, k[:n, s], v[:n, s])
    sl = None if slopes is None else torch.tensor(slopes)
    want0 = decode(q[:1], ref, [seqs[0]], TopK(8), alpha=1.5, scale=0.3, alibi_slopes=sl)
    want1 = paged_prefill(q[1:], ref.layer(0), ref.page_ids(seqs[1]), 11, alpha=1.5, scale=0.3, alibi_slopes=sl)
    assert rel_err(out[:1], want0) < 1e-5 and rel_err(out[1:], want1) < 1e-5
    # the statistics written through the slot mapping are the cache's, page for page (the
    # moments to rounding: a page that grew by one token took the running update)
    kv = impl._kv(kv_cache)
    for s, row in zip(seqs, table):
        for j, page in enumerate(ref.page_ids(s).tolist()):
            assert torch.equal(kv.k_bounds[int(row[j])], ref.layer(0).k_bounds[page])
            assert torch.allclose(kv.k_moments[int(row[j])], ref.layer(0).k_moments[page], rtol=1e-5, atol=1e-6)
