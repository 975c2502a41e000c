"""Context-parallel decode across processes (gloo on this machine's loopback)
against one process over the unsharded cache: every policy, both page
layouts, 2 and 3 ranks, uneven shards and shards with no token of a
sequence, ALiBi, GQA, the Newton fallback, the Triton kernels (interpreter)
and the twin model generating. The checks live in
entmaxkv.distributed.testing (spawned processes import them from there)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from entmaxkv.distributed import ContextParallel, ShardedCache, Sharding
from entmaxkv.distributed import testing as T

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (3, "interleaved")])
def test_every_policy_equals_one_process(world, layout):
    T.run(world, T.check_policies, layout, "reference", torch.float32, 2)


def test_kernels_across_ranks():
    """The Triton path (scoring and attention kernels with global positions) on the interpreter."""
    pytest.importorskip("triton")
    T.run(2, T.check_policies, "interleaved", "triton", torch.float16, 2)


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_fallback_rounds_find_tau(layout):
    T.run(2, T.check_fallback, layout)


@pytest.mark.parametrize("layout,policy", [("contiguous", "certified"), ("interleaved", "topk")])
def test_twin_generates_the_same_tokens(layout, policy):
    T.run(2, T.check_generate, layout, policy)


def test_sharding_maps_pages():
    """Local lengths and owners, both layouts, against a page-by-page count."""
    for layout in ("contiguous", "interleaved"):
        for ranks in (1, 2, 3):
            for rank in range(ranks):
                sh = Sharding(ranks, rank, layout, span=5, page_size=4)
                for n in range(0, 4 * 5 * ranks + 1):
                    owned = sh.owned(0, n)
                    assert sh.local_tokens(n) == int(owned.sum()), (layout, ranks, rank, n)
                    pages = [g for g in range(-(-n // 4)) if sh.owner(g) == rank]
                    local = torch.arange(len(pages))
                    assert sh.global_page(local).tolist() == pages
                    assert sh.local_page(torch.tensor(pages, dtype=torch.long)).tolist() == local.tolist()


def test_validation():
    with pytest.raises(ValueError, match="ContextParallel.candidates"):
        ContextParallel(candidates=0)
    with pytest.raises(ValueError, match="ContextParallel.fallback_rounds"):
        ContextParallel(fallback_rounds=-1)
    with pytest.raises(ValueError, match="ContextParallel.sync"):
        ContextParallel(sync="no")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
            ShardedCache(num_pages=4, page_size=4, kv_heads=1, head_dim=4, max_seqs=1, max_len=8)
