"""End to end: a tiny Llama served by ``vllm.LLM`` (CPU build) with the
EntmaxKV backend, against stock vLLM and against transformers."""
from __future__ import annotations

import pytest
import torch

from entmaxkv import Certified, Full, TopK

NEW = 12


@pytest.fixture(scope="module")
def prompts():
    """Four concurrent requests of different lengths (one page, a partial
    page, several pages, eight pages and a bit)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 130)]


@pytest.fixture(scope="module")
def entmax_full(tiny_llama, prompts, serve):
    return serve(tiny_llama, prompts, max_tokens=NEW, entmaxkv={"policy": "full", "alpha": 1.5})["tokens"]


def test_softmax_full_equals_stock_vllm_and_hf(tiny_llama, prompts, serve, hf_generate):
    ours = serve(tiny_llama, prompts, max_tokens=NEW, entmaxkv={"policy": "full", "alpha": 1.0})["tokens"]
    stock = serve(tiny_llama, prompts, max_tokens=NEW, stock=True, block_size=32)["tokens"]
    hf = hf_generate(tiny_llama, prompts, max_tokens=NEW)
    assert ours == stock == hf


def test_entmax_full_equals_hf_entmaxkv_cache(tiny_llama, prompts, entmax_full, hf_generate):
    hf = hf_generate(tiny_llama, prompts, max_tokens=NEW, policy=Full(), alpha=1.5)
    softmax = hf_generate(tiny_llama, prompts, max_tokens=NEW)
    assert entmax_full == hf
    assert entmax_full != softmax  # alpha reaches the attention


def test_entmax_certified_equals_full_and_hf(tiny_llama, prompts, entmax_full, serve, hf_generate):
    ours = serve(tiny_llama, prompts, max_tokens=NEW, entmaxkv={"policy": "certified", "budget": 16,
                                                                 "alpha": 1.5})["tokens"]
    hf = hf_generate(tiny_llama, prompts, max_tokens=NEW, policy=Certified(seed=TopK(16)), alpha=1.5)
    assert ours == hf == entmax_full


def test_entmax_topk_equals_hf_topk_and_prefix_cache_hits(tiny_llama, prompts, serve, hf_generate):
    """A budget smaller than the long prompts: the same pages are selected in
    both engines. Each prompt served again on its own finds its full pages in
    vLLM's prefix cache and computes only the rest (the 17-token prompt just
    its last token, which still attends densely): the same tokens again."""
    res = serve(tiny_llama, prompts, max_tokens=NEW, entmaxkv={"policy": "topk", "budget": 16, "alpha": 1.5},
                extra_prompts=prompts)
    assert res["tokens"] == hf_generate(tiny_llama, prompts, max_tokens=NEW, policy=TopK(16), alpha=1.5)
    assert [e["tokens"] for e in res["extra"]] == res["tokens"]


def test_chunked_prefill_with_cached_context(tiny_llama, prompts, entmax_full, serve):
    """A step budget of 24 tokens: long prompts arrive in chunks that attend
    to their cached context, beside other requests' decode rows."""
    ours = serve(tiny_llama, prompts, max_tokens=NEW, entmaxkv={"policy": "full", "alpha": 1.5},
                 max_num_batched_tokens=24)["tokens"]
    assert ours == entmax_full


def test_too_long_request_is_refused_and_serving_goes_on(tiny_llama, prompts, serve):
    """max_model_len 64 (a block-table row of 4 pages): a 100-token prompt is
    refused with a clear error; the engine then serves the next request."""
    res = serve(tiny_llama, prompts[:2], max_tokens=NEW, entmaxkv={"policy": "topk", "budget": 16, "alpha": 1.5},
                max_model_len=64, extra_prompts=[list(range(1, 101)), prompts[1]])
    err = res["extra"][0].get("error", "")
    assert "maximum context length is 64" in err and "100 input tokens" in err, err
    assert res["extra"][1]["tokens"] == res["tokens"][1]


def test_bad_settings_are_refused(tiny_llama, prompts, serve):
    with pytest.raises(AssertionError, match=r"entmaxkv\.policy: expected one of"):
        serve(tiny_llama, prompts[:1], max_tokens=2, entmaxkv={"policy": "dense"})
