"""Global positions (a context-parallel shard's position table) in the
scoring and attention kernels, against the reference with the same table,
and against the scores of the unsharded sequence."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, Gaussian, TopK  # noqa: E402
from entmaxkv import attention as RA  # noqa: E402
from entmaxkv import scoring as RS  # noqa: E402
from entmaxkv.backend import REFERENCE  # noqa: E402
from entmaxkv.policies import compact  # noqa: E402
from entmaxkv.testing import rel_err, random_case  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _shard(P, G, dtype, ranks=3, rank=1, seed=0):
    """A cache whose rows are rank ``rank``'s interleaved share of longer
    sequences: stored page m is global page m * ranks + rank; the query
    sits at the end of each whole sequence."""
    cache, ids, q, sl = random_case([5 * P + 3, 2 * P, P + 1], 2, G, 16, P, dtype, seed=seed, slopes=True)
    lay = cache.layer()
    glen = torch.tensor([(5 * P + 3) * ranks + 2, 2 * P * ranks + P, (P + 1) * ranks + 7])
    pos = torch.zeros(cache.max_seqs, 2, dtype=torch.int32)
    pos[ids.long(), 0] = (glen - 1).to(torch.int32)
    pos[ids.long(), 1] = rank * P
    return lay.with_rows(lay.block_table, lay.seq_lens, pos, ranks * P), ids, q, sl


@pytest.mark.parametrize("P,G,dtype", [(4, 1, torch.float32), (8, 3, torch.float16), (16, 2, torch.bfloat16)])
def test_scoring_and_attention_with_positions(P, G, dtype):
    kv, ids, q, sl = _shard(P, G, dtype, seed=P + G)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for name in ("quest_bounds", "gaussian_stats"):
        got = getattr(K, name)(q, kv, ids, scale=0.25, slopes=sl)
        want = getattr(RS, name)(q, kv, ids, scale=0.25, slopes=sl)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(g)) and rel_err(g[fin], w[fin]) < 1e-5, name
    sel = compact(RS.page_layout(kv, ids).valid[:, None, :].expand(-1, 2, -1).clone())
    for alpha in (1.0, 1.5, 1.25):
        o, tau = K.dense_attend(q, kv, ids, alpha=alpha, scale=0.25, slopes=sl)
        ro, rtau = RA.attend(q, kv, ids, sel, alpha=alpha, scale=0.25, slopes=sl)
        assert rel_err(o, ro) < tol and rel_err(tau, rtau) < 1e-4, alpha
        o2, _ = K.attend(q, kv, ids, sel, alpha=alpha, scale=0.25, slopes=sl)
        assert rel_err(o2, ro) < tol, alpha


def test_global_positions_give_the_unsharded_scores():
    """A shard's candidate scores equal the scores the same tokens have in the
    whole sequence: the reference lists every kept token of the shard, the
    kernel at least those that can be in the support, with equal scores."""
    kv, ids, q, sl = _shard(4, 2, torch.float32, seed=3)
    ref_s, ref_t, _ = REFERENCE.candidates(q, kv, ids, None, alpha=1.5, scale=0.25, slopes=sl)
    ker_s, ker_t, lower = K.TritonBackend().candidates(q, kv, ids, None, alpha=1.5, scale=0.25, slopes=sl)
    for r in range(ref_s.shape[0]):
        want = {int(t): float(s) for s, t in zip(ref_s[r], ref_t[r]) if s > float("-inf")}
        got = {int(t): float(s) for s, t in zip(ker_s[r], ker_t[r]) if s > float("-inf")}
        assert set(got) <= set(want)
        assert all(abs(got[t] - want[t]) <= 1e-4 * (1 + abs(want[t])) for t in got)
        # what the kernel left out scores below its lower bound
        assert all(s < float(lower[r]) + 1e-6 for t, s in want.items() if t not in got)
    # one token by hand: stored page 0 of row 0 is global page 1 (rank 1 of 3), row 2: position 4 + 2
    lay = RS.page_layout(kv, ids)
    P, pos_q = 4, int(lay.pos_q[0])
    k = kv.k_pages[int(lay.phys[0, 0]), 0, 2].float()
    s = float(q[0, 0] @ k) * 0.25 + float(sl[0]) * ((1 * P + 2) - pos_q)
    t = int(lay.phys[0, 0]) * P + 2
    i = (ref_t[0] == t).nonzero()[0, 0]
    assert abs(float(ref_s[0, i]) - s) < 1e-4


def test_selection_kernels_refuse_positions():
    """The top-k, Gaussian and certified kernels read local positions: a shard
    with a position table is refused by name (entmaxkv.distributed selects)."""
    kv, ids, q, sl = _shard(4, 2, torch.float32)
    for policy in (TopK(8), Gaussian(), Certified(seed=TopK(8))):
        with pytest.raises(ValueError, match="cache: .* does not take a position table"):
            K.select(policy, q, kv, ids, alpha=1.5, scale=0.25, slopes=sl)


def test_no_table_is_unchanged():
    """Without a table the kernels' positions are the row's own (the default path)."""
    cache, ids, q, sl = random_case([37, 9], 2, 2, 16, 4, torch.float32, seed=9, slopes=True)
    a, _ = K.dense_attend(q, cache, ids, alpha=1.5, scale=0.25, slopes=sl)
    lay = cache.layer()
    pos = torch.zeros(cache.max_seqs, 2, dtype=torch.int32)
    pos[:, 0] = (cache.seq_lens - 1).clamp(min=0)
    b, _ = K.dense_attend(q, lay.with_rows(lay.block_table, lay.seq_lens, pos), ids, alpha=1.5, scale=0.25,
                          slopes=sl)
    assert torch.equal(a, b)
