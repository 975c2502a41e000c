"""generate() with an EntmaxKVCache on the GPU (Triton decode) in half
precision, against HF's eager attention (alpha 1) and a dense entmax
attention (alpha 1.5). ``python -m pytest -m gpu tests/gpu/test_hf.py``."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers")

import entmaxkv.hf as H  # noqa: E402
from entmaxkv import Certified, Full, TopK  # noqa: E402
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
