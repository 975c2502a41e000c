"""Page tables in FlashInfer's CSR form, and a Selection as one.

A paged-attention kernel of an engine (FlashInfer, and the engines built on
it) does not take a block table: it takes the pages of each request as a
compressed sparse row (CSR) list. For ``R`` requests and page size ``P``:

- ``indptr``: int32 ``[R + 1]``, ``indptr[0] = 0``, non-decreasing; the
  pages of request ``r`` are ``indices[indptr[r] : indptr[r + 1]]``, so
  ``indptr[R]`` is the number of valid entries (``nnz``).
- ``indices``: int32 ``[capacity]``, physical page ids, each request's
  pages in the order the kernel reads them; entries at positions
  ``>= indptr[R]`` are padding (0) and must be ignored.
- ``last_page_len``: int32 ``[R]``, valid tokens in the request's last
  page: in ``1 .. P`` for a request with at least one page; every other
  page is full. A request with no pages has length 0 whatever its
  ``last_page_len`` (FlashInfer reads it as such); the functions here
  write 0 there.

The length of request ``r`` is ``(indptr[r+1] - indptr[r] - 1) * P +
last_page_len[r]`` when it has pages, else 0.

No function here reads a tensor value on the host, so all of them can run
inside a CUDA graph capture. That fixes every output size from shapes or
arguments; the one data-dependent size, ``nnz``, is bounded by
``capacity`` (see each function). Values are not range-checked, since that
would need the host to read them: out-of-range values give unspecified
(but in-bounds) results, never an out-of-bounds read or write.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ._checks import as_bool, as_int, describe
from .types import Selection

__all__ = ["block_table_to_csr", "csr_to_block_table", "selection_to_csr"]

# The largest int32: CSR offsets and page ids are int32.
_INT32_MAX = 2 ** 31 - 1

Dim = Tuple[str, Optional[int]]


def _shape_text(dims: Sequence[Dim]) -> str:
    labels = ", ".join(label for label, _ in dims)
    if all(size is not None for _, size in dims):
        return f"[{labels}] = {tuple(size for _, size in dims)}"
    return f"[{labels}]"


def _int32_tensor(value, name: str, dims: Sequence[Dim], device: Optional[torch.device] = None,
                  device_of: str = "") -> torch.Tensor:
    """``value`` when it is an int32 tensor of the shape ``dims`` (a None size
    is free) on ``device``, else ValueError naming ``name``. Reads only the
    tensor's metadata."""
    ok = (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.int32
        and value.dim() == len(dims)
        and all(size is None or value.shape[i] == size for i, (_, size) in enumerate(dims))
    )
    if not ok:
        raise ValueError(f"{name}: expected an int32 tensor of shape {_shape_text(dims)}, got {describe(value)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: on {value.device}, expected {device} (the device of {device_of})")
    return value


def _capacity(capacity, default: int) -> int:
    if capacity is None:
        return default
    return as_int(capacity, "capacity", lo=0, hi=_INT32_MAX)


def _pack(tables: Sequence[torch.Tensor], npages: torch.Tensor, capacity: int):
    """Rows of fixed-width tables -> CSR.

    ``tables``: int64 ``[R, W]`` each (same shape), row ``r`` valid in its
    first ``npages[r]`` columns (int64 ``[R]``, in ``0 .. W``). Returns
    (indptr int32 ``[R + 1]``, one int32 ``[capacity]`` per table): entry
    ``i < indptr[R]`` is column ``i - indptr[r]`` of row ``r``, the row with
    ``indptr[r] <= i < indptr[r + 1]``; later entries and entries past
    ``capacity`` are 0 / dropped.
    """
    R, W = tables[0].shape
    device = npages.device
    indptr = torch.zeros(R + 1, dtype=torch.int64, device=device)
    torch.cumsum(npages, 0, out=indptr[1:])
    if R == 0 or W == 0 or capacity == 0:
        flat = [torch.zeros(capacity, dtype=torch.int32, device=device) for _ in tables]
        return indptr.to(torch.int32), flat
    # Each output entry finds its row by binary search on the row ends: the
    # work is fixed by the capacity, and no count is read on the host.
    i = torch.arange(capacity, dtype=torch.int64, device=device)
    row = torch.searchsorted(indptr[1:], i, right=True)
    valid = row < R
    row = row.clamp(max=R - 1)
    col = (i - indptr[row]).clamp(0, W - 1)
    flat = [torch.where(valid, t[row, col], 0).to(torch.int32) for t in tables]
    return indptr.to(torch.int32), flat


def block_table_to_csr(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    capacity: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block table as FlashInfer's paged-KV CSR (``paged_kv_indptr``,
    ``paged_kv_indices``, ``paged_kv_last_page_len``).

    Sequence ``b`` of length ``n = seq_lens[b]`` uses its logical pages
    ``0 .. ceil(n / P) - 1``; they become request ``b``'s pages, in logical
    order: ``indices[indptr[b] + j] = block_table[b, j]``.

    Args:
        block_table: int32 ``[B, max_pages]``: physical page of each logical
            page (any strides; for a ``PagedKVCache`` and slots ``ids``,
            ``cache.block_table[ids]``).
        seq_lens: int32 ``[B]`` on the same device: tokens per sequence, in
            ``0 .. max_pages * page_size`` (not checked: that would read the
            values; a longer one is cut to ``max_pages`` pages).
        page_size: int >= 1, tokens per page ``P``.
        capacity: int >= 0, the length of ``indices``; default
            ``B * max_pages``, enough for any lengths. The number of valid
            entries ``nnz = sum ceil(n / P)`` depends on the data; a cache's
            ``num_pages`` also bounds it (a page belongs to one sequence).
            Entries past ``capacity`` are dropped (``indptr`` still counts
            them, so ``indptr[-1] > capacity`` tells, on the device).

    Returns:
        (indptr int32 ``[B + 1]``, indices int32 ``[capacity]`` with padding
        0 after ``indptr[-1]``, last_page_len int32 ``[B]``: ``(n - 1) % P +
        1``, in ``1 .. P``, for ``n > 0`` and 0 for an empty sequence), all on
        the block table's device.
    """
    _int32_tensor(block_table, "block_table", (("batch", None), ("max_pages", None)))
    B, M = block_table.shape
    _int32_tensor(seq_lens, "seq_lens", (("batch", B),), block_table.device, "block_table")
    P = as_int(page_size, "page_size", lo=1)
    cap = _capacity(capacity, B * M)
    n = seq_lens.long().clamp(min=0)
    npages = torch.div(n + (P - 1), P, rounding_mode="floor").clamp(max=M)
    last = torch.where(n > 0, (n - 1) % P + 1, 0).to(torch.int32)
    indptr, (indices,) = _pack([block_table.long()], npages, cap)
    return indptr, indices, last


def csr_to_block_table(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    *,
    max_pages: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV CSR as a block table, the inverse of
    ``block_table_to_csr``.

    Args:
        indptr: int32 ``[B + 1]``, ``indptr[0] = 0``, non-decreasing (a row
            with ``indptr[b+1] <= indptr[b]`` is read as empty).
        indices: int32 ``[nnz_max]`` (any length >= ``indptr[-1]``; offsets
            past its end read as missing pages, 0), same device.
        last_page_len: int32 ``[B]``, same device: valid tokens in each
            request's last page, ``1 .. P`` (ignored for an empty request).
        page_size: int >= 1, tokens per page ``P``.
        max_pages: int >= 0, the block table's width. The widest row is a
            data-dependent size, so the caller gives it (e.g. the cache's
            ``max_pages_per_seq``). A row with more pages keeps its first
            ``max_pages``; its ``seq_lens`` entry still gives the CSR length,
            so ``seq_lens > max_pages * P`` tells, on the device.

    Returns:
        (block_table int32 ``[B, max_pages]``: the request's pages in CSR
        order, unused entries 0, as ``PagedKVCache`` keeps them; seq_lens
        int32 ``[B]``: ``(pages - 1) * P + last_page_len``, 0 for a request
        with no pages), on ``indptr``'s device.
    """
    _int32_tensor(indptr, "indptr", (("batch + 1", None),))
    if indptr.shape[0] < 1:
        raise ValueError(f"indptr: expected an int32 tensor of shape [batch + 1] (at least 1 entry), "
                         f"got {describe(indptr)}")
    B = indptr.shape[0] - 1
    device = indptr.device
    _int32_tensor(indices, "indices", (("nnz_max", None),), device, "indptr")
    _int32_tensor(last_page_len, "last_page_len", (("batch", B),), device, "indptr")
    P = as_int(page_size, "page_size", lo=1)
    M = as_int(max_pages, "max_pages", lo=0, hi=_INT32_MAX)
    start = indptr[:-1].long()
    npages = (indptr[1:].long() - start).clamp(min=0)
    nnz = indices.shape[0]
    if nnz == 0 or M == 0 or B == 0:
        block_table = torch.zeros(B, M, dtype=torch.int32, device=device)
    else:
        col = torch.arange(M, dtype=torch.int64, device=device)
        src = start[:, None] + col
        valid = (col < npages[:, None]) & (src >= 0) & (src < nnz)
        block_table = torch.where(valid, indices[src.clamp(0, nnz - 1)], 0).to(torch.int32)
    seq_lens = torch.where(npages > 0, (npages - 1) * P + last_page_len.long(), 0).to(torch.int32)
    return block_table, seq_lens


def selection_to_csr(
    sel: Selection,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    capacity: Optional[int] = None,
    return_logical: bool = False,
) -> Union[Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The pages a Selection keeps, as FlashInfer's paged-KV CSR, so that an
    engine's paged attention kernel can run over just those pages.

    Rows: one CSR request per (batch row, selection head), row
    ``r = b * S + s`` for batch row ``b`` and selection head ``s`` (``S =
    sel.sel_heads``: KV head ``s`` when the selection is per KV head, query
    head ``s`` with ``per_query_head``), so ``R = B * S`` rows.

    Page order: a row's pages are its ``sel.counts[b, s]`` valid entries
    sorted by ascending logical page (a Selection's order is unspecified),
    each mapped to its physical page ``block_table[b, page]``. The kept
    tokens keep their sequence order, and the last page of the sequence,
    which every policy keeps, comes last.

    Last page: ``last_page_len[r]`` is the valid tokens of the row's last
    kept page, ``clamp(n - page * P, 0, P)`` for sequence length ``n``; for
    a policy's selection that is the sequence's last page, ``(n - 1) % P +
    1``. Only that page may be partial, so every earlier kept page is full
    and the FlashInfer length formula counts exactly the kept tokens. A row
    with no pages gets 0.

    Positions: a kernel that numbers the tokens of a request ``0, 1, ...``
    sees the kept tokens packed, not at their sequence positions; with
    ``return_logical`` the logical page of each entry comes back too, so
    token ``t`` of entry ``i`` is at position ``logical[i] * P + t`` (what
    a positional bias such as ALiBi needs).

    Padding: entries of ``indices`` (and ``logical``) at positions
    ``>= indptr[R]`` are 0 and must be ignored.

    Args:
        sel: a Selection with ``pages`` int32 ``[B, S, W]`` (valid entries
            distinct logical pages below the sequence's page count, as every
            policy gives; not checked, since that would read the values) and
            ``counts`` int32 ``[B, S]`` in ``0 .. W``, on the block table's
            device. ``tau_hat`` is not used; ``pending`` needs no care: the
            operations here are ordinary launches, which wait for the
            selection's kernel to finish.
        block_table: int32 ``[B, max_pages]``, row ``b`` the block table of
            batch row ``b`` (for a ``PagedKVCache`` and the ``seq_ids`` the
            selection was made for, ``cache.block_table[seq_ids]``).
        seq_lens: int32 ``[B]`` (``cache.seq_lens[seq_ids]``), same device.
        page_size: int >= 1, tokens per page ``P``.
        capacity: int >= 0, the length of ``indices``; default ``B * S *
            W``, enough for any selection of this width (for TopK, ``W`` is
            the page budget). The number of valid entries, ``sum(counts)``,
            depends on the data; ``S`` times the pages in use also bounds
            it. Entries past ``capacity`` are dropped (``indptr[-1] >
            capacity`` tells, on the device).
        return_logical: bool; also return ``logical`` (see Returns).

    Returns:
        (indptr int32 ``[R + 1]``, indices int32 ``[capacity]``,
        last_page_len int32 ``[R]``) and, with ``return_logical``, logical
        int32 ``[capacity]``: the logical page of each entry of ``indices``.
        All on the block table's device.
    """
    if not isinstance(sel, Selection):
        raise ValueError(f"sel: expected an entmaxkv.Selection, got {describe(sel)}")
    _int32_tensor(block_table, "block_table", (("batch", None), ("max_pages", None)))
    B, M = block_table.shape
    device = block_table.device
    _int32_tensor(seq_lens, "seq_lens", (("batch", B),), device, "block_table")
    _int32_tensor(sel.pages, "sel.pages", (("batch", B), ("sel_heads", None), ("width", None)), device,
                  "block_table")
    S, W = sel.pages.shape[1], sel.pages.shape[2]
    _int32_tensor(sel.counts, "sel.counts", (("batch", B), ("sel_heads", S)), device, "block_table")
    P = as_int(page_size, "page_size", lo=1)
    cap = _capacity(capacity, B * S * W)
    return_logical = as_bool(return_logical, "return_logical")

    R = B * S
    if M == 0 or W == 0:
        # No page can be valid: every row is empty.
        logical = physical = torch.zeros(R, W, dtype=torch.int64, device=device)
        count = torch.zeros(R, dtype=torch.int64, device=device)
        last = torch.zeros(R, dtype=torch.int32, device=device)
    else:
        count = sel.counts.long().clamp(0, W)  # [B, S]
        entry = torch.arange(W, device=device)
        valid = entry < count[..., None]
        # Sort the valid entries to the front, ascending; padding (key M)
        # sorts after every page. The clamp keeps a bad page id in bounds.
        key = torch.where(valid, sel.pages.long().clamp(0, M - 1), M)
        logical = key.sort(dim=-1).values.clamp(max=M - 1)  # [B, S, W]
        physical = block_table.long().gather(1, logical.view(B, S * W)).view(B, S, W)
        last_page = logical.gather(-1, (count - 1).clamp(min=0)[..., None])[..., 0]  # [B, S]
        n = seq_lens.long()[:, None]
        last = torch.where(count > 0, (n - last_page * P).clamp(0, P), 0).to(torch.int32)
        logical, physical = logical.view(R, W), physical.view(R, W)
        count, last = count.view(R), last.view(R)
    indptr, (indices, logical_flat) = _pack([physical, logical], count, cap)
    if return_logical:
        return indptr, indices, last, logical_flat
    return indptr, indices, last
