"""generate() with an EntmaxKVCache on the GPU (Triton decode) in half
precision, against HF's eager attention (alpha 1) and a dense entmax
attention (alpha 1.5). ``python -m pytest -m gpu tests/gpu/test_hf.py``."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers")

import entmaxkv.hf as H  # noqa: E402
from entmaxkv import Certified, Full, Gaussian, TopK  # noqa: E402
from entmaxkv.hf.testing import SMALL, generate, register_dense, tiny_model  # noqa: E402

H.register()
register_dense()


def _agree(got, want, gs, ws, tol):
    """Greedy runs agree: per row, the scores match to ``tol`` (relative)
    up to and including the first step whose tokens differ (its inputs were
    the same), and a differing token is a near-tie of the reference (its top
    two scores within tol of the scores' scale)."""
    for b in range(got.shape[0]):
        diff = (got[b] != want[b]).nonzero().flatten()
        k = int(diff[0]) + 1 if diff.numel() else got.shape[1]
        err = float((gs[b, :k] - ws[b, :k]).norm() / ws[b, :k].norm())
        assert err < tol, f"row {b}: scores differ by {err:.3g} over steps 0..{k - 1}"
        if diff.numel():
            top2 = ws[b, k - 1].topk(2).values
            gap = float(top2[0] - top2[1]) / float(ws[b, k - 1].abs().max())
            assert gap < tol, f"row {b}: token {k - 1} differs with a top-2 gap of {gap:.3g} (not a near-tie)"


def _prompt(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 40), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :23] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_softmax_full_equals_eager(name, dtype):
    model = tiny_model(name, 1, dtype, "cuda")
    ids, mask = _prompt(2)
    want, ws = generate(model, "eager", ids, mask, n=6)
    cache = H.EntmaxKVCache(model, policy=Full(), alpha=1.0, page_size=8, max_len=128)
    got, gs = generate(model, "entmaxkv", ids, mask, cache, n=6)
    _agree(got, want, gs, ws, 2e-2 if dtype == torch.float16 else 4e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", [Full(), Certified(seed=TopK(16), dense_above=1.0)], ids=["full", "certified"])
def test_entmax_equals_dense_reference(policy, dtype):
    model = tiny_model("llama", 3, dtype, "cuda")
    model.config.entmax_alpha = 1.5
    ids, mask = _prompt(4)
    want, ws = generate(model, "entmax_dense", ids, mask, n=6)
    cache = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128)
    got, gs = generate(model, "entmaxkv", ids, mask, cache, n=6)
    _agree(got, want, gs, ws, 2e-2 if dtype == torch.float16 else 4e-2)


POLICIES = [Full(), TopK(16), Gaussian(), Certified(seed=TopK(16), dense_above=1.0),
            Certified(seed=TopK(16), dense_above=0.01, probe_every=3)]


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "topk", "gaussian", "certified", "certified_switch"])
def test_layer_graphs_equal_direct_launches(policy):
    """The per-layer CUDA graphs (write + attention, entmaxkv.hf.step) give
    the direct launches' tokens and scores bit for bit, on the capturing
    generate and on a replaying one after a reset, and every layer's step
    was captured. With the certified cost check switching (both the
    certified and the dense step captured) the steps that run dense depend
    on when each coverage read lands, so there the runs agree to rounding."""
    switch = isinstance(policy, Certified) and policy.dense_above < 1.0
    model = tiny_model("llama", 5, torch.float16, "cuda")
    model.config.entmax_alpha = 1.5
    ids, mask = _prompt(6)
    direct = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128, cuda_graphs=False)
    want, ws = generate(model, "entmaxkv", ids, mask, direct, n=8)
    assert direct._steps.captured() == []
    cache = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128)
    for _ in range(2):
        cache.reset()
        got, gs = generate(model, "entmaxkv", ids, mask, cache, n=8)
        if switch:
            _agree(got, want, gs, ws, 2e-2)
        else:
            assert torch.equal(got, want)
            assert torch.equal(gs, ws)
    layers = {layer for layer, _ in cache._steps.captured()}
    assert layers == set(range(model.config.num_hidden_layers))
    if switch:
        assert {dense for _, dense in cache._steps.captured()} == {False, True}


@pytest.mark.parametrize("policy", [TopK(16), Certified(seed=TopK(16))], ids=["topk", "certified"])
def test_compiled_decode_equals_uncompiled(policy):
    """On a GPU transformers compiles the decode step of a model with a
    compileable EntmaxKVCache (inductor, CUDA graphs, fullgraph: each
    layer's decode is the traced custom op, no graph break). Same tokens
    and scores (to rounding: inductor fuses the layers' other work) as with
    ``disable_compile=True``: on a compiling generate and replaying ones,
    with other allocations in between (the graphs must not read freed
    memory), after a larger batch moved the cache's tensors and back at
    the first batch size (the first graphs must not be replayed then)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = tiny_model("llama", 7, torch.float16, "cuda")
    model.config.entmax_alpha = 1.5
    ids, mask = _prompt(8)
    prompts = {2: (ids[:2], mask[:2]), 3: (ids, mask)}
    want = {b: generate(model, "entmaxkv", i, m, H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128),
                        n=8) for b, (i, m) in prompts.items()}
    cache = H.EntmaxKVCache(model, policy=policy, page_size=8, max_len=128, compileable=True)
    torch._dynamo.reset()
    counters.clear()
    held = []
    for b in (2, 2, 3, 2):
        cache.reset()
        held.append(torch.ones(1 << 16, device="cuda"))  # (what the allocator frees can be handed out again)
        got, gs = generate(model, "entmaxkv", *prompts[b], cache, n=8, disable_compile=False,
                           compile_config=CompileConfig(fullgraph=True))
        _agree(got, want[b][0], gs, want[b][1], 2e-2)
    assert hasattr(model, "_compiled_call") and not counters["graph_break"]
