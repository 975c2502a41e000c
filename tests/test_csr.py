"""CSR page tables (entmaxkv/csr.py): block table <-> FlashInfer CSR, and a
Selection as CSR.

Each conversion is compared with a plain Python loop written here, the
round trips with the original tables, and the selection CSR by gathering
the tokens it addresses against the tokens the block table gives for the
selected pages.
"""
from __future__ import annotations

import pytest
import torch

from entmaxkv import (
    Certified, Full, Gaussian, Selection, TopK, block_table_to_csr, csr_to_block_table, selection_to_csr,
)
from entmaxkv.policies import select
from entmaxkv.testing import page_sets, random_cache, random_case

# (lengths, page size): odd lengths, exact multiples, single tokens, empty sequences.
CASES = [
    ((0,), 1),
    ((7, 2, 9), 1),
    ((5, 0, 17), 3),
    ((31, 0, 48, 3, 1), 3),
    ((1, 16, 17, 33, 0), 16),
]


def loop_csr(block_table, seq_lens, P):
    """The CSR of a block table, one sequence and one page at a time."""
    indptr, indices, last = [0], [], []
    for b in range(block_table.shape[0]):
        n = int(seq_lens[b])
        pages = -(-n // P)
        indices += [int(block_table[b, j]) for j in range(pages)]
        indptr.append(len(indices))
        last.append(n - P * (pages - 1) if pages else 0)
    return indptr, indices, last


def loop_selection_csr(sel, block_table, seq_lens, P):
    """The CSR of a Selection, one row and one kept page at a time:
    (indptr, physical pages, logical pages, last_page_len) as lists."""
    indptr, phys, logical, last = [0], [], [], []
    for b, heads in enumerate(page_sets(sel)):
        n = int(seq_lens[b])
        for kept in heads:
            pages = sorted(kept)
            phys += [int(block_table[b, p]) for p in pages]
            logical += pages
            indptr.append(len(phys))
            last.append(min(max(n - pages[-1] * P, 0), P) if pages else 0)
    return indptr, phys, logical, last


def cache_tables(lens, P, seed=0):
    cache, slots, k, v = random_cache(list(lens), 2, 4, P, seed=seed)
    ids = torch.tensor(slots, dtype=torch.long)
    return cache, cache.block_table[ids], cache.seq_lens[ids], k


def csr_tokens(pages_pool, indptr, indices, last, r, P):
    """The tokens of CSR request ``r`` from a ``[num_pages, H, P, D]`` pool: [H, n, D]."""
    pages = indices[int(indptr[r]): int(indptr[r + 1])].tolist()
    parts = [pages_pool[p, :, : (int(last[r]) if i == len(pages) - 1 else P)] for i, p in enumerate(pages)]
    return torch.cat(parts, 1) if parts else pages_pool[0, :, :0]


# ------------------------------------------------------- block table -> CSR
@pytest.mark.parametrize("lens,P", CASES)
def test_block_table_to_csr_matches_loop(lens, P):
    cache, bt, sl, _ = cache_tables(lens, P)
    B, M = bt.shape
    indptr, indices, last = block_table_to_csr(bt, sl, P)
    want_ptr, want_idx, want_last = loop_csr(bt, sl, P)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == want_ptr and last.tolist() == want_last
    assert indices.shape == (B * M,)
    assert indices[: want_ptr[-1]].tolist() == want_idx
    assert not indices[want_ptr[-1]:].any()  # padding is 0
    assert all(1 <= x <= P for x, n in zip(last.tolist(), lens) if n > 0)


def test_random_tables_match_loop():
    """Arbitrary page ids (not from a cache), random lengths and capacities."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        B = int(torch.randint(1, 6, (1,), generator=gen))
        M = int(torch.randint(0, 7, (1,), generator=gen))
        P = [1, 3, 16][trial % 3]
        bt = torch.randint(0, 1000, (B, M), generator=gen, dtype=torch.int32)
        sl = torch.randint(0, M * P + 1, (B,), generator=gen, dtype=torch.int32)
        cap = int(torch.randint(0, B * M + 4, (1,), generator=gen))
        indptr, indices, last = block_table_to_csr(bt, sl, P, capacity=cap)
        want_ptr, want_idx, want_last = loop_csr(bt, sl, P)
        assert indptr.tolist() == want_ptr and last.tolist() == want_last
        want = (want_idx + [0] * cap)[:cap]  # dropped past the capacity, 0-padded up to it
        assert indices.tolist() == want, (trial, B, M, P, cap)


@pytest.mark.parametrize("lens,P", CASES)
def test_round_trips(lens, P):
    _, bt, sl, _ = cache_tables(lens, P, seed=1)
    csr = block_table_to_csr(bt, sl, P)
    bt2, sl2 = csr_to_block_table(*csr, P, max_pages=bt.shape[1])
    assert bt2.dtype == sl2.dtype == torch.int32
    assert torch.equal(bt2, bt) and torch.equal(sl2, sl)  # unused entries are 0 in both
    again = block_table_to_csr(bt2, sl2, P)
    assert all(torch.equal(a, b) for a, b in zip(again, csr))


@pytest.mark.parametrize("lens,P", CASES)
def test_csr_addresses_the_tokens(lens, P):
    """Reading through the CSR (full pages, then last_page_len rows) gives
    each sequence's keys in order, from its shuffled physical pages."""
    cache, bt, sl, k = cache_tables(lens, P, seed=2)
    indptr, indices, last = block_table_to_csr(bt, sl, P)
    for b, n in enumerate(lens):
        got = csr_tokens(cache.k_pages, indptr, indices, last, b, P)  # [H, n, D]
        assert got.shape[1] == n
        assert torch.equal(got.transpose(0, 1).float(), k[b, :n])


def test_strided_block_table():
    _, bt, sl, _ = cache_tables((31, 0, 48, 3), 3)
    wide = torch.zeros(bt.shape[0], 2 * bt.shape[1], dtype=torch.int32)
    wide[:, ::2] = bt
    view = wide[:, ::2]
    assert not view.is_contiguous()
    got = block_table_to_csr(view, sl, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, block_table_to_csr(bt, sl, 3)))


def test_capacity_pads_and_truncates():
    _, bt, sl, _ = cache_tables((31, 0, 48, 3), 3)
    indptr, full, last = block_table_to_csr(bt, sl, 3)
    nnz = int(indptr[-1])
    for cap in (0, nnz - 5, nnz, nnz + 7):
        p2, idx, l2 = block_table_to_csr(bt, sl, 3, capacity=cap)
        assert torch.equal(p2, indptr) and torch.equal(l2, last)  # indptr counts dropped entries too
        assert idx.shape == (cap,)
        assert idx.tolist() == (full[:nnz].tolist() + [0] * cap)[:cap]


def test_lengths_past_the_table_stay_in_bounds():
    """Lengths beyond max_pages * P are not checked (that would read them on
    the host); the row is cut to its max_pages pages, never read past them."""
    bt = torch.tensor([[4, 6], [8, 9]], dtype=torch.int32)
    sl = torch.tensor([100, 3], dtype=torch.int32)
    indptr, indices, _ = block_table_to_csr(bt, sl, 4)
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [4, 6, 8, 0]


# ------------------------------------------------------- CSR -> block table
def test_csr_to_block_table_by_hand():
    P = 4
    indptr = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)
    indices = torch.tensor([7, 2, 9, 5, 1, 8, 99, 98], dtype=torch.int32)  # past indptr[-1]: ignored
    last = torch.tensor([2, 3, 4, 1], dtype=torch.int32)  # row 1 is empty: its 3 is ignored
    bt, sl = csr_to_block_table(indptr, indices, last, P, max_pages=4)
    assert bt.tolist() == [[7, 2, 9, 0], [0, 0, 0, 0], [5, 0, 0, 0], [1, 8, 0, 0]]
    assert sl.tolist() == [2 * P + 2, 0, 4, P + 1]
    # Narrower than the widest row: that row keeps its first pages, and its
    # length stays the CSR's, so seq_lens > max_pages * P shows the cut.
    bt, sl = csr_to_block_table(indptr, indices, last, P, max_pages=2)
    assert bt.tolist() == [[7, 2], [0, 0], [5, 0], [1, 8]]
    assert sl.tolist() == [2 * P + 2, 0, 4, P + 1] and int(sl[0]) > 2 * P
    # indices shorter than indptr says: the missing pages read as 0.
    bt, _ = csr_to_block_table(indptr, indices[:5], last, P, max_pages=3)
    assert bt.tolist() == [[7, 2, 9], [0, 0, 0], [5, 0, 0], [1, 0, 0]]
    bt, sl = csr_to_block_table(torch.zeros(1, dtype=torch.int32), indices[:0], last[:0], P, max_pages=3)
    assert bt.shape == (0, 3) and sl.shape == (0,)


def test_no_value_is_read_on_the_host():
    """On meta tensors (shapes only, no values) every function runs, so none
    reads a value on the host: the output sizes come from shapes and
    arguments alone, as a CUDA graph capture needs."""
    meta = torch.device("meta")
    bt = torch.zeros(3, 5, dtype=torch.int32, device=meta)
    sl = torch.zeros(3, dtype=torch.int32, device=meta)
    indptr, indices, last = block_table_to_csr(bt, sl, 4, capacity=9)
    assert (indptr.shape, indices.shape, last.shape) == ((4,), (9,), (3,)) and indptr.is_meta
    bt2, sl2 = csr_to_block_table(indptr, indices, last, 4, max_pages=6)
    assert bt2.shape == (3, 6) and sl2.shape == (3,) and bt2.is_meta
    sel = Selection(torch.zeros(3, 2, 4, dtype=torch.int32, device=meta),
                    torch.zeros(3, 2, dtype=torch.int32, device=meta))
    out = selection_to_csr(sel, bt, sl, 4, return_logical=True)
    assert [t.shape for t in out] == [(7,), (24,), (6,), (24,)] and all(t.is_meta for t in out)
    with pytest.raises(Exception):  # the check above means something: meta values cannot be read
        indptr[-1].item()


# ------------------------------------------------------- Selection -> CSR
def _policies():
    out = []
    for pqh in (False, True):
        out += [
            Full(per_query_head=pqh),
            TopK(12, per_query_head=pqh),
            TopK(16, sinks=1, window=1, per_query_head=pqh),
            Gaussian(per_query_head=pqh),
            Certified(seed=TopK(8), per_query_head=pqh),
        ]
    return out


@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("policy", _policies(), ids=lambda p: f"{p.name}{'-pqh' if p.per_query_head else ''}")
def test_selection_to_csr_matches_the_selection(policy, P):
    lens, H, G = (61, 1, 37, 50), 2, 2
    cache, ids, q, _ = random_case(lens, H, G, 8, P, seed=5, device="cpu")
    sel = select(policy, q, cache, ids, alpha=1.5, scale=8 ** -0.5)
    bt, sl = cache.block_table[ids.long()], cache.seq_lens[ids.long()]
    B, S, W = sel.pages.shape
    assert S == (H * G if policy.per_query_head else H)
    indptr, indices, last, logical = selection_to_csr(sel, bt, sl, P, return_logical=True)
    assert indptr.dtype == indices.dtype == last.dtype == logical.dtype == torch.int32
    assert indptr.shape == (B * S + 1,) and indices.shape == logical.shape == (B * S * W,)

    want_ptr, want_phys, want_log, want_last = loop_selection_csr(sel, bt, sl, P)
    nnz = want_ptr[-1]
    assert indptr.tolist() == want_ptr and last.tolist() == want_last
    assert indices[:nnz].tolist() == want_phys and logical[:nnz].tolist() == want_log
    assert not indices[nnz:].any() and not logical[nnz:].any()
    # Every policy keeps the last page, so each row ends on the sequence's last page.
    assert last.tolist() == [(n - 1) % P + 1 for n in lens for _ in range(S)]
    if isinstance(policy, TopK):  # the test must see pages left out, not just Full
        assert nnz < S * sum(-(-n // P) for n in lens)

    # The tokens the CSR addresses are those of the selected pages, read
    # through the block table in ascending logical order.
    for b, heads in enumerate(page_sets(sel)):
        n = int(sl[b])
        for s, kept in enumerate(heads):
            r = b * S + s
            want = [cache.k_pages[int(bt[b, p]), :, : min(n - p * P, P)] for p in sorted(kept)]
            got = csr_tokens(cache.k_pages, indptr, indices, last, r, P)
            assert torch.equal(got, torch.cat(want, 1)), (b, s)
            assert got.shape[1] == sum(min(n - p * P, P) for p in kept)


def test_selection_order_and_padding_are_ignored():
    """A kernel may emit a row's pages in any order and leave anything in
    the padding: the CSR is the same."""
    P = 3
    cache, ids, q, _ = random_case((61, 1, 37, 50), 2, 2, 8, P, seed=6, device="cpu")
    sel = select(TopK(15), q, cache, ids, alpha=1.5, scale=8 ** -0.5)
    bt, sl = cache.block_table[ids.long()], cache.seq_lens[ids.long()]
    want = selection_to_csr(sel, bt, sl, P, return_logical=True)
    gen = torch.Generator().manual_seed(0)
    pages = torch.randint(0, 50, sel.pages.shape, generator=gen, dtype=torch.int32)
    for b in range(pages.shape[0]):
        for s in range(pages.shape[1]):
            c = int(sel.counts[b, s])
            pages[b, s, :c] = sel.pages[b, s, :c][torch.randperm(c, generator=gen)]
    assert not torch.equal(pages, sel.pages)
    got = selection_to_csr(Selection(pages, sel.counts.clone()), bt, sl, P, return_logical=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_selection_by_hand():
    """A hand-built selection whose last kept page is not the sequence's
    last: that page is full, so last_page_len is P; an empty row gives 0."""
    P = 4
    bt = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]], dtype=torch.int32)
    sl = torch.tensor([3 * P + 1, 2], dtype=torch.int32)
    pages = torch.tensor([[[2, 0, 9], [3, 1, 0]], [[0, 5, 5], [7, 7, 7]]], dtype=torch.int32)
    counts = torch.tensor([[2, 2], [1, 0]], dtype=torch.int32)
    indptr, indices, last, logical = selection_to_csr(Selection(pages, counts), bt, sl, P,
                                                      return_logical=True, capacity=7)
    assert indptr.tolist() == [0, 2, 4, 5, 5]
    assert indices.tolist() == [10, 12, 11, 13, 20, 0, 0]
    assert logical.tolist() == [0, 2, 1, 3, 0, 0, 0]
    assert last.tolist() == [P, 1, 2, 0]
    p2, idx2, l2 = selection_to_csr(Selection(pages, counts), bt, sl, P, capacity=3)
    assert torch.equal(p2, indptr) and idx2.tolist() == [10, 12, 11] and torch.equal(l2, last)


# ------------------------------------------------------------ bad input
def _bad_cases():
    bt = torch.zeros(3, 5, dtype=torch.int32)
    sl = torch.zeros(3, dtype=torch.int32)
    ip = torch.zeros(4, dtype=torch.int32)
    ix = torch.zeros(6, dtype=torch.int32)
    sel = Selection(torch.zeros(3, 2, 4, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32))
    meta = torch.device("meta")
    b2c, c2b, s2c = block_table_to_csr, csr_to_block_table, selection_to_csr
    return [
        (lambda: b2c(bt.long(), sl, 4), "block_table: expected an int32 tensor of shape \\[batch, max_pages\\]"),
        (lambda: b2c(bt[0], sl, 4), "block_table: expected an int32"),
        (lambda: b2c([[0]], sl, 4), "block_table: expected an int32"),
        (lambda: b2c(bt, sl[:2], 4), r"seq_lens: expected an int32 tensor of shape \[batch\] = \(3,\)"),
        (lambda: b2c(bt, sl.float(), 4), "seq_lens: expected an int32"),
        (lambda: b2c(bt, sl.to(meta), 4), "seq_lens: on meta, expected cpu"),
        (lambda: b2c(bt, sl, 0), "page_size: expected an int >= 1"),
        (lambda: b2c(bt, sl, 4.0), "page_size: expected an int >= 1"),
        (lambda: b2c(bt, sl, torch.tensor(4)), "page_size: expected an int"),
        (lambda: b2c(bt, sl, 4, capacity=-1), "capacity: expected an int in \\[0, "),
        (lambda: b2c(bt, sl, 4, capacity=True), "capacity: expected an int"),
        (lambda: c2b(ip.long(), ix, sl, 4, max_pages=5), "indptr: expected an int32"),
        (lambda: c2b(ip[:0], ix, sl[:0], 4, max_pages=5), "indptr: .*at least 1 entry"),
        (lambda: c2b(ip, ix[None], sl, 4, max_pages=5), r"indices: expected an int32 tensor of shape \[nnz_max\]"),
        (lambda: c2b(ip, ix.to(meta), sl, 4, max_pages=5), "indices: on meta, expected cpu"),
        (lambda: c2b(ip, ix, sl[:2], 4, max_pages=5), r"last_page_len: expected .* \(3,\)"),
        (lambda: c2b(ip, ix, sl, 4, max_pages=-1), "max_pages: expected an int in \\[0, "),
        (lambda: c2b(ip, ix, sl, 4, max_pages=None), "max_pages: expected an int"),
        (lambda: c2b(ip, ix, sl, -2, max_pages=5), "page_size: expected an int >= 1"),
        (lambda: s2c((sel.pages, sel.counts), bt, sl, 4), "sel: expected an entmaxkv.Selection"),
        (lambda: s2c(Selection(sel.pages[:2], sel.counts[:2]), bt, sl, 4),
         r"sel.pages: expected an int32 tensor of shape \[batch, sel_heads, width\]"),
        (lambda: s2c(Selection(sel.pages.long(), sel.counts), bt, sl, 4), "sel.pages: expected an int32"),
        (lambda: s2c(Selection(sel.pages, sel.counts[:, :1]), bt, sl, 4),
         r"sel.counts: expected an int32 tensor of shape \[batch, sel_heads\] = \(3, 2\)"),
        (lambda: s2c(Selection(sel.pages.to(meta), sel.counts), bt, sl, 4), "sel.pages: on meta, expected cpu"),
        (lambda: s2c(sel, bt.float(), sl, 4), "block_table: expected an int32"),
        (lambda: s2c(sel, bt, sl[:1], 4), "seq_lens: expected an int32"),
        (lambda: s2c(sel, bt, sl, 0), "page_size: expected an int >= 1"),
        (lambda: s2c(sel, bt, sl, 4, capacity=2.5), "capacity: expected an int"),
        (lambda: s2c(sel, bt, sl, 4, return_logical=1), "return_logical: expected True or False"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case):
    call, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_replay():
    """All three run inside a CUDA graph capture (no host synchronisation);
    replayed over new lengths and selections, they equal eager calls."""
    P, B, M, S, W = 16, 4, 64, 2, 8
    dev = torch.device("cuda")
    bt = torch.randperm(B * M, device=dev).view(B, M).to(torch.int32)
    sl = torch.zeros(B, dtype=torch.int32, device=dev)
    pages = torch.zeros(B, S, W, dtype=torch.int32, device=dev)
    counts = torch.zeros(B, S, dtype=torch.int32, device=dev)
    sel = Selection(pages, counts)

    def step():
        csr = block_table_to_csr(bt, sl, P, capacity=B * M)
        back = csr_to_block_table(*csr, P, max_pages=M)
        return csr + back + selection_to_csr(sel, bt, sl, P, return_logical=True)

    gen = torch.Generator().manual_seed(0)

    def refill():
        n = torch.randint(1, M * P + 1, (B,), generator=gen)
        sl.copy_(n.to(torch.int32))
        for b in range(B):
            npages = -(-int(n[b]) // P)
            for s in range(S):
                c = min(W, npages)
                keep = torch.randperm(npages, generator=gen)[:c]
                keep[0] = npages - 1 if (keep != npages - 1).all() else keep[0]
                pages[b, s].zero_()
                pages[b, s, :c] = keep.to(torch.int32)
                counts[b, s] = c

    refill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(5):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)
