"""One layer's paged KV cache as plain tensors: what the functional ops read.

``PagedKV`` bundles the tensors of the layout in docs/contracts.md; it owns
nothing and copies nothing, so an engine can hand over its own buffers
(``PagedKV.from_buffers``), strided views included, e.g. vLLM-style pages
``[num_blocks, H, P, 2 * D]`` with K and V side by side in the last dim
(``split_packed``), or opaque pages that hold the statistics too
(``stats_in_pages``: an engine that sizes its pages by ``row_width`` keeps
all of a page's bytes in its own allocator). ``PagedKVCache`` is a
host-side owner of such tensors (``cache.layer(i)``).

Shapes (N pages, H KV heads, P page size, D head dim, R block-table rows,
M logical pages per row):

    k_pages, v_pages   [N, H, P, D]   storage dtype, any strides, head_dim contiguous
    k_bounds           [N, H, 2, D]   storage dtype: (min, max) of a page's keys
    k_moments          [N, H, 2, D]   storage dtype: (mean, population std)
    welford            [N, H, 2, D]   float32 running (mean, M2), or None (read-only)
    block_table        [R, M]         int32, contiguous: physical page of each logical page
    seq_lens           [R]            int32: tokens held by each row
    positions          [R, 2]         int32 (query position, position of the row's first token), or None
    pos_stride         int            positions between consecutive pages of a row (default P)
    sketch             KeySketch      optional per-token key sketches (entmaxkv.sketch), or None

``positions`` makes the rows shards of longer sequences (context
parallelism, ``entmaxkv.distributed``): stored token t of a row sits at
global position ``first + (t // P) * pos_stride + t % P`` and the query at
``positions[row, 0]``, which is what ALiBi biases use. Without it a row
holds positions 0 .. seq_len - 1 and its query sits at seq_len - 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ._checks import describe

__all__ = ["PageShape", "PagedKV", "STORAGE_DTYPES", "check_rows", "row_width", "split_packed", "stats_in_pages"]

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stats_buffer(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed [N, H, 2, D] statistics buffer for pages ``like`` [N, H, P, D]."""
    N, H, _, D = like.shape
    with torch.inference_mode(False):  # writable outside inference mode too
        return torch.zeros(N, H, 2, D, dtype=dtype, device=like.device)


class PageShape:
    """Sizes read off ``k_pages`` [num_pages, kv_heads, page_size, head_dim]
    (shared by a one-layer view and the cache that owns the pages)."""

    k_pages: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype


@dataclass(frozen=True)
class PagedKV(PageShape):
    """The tensors of one layer's paged KV cache (see the module docstring).

    Token ``j`` of block-table row ``r`` lives at
    ``k_pages[block_table[r, j // P], :, j % P, :]``. The statistics of a
    page describe its first ``min(P, seq_len - page_start)`` rows; the
    selection policies read them instead of the keys.

    ``block_table`` and ``seq_lens`` may be None for a layer whose rows come
    from elsewhere (a ``Decoder`` plan supplies them); the functional ops
    need them.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_bounds: torch.Tensor
    k_moments: torch.Tensor
    block_table: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    welford: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    pos_stride: Optional[int] = None
    sketch: Optional[object] = None  # a sketch.KeySketch: per-token key sketches of these pages

    # ------------------------------------------------------------ views
    @property
    def k_min(self) -> torch.Tensor:
        return self.k_bounds[:, :, 0]

    @property
    def k_max(self) -> torch.Tensor:
        return self.k_bounds[:, :, 1]

    @property
    def k_mean(self) -> torch.Tensor:
        return self.k_moments[:, :, 0]

    @property
    def k_std(self) -> torch.Tensor:
        return self.k_moments[:, :, 1]

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    def with_rows(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  positions: Optional[torch.Tensor] = None, pos_stride: Optional[int] = None) -> "PagedKV":
        """The same pages and statistics under another block table, lengths
        and (optionally) position table."""
        return dataclasses.replace(self, block_table=block_table, seq_lens=seq_lens, positions=positions,
                                   pos_stride=pos_stride)

    # ------------------------------------------------------------ checks
    def check(self, *, rows: bool = True, writable: bool = False) -> "PagedKV":
        """Validate shapes, dtypes, devices and strides; return self.

        ``rows``: also check ``block_table`` / ``seq_lens``; ``writable``:
        also check ``welford`` (the writes need it). Raises ValueError
        naming the field and what was expected.
        """
        k, v = self.k_pages, self.v_pages
        for name in ("k_pages", "v_pages"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a [num_pages, kv_heads, page_size, head_dim] tensor, "
                                 f"got {describe(t)}")
            if t.dtype not in STORAGE_DTYPES:
                raise ValueError(f"{name}: expected one of {STORAGE_DTYPES}, got {t.dtype}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 1), got strides "
                                 f"{t.stride()}")
        if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
            raise ValueError(f"v_pages: expected shape {tuple(k.shape)}, dtype {k.dtype} on {k.device} "
                             f"(those of k_pages), got {describe(v)} on {v.device}")
        if not 1 <= k.shape[2] <= 256:
            raise ValueError(f"k_pages: page_size (dim 2) must be in 1..256, got {k.shape[2]}")
        N, H, _, D = k.shape
        stats = [("k_bounds", self.k_bounds, k.dtype), ("k_moments", self.k_moments, k.dtype)]
        if writable or self.welford is not None:
            stats.append(("welford", self.welford, torch.float32))
        for name, t, dt in stats:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (N, H, 2, D) or t.dtype != dt:
                raise ValueError(f"{name}: expected a {dt} tensor of shape ({N}, {H}, 2, {D}), got {describe(t)}")
            if t.device != k.device:
                raise ValueError(f"{name}: on {t.device}, but k_pages is on {k.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 1)")
        if rows:
            check_rows(self.block_table, self.seq_lens, k.device, "k_pages's device")
        if self.positions is not None:
            pos = self.positions
            R = self.block_table.shape[0] if self.block_table is not None else None
            if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int32 or pos.dim() != 2 or pos.shape[1] != 2 \
                    or not pos.is_contiguous() or (R is not None and pos.shape[0] != R) or pos.device != k.device:
                raise ValueError(f"positions: expected a contiguous int32 tensor [rows, 2] on {k.device}, got "
                                 f"{describe(pos)}")
            if self.pos_stride is not None and (isinstance(self.pos_stride, bool) or not isinstance(
                    self.pos_stride, int) or self.pos_stride < self.page_size):
                raise ValueError(f"pos_stride: expected an int >= page_size ({self.page_size}), got "
                                 f"{self.pos_stride!r}")
        return self

    # ------------------------------------------------------------ building
    @classmethod
    def from_buffers(
        cls,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        block_table: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        *,
        k_bounds: Optional[torch.Tensor] = None,
        k_moments: Optional[torch.Tensor] = None,
        welford: Optional[torch.Tensor] = None,
    ) -> "PagedKV":
        """Wrap engine-owned buffers; statistics buffers not given are allocated (zeros).

        Zeroed statistics describe empty pages: write every token through
        ``entmaxkv.ops.write_kv`` (which maintains them), or fill them from
        pages that already hold data with ``entmaxkv.ops.refresh_stats``.

        Args:
            k_pages, v_pages: [num_pages, kv_heads, page_size, head_dim]
                float32/float16/bfloat16, head_dim contiguous (views of a
                packed buffer are fine: ``split_packed``).
            block_table: int32 [rows, max_pages] or None; seq_lens: int32
                [rows] or None.
            k_bounds, k_moments: [num_pages, kv_heads, 2, head_dim] in the
                pages' dtype; welford: float32, same shape.
        """
        if isinstance(k_pages, torch.Tensor) and k_pages.dim() == 4:
            k_bounds = _stats_buffer(k_pages, k_pages.dtype) if k_bounds is None else k_bounds
            k_moments = _stats_buffer(k_pages, k_pages.dtype) if k_moments is None else k_moments
            welford = _stats_buffer(k_pages, torch.float32) if welford is None else welford
        kv = cls(k_pages, v_pages, k_bounds, k_moments, block_table, seq_lens, welford)
        return kv.check(rows=block_table is not None or seq_lens is not None, writable=True)


def check_rows(block_table, seq_lens, device: torch.device, where: str) -> None:
    """Validate a block table (int32 [rows, max_pages], contiguous) and its
    lengths (int32 [rows]) on ``device`` (``where`` names it in the error);
    ValueError naming the argument otherwise."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table: expected an int32 tensor [rows, max_pages], got {describe(block_table)}")
    if not block_table.is_contiguous():
        raise ValueError("block_table: expected a contiguous tensor")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens: expected an int32 tensor [rows], got {describe(seq_lens)}")
    if seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens: expected {block_table.shape[0]} entries (one per block_table row), "
                         f"got {seq_lens.shape[0]}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} ({where}), got {t.device}")


def split_packed(kv_pages: torch.Tensor):
    """(k_pages, v_pages) views of a packed page buffer ``[num_pages, H, P, 2 * D]``
    (K in the first half of the last dim, V in the second: one write per token
    row, as vLLM-style backends lay them out). No copy."""
    if not isinstance(kv_pages, torch.Tensor) or kv_pages.dim() != 4 or kv_pages.shape[-1] % 2:
        raise ValueError(f"kv_pages: expected a [num_pages, kv_heads, page_size, 2 * head_dim] tensor, "
                         f"got {describe(kv_pages)}")
    if kv_pages.stride(-1) != 1:
        raise ValueError("kv_pages: the last dim must be contiguous (stride 1)")
    D = kv_pages.shape[-1] // 2
    return kv_pages[..., :D], kv_pages[..., D:]


def _stats_elems(head_dim: int, dtype: torch.dtype) -> int:
    """Storage-dtype elements of one page-head's statistics: bounds and
    moments (2 x head_dim each) and the float32 running (mean, M2)."""
    return 4 * head_dim + (8 * head_dim) // torch.tensor([], dtype=dtype).element_size()


def row_width(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Elements per token row of a page that holds K, V and the page's
    statistics (``stats_in_pages``): ``2 * head_dim`` plus the statistics
    spread over the page's rows, rounded so that a page-head stays a whole
    number of float32 words. Bytes per token: ``row_width * itemsize``.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype: expected one of {STORAGE_DTYPES}, got {dtype}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 256:
        raise ValueError(f"page_size: expected an int in 1..256, got {page_size!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {head_dim!r}")
    width = 2 * head_dim + -(-_stats_elems(head_dim, dtype) // page_size)
    words = 4 // torch.tensor([], dtype=dtype).element_size()  # elements per float32 word
    while (page_size * width) % words:
        width += 1
    return width


def stats_in_pages(pages: torch.Tensor, head_dim: int) -> PagedKV:
    """A ``PagedKV`` whose K, V and statistics all live in ``pages``.

    ``pages`` is [num_pages, kv_heads, page_size, row_width] (``row_width``
    of these sizes or wider), each page-head's rows contiguous (strides
    ``(*, *, row_width, 1)``), e.g. an engine's own page buffer. Each
    page-head region of ``page_size * row_width`` elements is read as: K
    rows [page_size, head_dim], V rows, (min, max) [2, head_dim], (mean,
    std) [2, head_dim], then the float32 running (mean, M2) [2, head_dim].
    Views only, no copy. Zeroed pages are empty pages: write every token
    with ``entmaxkv.ops.write_kv``.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4 or pages.dtype not in STORAGE_DTYPES:
        raise ValueError(f"pages: expected a float32/float16/bfloat16 tensor [num_pages, kv_heads, page_size, "
                         f"row_width], got {describe(pages)}")
    N, H, P, C = pages.shape
    need = row_width(P, head_dim, pages.dtype) if 1 <= P <= 256 else None
    if need is None or C < need:
        raise ValueError(f"pages: rows of {C} elements cannot hold K, V and the statistics of a page of {P} "
                         f"tokens with head_dim {head_dim} (row_width gives {need})")
    sN, sH, sP, sC = pages.stride()
    if sC != 1 or sP != C:
        raise ValueError(f"pages: expected each page-head's rows contiguous (strides (*, *, {C}, 1)), got "
                         f"{pages.stride()}")
    D, off = head_dim, pages.storage_offset()
    item = pages.element_size()

    def view(at: int, rows: int, dtype=pages.dtype, base=pages, unit=1) -> torch.Tensor:
        return torch.as_strided(base, (N, H, rows, D), (sN // unit, sH // unit, D, 1), (off + at) // unit)

    k, v = view(0, P), view(P * D, P)
    bounds, moments = view(2 * P * D, 2), view(2 * P * D + 2 * D, 2)
    unit = 4 // item  # storage elements per float32 word
    at = 2 * P * D + 4 * D
    if item < 4 and ((off + at) % unit or sN % unit or sH % unit):
        raise ValueError(f"pages: the float32 statistics need 4-byte aligned page-heads (offset {off}, strides "
                         f"{pages.stride()} in {pages.dtype} elements)")
    words = torch.empty(0, dtype=torch.float32, device=pages.device).set_(pages.untyped_storage())
    welford = view(at, 2, base=words, unit=unit)
    return PagedKV(k, v, bounds, moments, welford=welford).check(rows=False, writable=True)
