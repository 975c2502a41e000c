"""paged_prefill: dense causal attention over a row's pages equals attention
computed on the contiguous tokens with an independent entmax (the ``entmax``
package) or softmax, for any chunking of the queries."""
from __future__ import annotations

import math

import pytest
import torch
from entmax import entmax_bisect

from entmaxkv.prefill import gather_row, paged_prefill
from entmaxkv.testing import alibi, random_cache, rel_err


def oracle(q, k, v, n, alpha, scale, slopes=None):
    """q [t, HQ, D] at positions n - t .. n - 1; k, v [n, H, D] contiguous. float64."""
    t, HQ, D = q.shape
    G = HQ // k.shape[1]
    kk = k.double().repeat_interleave(G, dim=1).transpose(0, 1)  # [HQ, n, D]
    vv = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
    s = torch.einsum("thd,hnd->htn", q.double(), kk) * scale
    pos = torch.arange(n - t, n)[:, None]
    rel = (torch.arange(n)[None, :] - pos).double()  # [t, n]
    if slopes is not None:
        s = s + slopes.double()[:, None, None] * rel
    s = s.masked_fill(rel[None] > 0, float("-inf"))
    p = torch.softmax(s, -1) if alpha == 1.0 else entmax_bisect(s, alpha, dim=-1, n_iter=200)
    return torch.einsum("htn,hnd->thd", p, vv)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("with_alibi", [False, True])
def test_matches_oracle(page_size, group, alpha, with_alibi):
    """Odd lengths, GQA, ALiBi (with NoPE heads); the whole row and its last chunk."""
    seed = page_size * 1000 + group * 100 + int(alpha * 10) + with_alibi
    H, D = 2, 12
    lens = [37, 1, 2 * page_size + 3]
    cache, slots, k, v = random_cache(lens, H, D, page_size, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    slopes = alibi(H * group) if with_alibi else None
    lay = cache.layer(0)
    for b, n in enumerate(lens):
        for t in {n, max(1, n // 3)}:
            q = torch.randn(t, H * group, D, generator=gen, dtype=torch.float64)
            out = paged_prefill(q, lay, cache.page_ids(slots[b]), n, alpha=alpha, scale=0.7, alibi_slopes=slopes)
            ref = oracle(q, k[b, :n], v[b, :n], n, alpha, 0.7, slopes)
            assert out.dtype == torch.float64
            assert rel_err(out, ref) < 1e-9, (b, n, t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_storage_dtypes(dtype):
    """Pages in every storage dtype, queries in the same dtype: float32 math, output in q's dtype."""
    H, D, P, n = 2, 16, 8, 45
    cache, slots, k, v = random_cache([n], H, D, P, dtype=dtype, seed=3)
    q = torch.randn(n, 4, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = paged_prefill(q, cache.layer(0), cache.page_ids(slots[0]), n, alpha=1.5)
    ref = oracle(q.double(), k[0, :n], v[0, :n], n, 1.5, D ** -0.5)
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(out.double(), ref) < tol


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_query_chunks_and_prompt_chunks_agree(alpha):
    """A tiny score budget (one query per block) and a prompt split into
    chunks give what one pass over the whole prompt gives."""
    H, D, P, n = 2, 8, 4, 29
    cache, slots, _, _ = random_cache([n], H, D, P, seed=9)
    lay, pages = cache.layer(0), cache.page_ids(slots[0])
    q = torch.randn(n, 4, D, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    whole = paged_prefill(q, lay, pages, n, alpha=alpha)
    tiny = paged_prefill(q, lay, pages, n, alpha=alpha, max_scores=1)
    assert rel_err(tiny, whole) < 1e-12
    parts = [paged_prefill(q[a:b], lay, pages, b, alpha=alpha) for a, b in ((0, 7), (7, 8), (8, 29))]
    assert rel_err(torch.cat(parts), whole) < 1e-12


def test_gather_row_is_the_row():
    H, D, P = 3, 4, 5
    cache, slots, k, v = random_cache([23, 11], H, D, P, seed=1)
    for b, n in enumerate((23, 11)):
        kg, vg = gather_row(cache.layer(0), cache.page_ids(slots[b]), n)
        assert torch.equal(kg.transpose(0, 1), k[b, :n]) and torch.equal(vg.transpose(0, 1), v[b, :n])


def test_out_is_written_in_place():
    cache, slots, _, _ = random_cache([9], 1, 4, 4, seed=2)
    q = torch.randn(3, 2, 4)
    out = torch.full_like(q, math.nan)
    got = paged_prefill(q, cache.layer(0), cache.page_ids(slots[0]), 9, out=out)
    assert got is out and torch.isfinite(out).all()


def test_validation():
    cache, slots, _, _ = random_cache([9], 2, 4, 4, seed=2)
    lay, pages = cache.layer(0), cache.page_ids(slots[0])
    q = torch.randn(3, 4, 4)
    cases = [
        (dict(q=torch.randn(3, 3, 4)), "q:"),            # 3 heads, not a multiple of 2
        (dict(q=torch.randn(3, 4, 5)), "q:"),
        (dict(q=torch.randn(3, 4, 4).long()), "q:"),
        (dict(n=2), "n:"),                               # fewer tokens than queries
        (dict(n=13), "pages:"),                          # 3 pages of 4 hold 12
        (dict(pages=pages.float()), "pages:"),
        (dict(alpha=0.5), "alpha"),
        (dict(scale=0.0), "scale"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
        (dict(max_scores=0), "max_scores"),
        (dict(out=torch.empty(3, 4, 4, dtype=torch.float64)), "out:"),
        (dict(kv=cache), "kv:"),
    ]
    for bad, word in cases:
        args = dict(q=q, kv=lay, pages=pages, n=9)
        args.update(bad)
        with pytest.raises(ValueError, match=word):
            paged_prefill(args.pop("q"), args.pop("kv"), args.pop("pages"), args.pop("n"), **args)
