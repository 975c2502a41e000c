"""Which rank holds which page, and a cache that holds one rank's share.

A sequence's logical pages are split over the ranks of a process group:

- ``contiguous``: rank r holds pages [r * span, (r + 1) * span), span =
  ceil(max pages per sequence / ranks): a long prompt fills rank 0 first;
- ``interleaved``: page g lives on rank g % ranks (round-robin), so every
  rank holds about the same share of any sequence and new pages rotate.

Each rank stores its pages of a sequence as one local sequence, in global
order, in an ordinary ``PagedKVCache``; a position table (``layout.PagedKV.positions``:
the query's global position and the global position of the rank's first
stored token, with ``pos_stride`` positions between consecutive local pages)
gives every stored token its global position, which ALiBi needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from .._checks import as_choice, as_int, describe
from ..cache import PagedKVCache
from ..layout import PagedKV

__all__ = ["LAYOUTS", "Sharding", "ShardedCache", "to_device"]

LAYOUTS = ("contiguous", "interleaved")


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or NumPy array) as a tensor on ``device`` without
    making the host wait (pinned memory, asynchronous copy)."""
    t = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass(frozen=True)
class Sharding:
    """The page-to-rank map of one rank (see the module docstring).

    Attributes:
        ranks: ranks in the group; rank: this one; layout: "contiguous" or
        "interleaved"; span: pages per rank (a sequence's share on one rank
        holds at most span pages); page_size: tokens per page.
    """

    ranks: int
    rank: int
    layout: str
    span: int
    page_size: int

    @property
    def base(self) -> int:
        """Global position of the first token this rank can hold."""
        if self.layout == "contiguous":
            return self.rank * self.span * self.page_size
        return self.rank * self.page_size

    @property
    def stride(self) -> int:
        """Global positions between consecutive local pages."""
        return self.page_size if self.layout == "contiguous" else self.ranks * self.page_size

    def owner(self, page: int) -> int:
        """The rank holding global page ``page``."""
        return page // self.span if self.layout == "contiguous" else page % self.ranks

    def local_tokens(self, n: int) -> int:
        """Tokens of an n-token sequence stored on this rank."""
        P = self.page_size
        if self.layout == "contiguous":
            return min(max(n - self.base, 0), self.span * P)
        full, rem = divmod(n, P)
        pages = max(0, -(-(full - self.rank) // self.ranks))  # full pages g < full with g % ranks == rank
        return pages * P + (rem if full % self.ranks == self.rank else 0)

    def owned(self, start: int, n: int) -> np.ndarray:
        """bool [n]: which of positions start .. start+n-1 this rank stores."""
        pages = np.arange(start, start + n, dtype=np.int64) // self.page_size
        owner = pages // self.span if self.layout == "contiguous" else pages % self.ranks
        return owner == self.rank

    def global_page(self, local: torch.Tensor) -> torch.Tensor:
        """Global page of local logical pages ``local`` (any int tensor)."""
        if self.layout == "contiguous":
            return local + self.rank * self.span
        return local * self.ranks + self.rank

    def local_page(self, page: torch.Tensor) -> torch.Tensor:
        """Local logical page of global pages ``page`` this rank holds (others: undefined)."""
        if self.layout == "contiguous":
            return page - self.rank * self.span
        return page // self.ranks


class ShardedCache:
    """One rank's share of a context-parallel KV cache (every rank builds one,
    with the same arguments, and calls the same methods in the same order).

    Every rank runs the model's dense layers, so every rank sees every new
    token's K/V; each stores the tokens of the pages it owns. Slot ids,
    lengths and page ownership follow from the calls alone, so no write
    communicates.

    Args:
        num_pages: physical pages of this rank's pool.
        page_size, kv_heads, head_dim, num_layers, dtype, device: as for
            ``PagedKVCache``.
        max_seqs: sequence slots.
        max_len: the longest sequence (global tokens) a slot can hold.
        layout: "contiguous" or "interleaved" (module docstring).
        group: the process group (None: the default group).
    """

    def __init__(self, *, num_pages: int, page_size: int, kv_heads: int, head_dim: int, max_seqs: int,
                 max_len: int, layout: str = "contiguous", num_layers: int = 1,
                 dtype: torch.dtype = torch.float16, device: Union[str, torch.device] = "cpu", group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
        as_choice(layout, "layout", LAYOUTS)
        page_size = as_int(page_size, "page_size", lo=1, hi=256)
        max_len = as_int(max_len, "max_len", lo=1)
        self.group = group
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        total = -(-max_len // page_size)
        span = -(-total // ranks)
        self.sharding = Sharding(ranks, rank, layout, span, page_size)
        self.max_len = max_len
        self.local = PagedKVCache(num_pages, page_size, kv_heads, head_dim, max_seqs=max_seqs,
                                  max_pages_per_seq=span, dtype=dtype, device=device, num_layers=num_layers)
        with torch.inference_mode(False):
            # (query position, global position of this rank's first stored token) per slot
            self.positions = torch.zeros(max_seqs, 2, dtype=torch.int32, device=self.local.device)
        self._glen: List[int] = [0] * max_seqs
        self._views = [None] * num_layers

    # ------------------------------------------------------------------ shape
    @property
    def page_size(self) -> int:
        return self.local.page_size

    @property
    def kv_heads(self) -> int:
        return self.local.kv_heads

    @property
    def head_dim(self) -> int:
        return self.local.head_dim

    @property
    def num_layers(self) -> int:
        return self.local.num_layers

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def max_seqs(self) -> int:
        return self.local.max_seqs

    @property
    def max_pages_per_seq(self) -> int:
        """Pages of the longest sequence a slot holds (globally)."""
        return -(-self.max_len // self.page_size)

    def layer(self, index: int = 0) -> PagedKV:
        """This rank's pages of layer ``index``, with the position table."""
        lay = self.local.layer(index)
        if self._views[index] is None:
            self._views[index] = lay.with_rows(lay.block_table, lay.seq_lens, self.positions,
                                               self.sharding.stride)
        return self._views[index]

    def length(self, seq: int) -> int:
        """Global tokens of sequence ``seq`` (host mirror)."""
        return self._glen[self.local._check_seq(seq, "seq")]

    def active_seqs(self) -> List[int]:
        return self.local.active_seqs()

    # ------------------------------------------------------------------ slots
    def allocate(self) -> int:
        """Claim an empty slot (the same id on every rank)."""
        seq = self.local.allocate()
        self._glen[seq] = 0
        self._set_positions([seq])
        return seq

    def free(self, seq: int) -> None:
        seq = self.local._check_seq(seq, "seq")
        self.local.free(seq)
        self._glen[seq] = 0

    # ------------------------------------------------------------------ writes
    def prefill(self, seq: int, k: torch.Tensor, v: torch.Tensor, *, check_finite: Optional[bool] = None) -> None:
        """Append ``n`` tokens of sequence ``seq``; this rank stores those on its
        pages. ``k``, ``v``: [n, H, D] (one layer) or [num_layers, n, H, D],
        the whole sequence's new tokens (the same on every rank)."""
        seq = self.local._check_seq(seq, "seq")
        n = self._tokens(k, v)
        start = self._glen[seq]
        if start + n > self.max_len:
            raise ValueError(f"k: {n} more tokens would take sequence {seq} past max_len ({self.max_len})")
        mine = to_device(np.flatnonzero(self.sharding.owned(start, n)), torch.int64, k.device)
        self.local.prefill(seq, k.index_select(-3, mine), v.index_select(-3, mine), check_finite=check_finite)
        self._glen[seq] = start + n
        self._set_positions([seq])

    extend = prefill

    def append(self, seqs: Sequence[int], k: torch.Tensor, v: torch.Tensor, *,
               check_finite: Optional[bool] = None) -> None:
        """One token for each sequence of ``seqs`` (k, v: [B, H, D] or
        [num_layers, B, H, D], the same on every rank); the rank owning the
        token's page stores it."""
        ids = self.local._check_seq_list(seqs)
        B = self._tokens(k, v)
        if B != len(ids):
            raise ValueError(f"k: expected one token per sequence in seqs ({len(ids)}), got {B}")
        for s in ids:
            if self._glen[s] + 1 > self.max_len:
                raise ValueError(f"seqs: sequence {s} already holds max_len ({self.max_len}) tokens")
        rows = [i for i, s in enumerate(ids) if self.sharding.owned(self._glen[s], 1)[0]]
        if rows:
            idx = to_device(rows, torch.int64, k.device)
            self.local.append([ids[i] for i in rows], k.index_select(-3, idx), v.index_select(-3, idx),
                              check_finite=check_finite)
        for s in ids:
            self._glen[s] += 1
        self._set_positions(ids)

    # ------------------------------------------------------------------ helpers
    def _tokens(self, k, v) -> int:
        want = 3 if self.num_layers == 1 else 4
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != want:
                raise ValueError(f"{name}: expected a tensor of {want} dims, got {describe(t)}")
        if k.shape != v.shape:
            raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        return k.shape[-3]

    def _set_positions(self, seqs: Sequence[int]) -> None:
        """Rows (query position, first stored position) of ``seqs``, in one
        asynchronous copy."""
        base = self.sharding.base
        src = to_device([[max(self._glen[s] - 1, 0), base] for s in seqs], torch.int32, self.device)
        self.positions.index_put_((to_device(list(seqs), torch.int64, self.device),), src)
