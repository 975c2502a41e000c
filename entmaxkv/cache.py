"""Paged KV cache with per-page key statistics (docs/spec.md §3).

Layout (fixed by docs/contracts.md; the Triton kernels index it directly):

    k_pages, v_pages   [num_pages, kv_heads, page_size, head_dim]  storage dtype
    k_min, k_max       [num_pages, kv_heads, head_dim]             storage dtype
    k_mean, k_std      [num_pages, kv_heads, head_dim]             storage dtype
                       (strided views: k_min/k_max are halves of k_bounds
                       [num_pages, kv_heads, 2, head_dim], k_mean/k_std of
                       k_moments, so one page-head's pair is contiguous)
    block_table        int32 [max_seqs, max_pages_per_seq]         (unused = 0)
    seq_lens           int32 [max_seqs]                            (free = 0)

Token j of the sequence in slot s lives at
``k_pages[block_table[s, j // P], :, j % P, :]``.

Every allocation decision (which page, which slot, is the pool full?) is made
from host-side mirrors, so appending and decoding never read a GPU value on
the host (beyond the optional finiteness check of the written keys/values).

Writes are atomic: every method validates its arguments and computes
everything it will store before it touches the cache, then commits with a
rollback, so a call that raises (bad input, a full pool, non-finite data, a
failure inside torch) leaves the cache exactly as it was.
"""
from __future__ import annotations

import dataclasses
import heapq
import operator
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import sketch as sketch_mod
from . import stats
from .layout import STORAGE_DTYPES, PagedKV, PageShape
from .prefill import gather_row

__all__ = ["PagedKVCache", "CacheFullError", "STORAGE_DTYPES", "MAX_PAGE_SIZE"]

MAX_PAGE_SIZE = 256
_INT32_MAX = 2**31 - 1


class CacheFullError(RuntimeError):
    """The cache has no free page (or slot) for a request.

    Raised before anything is written: every sequence, page and statistic is
    left exactly as it was, so the caller can free or preempt a sequence and
    retry.
    """


def _positive_int(value, name: str, *, upper: Optional[int] = None) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive int, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a positive int, got {type(value).__name__} {value!r}"
        ) from None
    if value < 1 or (upper is not None and value > upper):
        bound = f"in 1..{upper}" if upper is not None else "a positive int"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _non_negative_int(value, name: str) -> int:
    """Return ``value`` as an int >= 0 (numpy integers accepted), or raise ValueError."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a non-negative int, got {type(value).__name__} {value!r}"
        ) from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _resolve_device(device) -> torch.device:
    """``device`` as a torch.device that this build and machine can allocate on.

    Raises ValueError naming ``device`` (instead of the AssertionError or
    RuntimeError torch raises at the first allocation) for names torch does
    not parse and for devices that are not available, e.g. "cuda" on a
    CPU-only build or an out-of-range CUDA index.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"device must be a torch device or its name, got {device!r}: {err}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(dev)!r}, but CUDA is not available (no GPU, or a CPU-only torch)")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={str(dev)!r}, but only {count} CUDA device(s) exist")
    try:
        # Resolves "cuda" to "cuda:0" and catches every other unavailable
        # backend (torch raises AssertionError, NotImplementedError, ...).
        return torch.empty(0, device=dev).device
    except Exception as err:  # noqa: BLE001 - re-raised as the documented ValueError
        raise ValueError(f"device={str(dev)!r} is not available: {err}") from None


FIT_SAMPLE = 65536  # keys per layer a sketch basis is fitted to


def _encode_pages(sk, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sketch codes [T, H, P, m] and radii [T, H, P, 2] of pages of keys [T, H, P, D]."""
    T, H, P, D = keys.shape
    codes, radii = sketch_mod.encode(sk, keys.permute(0, 2, 1, 3).reshape(T * P, H, D))
    return (codes.view(T, P, H, -1).permute(0, 2, 1, 3).contiguous(),
            radii.view(T, P, H, 2).permute(0, 2, 1, 3).contiguous())


def _sketch_append(sk, k: torch.Tensor, phys: torch.Tensor, row: torch.Tensor) -> list:
    """The writes (for ``PagedKVCache._commit``) that add one token per
    page: keys k [B, H, D] at rows ``row`` of pages ``phys`` (int64 [B]),
    their sketches and the pages' summaries over rows 0 .. row."""
    codes, radii = sketch_mod.encode(sk, k)  # [B, H, m], [B, H, 2]
    idx = torch.arange(k.shape[0], device=k.device)
    page_c, page_r = sk.codes[phys], sk.radii[phys]  # [B, H, P, *], copies
    page_c[idx, :, row] = codes
    page_r[idx, :, row] = radii
    box, rad = sketch_mod.page_boxes(page_c, page_r, row + 1)
    at = (phys, slice(None), row)
    return [(sk.codes, at, codes, None), (sk.radii, at, radii, None),
            (sk.page_codes, (phys,), box, None), (sk.page_radii, (phys,), rad, None)]


class PagedKVCache(PageShape):
    """A paged key/value cache for decoding, with Quest and Gaussian page stats.

    The memory is a pool of ``num_pages`` physical pages of ``page_size``
    tokens shared by up to ``max_seqs`` sequences. A sequence owns a *slot*
    (a row of ``block_table``); entry ``i`` of that row is the physical page
    holding the sequence's ``i``-th logical page, as in vLLM's block table.
    Pages use FlashInfer's "HND" layout: for one page and one KV head the
    ``page_size x head_dim`` block is contiguous.

    Tensors (all on ``device``; P = page_size, H = kv_heads, D = head_dim):

    - ``k_pages``, ``v_pages``: [num_pages, H, P, D], storage ``dtype``.
      Rows past a sequence's length hold stale values and must be masked.
    - ``k_min``, ``k_max``: [num_pages, H, D], storage dtype, the exact
      elementwise min/max over the page's valid keys (Quest bounds).
    - ``k_mean``, ``k_std``: [num_pages, H, D], storage dtype, rounded copies
      of float32 running statistics (Welford): the mean and the *population*
      standard deviation over the page's valid keys, computed from the stored
      (rounded) keys.
    - ``k_bounds`` = stack(k_min, k_max) and ``k_moments`` = stack(k_mean,
      k_std): [num_pages, H, 2, D]. The four statistics are strided views
      into these two tensors, so the two halves a policy reads for one page
      and head are adjacent (2 * D * itemsize bytes, one DRAM burst at D = 32
      in half precision) instead of two scattered half-lines.
    - ``block_table``: int32 [max_seqs, max_pages_per_seq]; unused entries 0.
    - ``seq_lens``: int32 [max_seqs]; 0 for a free or empty slot.

    A sequence of length n uses logical pages ``0 .. ceil(n / P) - 1`` and its
    token ``j`` is row ``j % P`` of logical page ``j // P``. Statistics of pages
    that belong to no sequence are undefined.

    Appending a token (``append``) costs O(H * D) whatever the sequence
    length: one scatter into the page and an incremental update of that
    page's statistics. Lengths, page lists and the free list are mirrored on
    the host, so no method of the decode loop synchronises with the device,
    except the finiteness check of ``prefill`` / ``append`` (one host
    synchronisation; skipped while a CUDA graph is being captured and with
    ``check_finite=False``).

    Every write is atomic: on any exception (bad input, CacheFullError,
    non-finite data, a failure inside torch) the slots, free list, block
    table, lengths (host and device), pages and statistics are exactly what
    they were before the call. Written keys and values are detached (a model
    run without ``torch.no_grad()`` may write, and the cache never requires
    grad), and the tensors are ordinary ones even when the cache is built
    under ``torch.inference_mode()``, so it can be written inside and outside
    inference mode alike.

    Args:
        num_pages: physical pages in the pool.
        page_size: tokens per page, 1..256.
        kv_heads: key/value heads.
        head_dim: size of one key/value vector.
        max_seqs: sequence slots (rows of ``block_table``).
        max_pages_per_seq: columns of ``block_table``; defaults to
            ``num_pages`` (a full sequence's length must fit in int32, so
            pass it when ``num_pages * page_size`` exceeds 2**31 - 1).
        dtype: storage dtype, one of float32, float16, bfloat16.
        device: where every tensor lives; must be available (ValueError
            otherwise, e.g. "cuda" on a CPU-only build).

    Integer arguments accept Python and numpy integers (not floats or bools).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        max_seqs: int,
        max_pages_per_seq: Optional[int] = None,
        dtype: torch.dtype = torch.float16,
        device: Union[str, torch.device] = "cpu",
        num_layers: int = 1,
    ) -> None:
        num_pages = _positive_int(num_pages, "num_pages", upper=_INT32_MAX)
        page_size = _positive_int(page_size, "page_size", upper=MAX_PAGE_SIZE)
        kv_heads = _positive_int(kv_heads, "kv_heads")
        head_dim = _positive_int(head_dim, "head_dim")
        max_seqs = _positive_int(max_seqs, "max_seqs")
        # Lengths are stored as int32, so a full sequence must fit in one.
        longest = _INT32_MAX // page_size
        if max_pages_per_seq is None:
            if num_pages > longest:
                raise ValueError(
                    f"num_pages * page_size = {num_pages} * {page_size} exceeds the int32 "
                    f"length limit {_INT32_MAX}, so max_pages_per_seq cannot default to "
                    f"num_pages; pass max_pages_per_seq=... (at most {longest})"
                )
            max_pages_per_seq = num_pages
        max_pages_per_seq = _positive_int(max_pages_per_seq, "max_pages_per_seq", upper=longest)
        if dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"dtype must be one of torch.float32, torch.float16, "
                f"torch.bfloat16, got {dtype!r}"
            )
        device = _resolve_device(device)
        num_layers = _positive_int(num_layers, "num_layers")

        L, P, H, D = num_layers, page_size, kv_heads, head_dim
        # Ordinary tensors even under torch.inference_mode(): an in-place
        # write to an inference tensor fails outside inference mode, so a
        # cache built inside it could otherwise never be written outside.
        with torch.inference_mode(False):
            k_all = torch.zeros(L, num_pages, H, P, D, dtype=dtype, device=device)
            v_all = torch.zeros_like(k_all)
            # Pairs read together by one policy share a tensor (see the
            # docstring). Writes go to the bases, one index_put_ per pair.
            bounds = torch.zeros(L, num_pages, H, 2, D, dtype=dtype, device=device)
            moments = torch.zeros_like(bounds)
            # float32 Welford state (mean, M2) behind k_mean / k_std, paired
            # the same way so that one write updates both.
            welford = torch.zeros(L, num_pages, H, 2, D, dtype=torch.float32, device=device)
            block_table = torch.zeros(max_seqs, max_pages_per_seq, dtype=torch.int32, device=device)
            seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        layers = [PagedKV(k_all[i], v_all[i], bounds[i], moments[i], block_table, seq_lens, welford[i])
                  for i in range(L)]
        self._adopt(layers, block_table, seq_lens, max_pages_per_seq)

    def _adopt(self, layers: List[PagedKV], block_table: torch.Tensor, seq_lens: torch.Tensor,
               max_pages_per_seq: int) -> None:
        """Take ``layers`` (sharing ``block_table`` and ``seq_lens``) as the
        cache's storage, every page free and every slot empty."""
        self._layers = tuple(layers)
        first = self._layers[0]
        self.k_pages, self.v_pages = first.k_pages, first.v_pages
        self.k_bounds, self.k_moments = first.k_bounds, first.k_moments
        self.k_min, self.k_max = first.k_min, first.k_max
        self.k_mean, self.k_std = first.k_mean, first.k_std
        self.sketch = first.sketch
        self._welford = first.welford
        self._mean32, self._m2 = self._welford[:, :, 0], self._welford[:, :, 1]
        self.block_table, self.seq_lens = block_table, seq_lens
        self._device = first.device  # resolved, e.g. "cuda" -> "cuda:0"
        self._max_pages_per_seq = max_pages_per_seq
        num_pages, max_seqs = first.num_pages, block_table.shape[0]
        # Host mirrors. The free list is a stack: pop() hands out pages
        # 0, 1, 2, ... on a fresh cache.
        self._free: List[int] = list(range(num_pages - 1, -1, -1))
        self._free_slots: List[int] = list(range(max_seqs))  # a min-heap
        self._active: List[bool] = [False] * max_seqs
        self._lens: List[int] = [0] * max_seqs
        self._pages: List[List[int]] = [[] for _ in range(max_seqs)]

    @classmethod
    def from_buffers(
        cls,
        k_pages: Union[torch.Tensor, Sequence[torch.Tensor]],
        v_pages: Union[torch.Tensor, Sequence[torch.Tensor]],
        *,
        max_seqs: int,
        max_pages_per_seq: Optional[int] = None,
    ) -> "PagedKVCache":
        """A cache over engine-owned page buffers (one pair per layer).

        The cache manages slots, the block table and the page statistics;
        the pages themselves stay where the caller put them (no copy), so
        an engine can hand its KV memory over and read it back directly.
        Every page starts free: tokens enter through ``prefill`` /
        ``append`` or ``reserve`` + ``write``.

        Args:
            k_pages, v_pages: [num_pages, kv_heads, page_size, head_dim]
                tensors, or one per layer (same shape, dtype, device);
                float32/float16/bfloat16, head_dim contiguous (strided
                views such as ``layout.split_packed`` halves are fine).
            max_seqs, max_pages_per_seq: as for the constructor.
        """
        ks = [k_pages] if isinstance(k_pages, torch.Tensor) else list(k_pages)
        vs = [v_pages] if isinstance(v_pages, torch.Tensor) else list(v_pages)
        if not ks or len(ks) != len(vs):
            raise ValueError(f"v_pages: expected one tensor per k_pages tensor ({len(ks)}), got {len(vs)}")
        layers = [PagedKV.from_buffers(k, v) for k, v in zip(ks, vs)]
        first = layers[0]
        for i, lay in enumerate(layers[1:], 1):
            if lay.k_pages.shape != first.k_pages.shape or lay.dtype != first.dtype or lay.device != first.device:
                raise ValueError(f"k_pages[{i}]: expected shape {tuple(first.k_pages.shape)}, dtype "
                                 f"{first.dtype} on {first.device} (those of layer 0), got "
                                 f"{tuple(lay.k_pages.shape)}, {lay.dtype} on {lay.device}")
        N, _, P, _ = first.k_pages.shape
        max_seqs = _positive_int(max_seqs, "max_seqs")
        longest = _INT32_MAX // P
        if max_pages_per_seq is None:
            max_pages_per_seq = min(N, longest)
        max_pages_per_seq = _positive_int(max_pages_per_seq, "max_pages_per_seq", upper=longest)
        with torch.inference_mode(False):
            block_table = torch.zeros(max_seqs, max_pages_per_seq, dtype=torch.int32, device=first.device)
            seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=first.device)
        cache = cls.__new__(cls)
        cache._adopt([lay.with_rows(block_table, seq_lens) for lay in layers], block_table, seq_lens,
                     max_pages_per_seq)
        return cache

    # ------------------------------------------------------------------ layers
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, index: int = 0) -> PagedKV:
        """Layer ``index``'s tensors as a ``PagedKV`` (views: pages,
        statistics, and the block table and lengths every layer shares)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not (
                0 <= int(index) < len(self._layers)):
            raise ValueError(f"layer: expected an int in 0..{len(self._layers) - 1}, got {index!r}")
        return self._layers[int(index)]

    def state_tensors(self):
        """Every device tensor that holds cache state, by name (pages,
        statistics and Welford state of each layer, the block table and
        lengths): what a snapshot must copy."""
        out = {}
        for i, lay in enumerate(self._layers):
            for name in ("k_pages", "v_pages", "k_bounds", "k_moments", "welford"):
                out[f"layer{i}.{name}"] = getattr(lay, name)
            if lay.sketch is not None:
                for name in ("codes", "radii", "page_codes", "page_radii"):
                    out[f"layer{i}.sketch.{name}"] = getattr(lay.sketch, name)
        out["block_table"], out["seq_lens"] = self.block_table, self.seq_lens
        return out

    # ------------------------------------------------------------------ shape
    # (num_pages, kv_heads, page_size, head_dim, dtype: layout.PageShape)
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_seqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self._max_pages_per_seq

    @property
    def free_pages(self) -> int:
        """Number of physical pages not owned by any sequence."""
        return len(self._free)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
            f"max_seqs={self.max_seqs}, max_pages_per_seq={self.max_pages_per_seq}, "
            f"dtype={self.dtype}, device={self.device}, "
            f"active={len(self.active_seqs())}, free_pages={self.free_pages})"
        )

    # ---------------------------------------------------------------- slots
    def allocate(
        self,
        k: Optional[torch.Tensor] = None,
        v: Optional[torch.Tensor] = None,
        *,
        check_finite: Optional[bool] = None,
    ) -> int:
        """Claim an empty sequence slot and return its id (the lowest free one).

        With ``k`` and ``v`` the new slot is also prefilled with them, in one
        atomic step: if the prefill fails (CacheFullError, bad or non-finite
        input, any other error) no slot is claimed and the cache is
        unchanged. ``allocate()`` followed by ``prefill`` would leave an
        empty slot allocated after a failed prefill.

        Args:
            k, v: optional [n, kv_heads, head_dim] tensors, both or neither;
                as for ``prefill``.
            check_finite: as for ``prefill`` (only used with ``k`` and ``v``).

        Raises:
            CacheFullError: every slot is in use, or (with ``k`` and ``v``)
                not enough free pages; nothing is modified.
            ValueError: bad ``k``, ``v`` or ``check_finite``, or non-finite
                ``k`` / ``v``; nothing is modified.
        """
        check = self._wants_finite_check(check_finite)
        if (k is None) != (v is None):
            missing, given = ("v", "k") if v is None else ("k", "v")
            raise ValueError(
                f"{missing} must be given together with {given} (pass both to prefill "
                f"the new slot, or neither), got {missing}=None"
            )
        if k is not None:
            self._check_kv(k, v, None)
        if not self._free_slots:
            raise CacheFullError(
                f"no free sequence slot: all max_seqs={self.max_seqs} are in use"
            )
        seq = self._free_slots[0]  # the heap's minimum, claimed only on success
        if k is None:
            self._claim(seq)
        else:
            self._write_tokens(seq, k, v, check, claim=True)
        return seq

    def free(self, seq: int) -> None:
        """Release slot ``seq`` and return its pages to the free list (atomic)."""
        seq = self._check_seq(seq, "seq")
        pages = self._pages[seq]
        idx = self._index_tensor([seq], torch.int64)  # [1]
        zero_row = torch.zeros(1, self.max_pages_per_seq, dtype=torch.int32, device=self.device)
        zero_len = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._commit([
            (self.block_table, (idx,), zero_row, None),
            (self.seq_lens, (idx,), zero_len, None),
        ])
        # Pushed in reverse so the next pops hand them out in their old order.
        self._free.extend(reversed(pages))
        self._pages[seq] = []
        self._lens[seq] = 0
        self._active[seq] = False
        heapq.heappush(self._free_slots, seq)

    def _drop_unwritten(self, seq: int, length: int) -> None:
        """Set sequence ``seq`` back to ``length`` tokens when the tokens
        past them were reserved (``reserve``) but never written, and return
        their pages to the free list (atomic). The page statistics stay
        exact because those rows never entered them; the block table's
        entries past the kept pages are left as they are and never read.

        Raises:
            ValueError: bad ``seq``, or ``length`` not in 0 .. the sequence's
                length; nothing is modified.
        """
        seq = self._check_seq(seq, "seq")
        n = self._lens[seq]
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= n:
            raise ValueError(f"length: expected an int in 0..{n} (the sequence's tokens), got {length!r}")
        keep = _ceil_div(length, self.page_size)
        idx = self._index_tensor([seq], torch.int64)
        self._commit([(self.seq_lens, (idx,), torch.full((1,), length, dtype=torch.int32, device=self.device), None)])
        surplus = self._pages[seq][keep:]
        self._free.extend(reversed(surplus))  # (so the next pops hand them out in their old order)
        del self._pages[seq][keep:]
        self._lens[seq] = length

    def length(self, seq: int) -> int:
        """Number of tokens held by sequence ``seq`` (host mirror, no sync)."""
        return self._lens[self._check_seq(seq, "seq")]

    def active_seqs(self) -> List[int]:
        """Ids of the allocated slots, ascending."""
        return [s for s, on in enumerate(self._active) if on]

    def page_ids(self, seq: int) -> torch.Tensor:
        """int32 [ceil(length / P)]: the physical pages of ``seq``, in order."""
        seq = self._check_seq(seq, "seq")
        return self._index_tensor(self._pages[seq], torch.int32)

    # --------------------------------------------------------------- writes
    def prefill(
        self,
        seq: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        check_finite: Optional[bool] = None,
    ) -> None:
        """Append ``n`` tokens to sequence ``seq`` in one vectorised write.

        The sequence may already hold tokens (its last page partially filled),
        so this is also ``extend``. The statistics of every touched page are
        recomputed from the stored (rounded) keys. Atomic: on any exception
        the cache is unchanged.

        Temporary memory: two storage-dtype and a few float32 copies of the
        touched pages (the statistics are reduced in float32); split very
        long prompts.

        Args:
            seq: an allocated slot id.
            k, v: [n, kv_heads, head_dim], any floating dtype (cast to the
                storage dtype), on the cache device; detached before they are
                stored. ``n`` may be 0.
            check_finite: reject NaN/inf in ``k`` or ``v`` *after* the cast
                to the storage dtype (so a finite value that overflows it is
                rejected too) with a ValueError naming the argument, the
                sequence and the token. Costs one host synchronisation.
                None (default): check unless a CUDA graph is being captured
                on the current stream; True: always; False: never (non-finite
                values are stored, and so are the statistics they give).

        Raises:
            ValueError: bad ``seq``, ``k``, ``v`` or ``check_finite``, or
                non-finite ``k`` / ``v``; nothing is modified.
            CacheFullError: not enough free pages, or the sequence would
                exceed ``max_pages_per_seq``; nothing is modified.
        """
        seq = self._check_seq(seq, "seq")
        check = self._wants_finite_check(check_finite)
        self._write_tokens(seq, k, v, check, claim=False)

    extend = prefill

    def append(
        self,
        seqs: Union[Sequence[int], torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        check_finite: Optional[bool] = None,
    ) -> None:
        """Append one token to each sequence in ``seqs`` (a decode step).

        One vectorised scatter for the whole batch and an O(kv_heads *
        head_dim) incremental update of each touched page's statistics:
        elementwise min/max and a Welford step of the float32 mean / M2, then
        ``k_mean``, ``k_std`` refreshed for those pages only. A sequence whose
        last page is full gets a new page from the free list (decided on the
        host). Atomic: on any exception the cache is unchanged.

        A page whose running float32 state is not finite after the step (a
        non-finite key stored with ``check_finite=False``, or an overflow of
        the state) gets its mean / M2, and so ``k_mean`` / ``k_std``,
        recomputed from its rows instead (min/max are exact anyway), so its
        statistics always equal a from-scratch recompute. With the check on,
        that is decided in the check's host synchronisation and costs nothing
        otherwise; without it the recompute (one read of each touched page)
        runs on the device every step and is selected with ``torch.where``,
        so there is still no synchronisation.

        Args:
            seqs: distinct allocated slot ids, a list of ints or an integer
                tensor on the CPU (a device tensor would force a sync).
            k, v: [len(seqs), kv_heads, head_dim], any floating dtype, on the
                cache device; detached before they are stored.
            check_finite: as for ``prefill``: reject NaN/inf after the cast
                to the storage dtype (one host synchronisation). None
                (default) checks unless a CUDA graph is being captured;
                pass False in a decode loop that must not synchronise.

        Raises:
            ValueError: bad or duplicate ``seqs``, bad ``k``, ``v`` or
                ``check_finite``, or non-finite ``k`` / ``v``; nothing is
                modified.
            CacheFullError: the batch needs more new pages than are free, or a
                sequence would exceed ``max_pages_per_seq``; nothing is
                modified.
        """
        ids = self._check_seq_list(seqs)
        self._check_kv(k, v, len(ids))
        check = self._wants_finite_check(check_finite)
        if not ids:
            return

        P = self.page_size
        lens = [self._lens[s] for s in ids]
        need = sum(1 for n in lens if n % P == 0)
        longest = max(n // P + 1 for n in lens)
        self._reserve(need, longest, f"append to {len(ids)} sequence(s)")
        kc, vc = self._stored(k), self._stored(v)  # [L, B, H, D], the stored (rounded) values

        # Host plan, nothing modified yet: one (slot, physical page, row in the
        # page, logical page; physical page, new length, old length, old
        # block-table entry) per sequence, the last four for int32 values.
        # New pages come off the top of the free-list stack in the order
        # pop() would hand them out.
        top = len(self._free)
        where = []
        for s, length in zip(ids, lens):
            lpage, row = divmod(length, P)
            if row == 0:
                top -= 1
                page, entry = self._free[top], 0  # unused entries are 0
            else:
                page = entry = self._pages[s][lpage]
            where.append((s, page, row, lpage, page, length + 1, length, entry))
        columns = self._index_tensor(list(zip(*where)), torch.int64)  # [8, B]
        slot, phys, row, lpage = columns[:4].unbind(0)
        phys32, new_len, old_len, old_entry = columns[4:].to(torch.int32).unbind(0)

        # Incremental statistics (the first token of a page resets them).
        count = (row + 1).to(torch.float32)[:, None, None]  # tokens in page after append
        steps = []
        for lay, kl in zip(self._layers, kc):
            old_bounds, old_welford = lay.k_bounds[phys], lay.welford[phys]  # [B, H, 2, D] copies
            bounds, welford = stats.welford_step(old_bounds, old_welford, kl, row)
            steps.append((old_bounds, old_welford, bounds, welford))
        if check:
            # Any non-finite key makes its coordinate's M2 NaN, so a finite
            # state also means that no page needs the recompute below.
            finite = self._check_rows(
                kc, vc, lambda i: f"sequence {ids[i]}, token {lens[i]}",
                extra=torch.stack([st[3] for st in steps]),
            )
        else:
            finite = False  # unknown without a sync: decided on the device
        writes = []
        for lay, kl, vl, (old_bounds, old_welford, bounds, welford) in zip(self._layers, kc, vc, steps):
            if not finite:
                # The running state of a page that is not finite is replaced by
                # the state recomputed from its rows (the new one included).
                # min/max need no recompute: the running ones are exact.
                poisoned = ~torch.isfinite(welford).flatten(1).all(dim=1)  # [B]
                keys = lay.k_pages[phys]  # [B, H, P, D], a copy
                keys[torch.arange(len(ids), device=self.device), :, row] = kl
                recomputed = torch.stack(stats.page_welford(keys, row + 1), dim=2)
                welford = torch.where(poisoned[:, None, None, None], recomputed, welford)
            writes += [
                (lay.k_bounds, (phys,), bounds, old_bounds),
                (lay.welford, (phys,), welford, old_welford),
                (lay.k_moments, (phys,), stats.moments(welford, count, self.dtype), None),
                (lay.k_pages, (phys, slice(None), row), kl, None),
                (lay.v_pages, (phys, slice(None), row), vl, None),
            ]
            if lay.sketch is not None:
                writes += _sketch_append(lay.sketch, kl, phys, row)
        # Rewriting an existing block-table entry with its own value is
        # harmless and avoids a data-dependent mask.
        self._commit(writes + [
            (self.block_table, (slot, lpage), phys32, old_entry),
            (self.seq_lens, (slot,), new_len, old_len),
        ])
        # Host mirrors, after every device write succeeded.
        fresh = self._free[top:][::-1]
        del self._free[top:]
        fresh_iter = iter(fresh)
        for s, length in zip(ids, lens):
            if length % P == 0:
                self._pages[s].append(next(fresh_iter))
            self._lens[s] = length + 1

    # ------------------------------------------------- graph-safe writes
    def reserve(self, seqs: Union[Sequence[int], torch.Tensor], counts=1) -> torch.Tensor:
        """Make room for ``counts`` new tokens of each sequence in ``seqs``
        and return where they go: the slot mapping of a step.

        The host half of a graph-safe write (vLLM's scheduler step): pages
        are allocated from the host mirrors, all or nothing, the block
        table and the lengths (host and device) are advanced, and the
        tokens' slots ``physical_page * page_size + row`` come back as one
        int64 device tensor, sequence after sequence in the order of
        ``seqs``, positions ascending. Store the tokens with ``write`` (once
        per layer), before any decode reads them. Nothing here reads the
        device; the device tensors are updated by one asynchronous copy.

        Args:
            seqs: distinct allocated slot ids (a list of ints or a CPU tensor).
            counts: an int >= 0, or one per sequence, of new tokens.

        Returns:
            int64 [sum(counts)] slot mapping on the cache device.

        Raises:
            ValueError: bad ``seqs`` or ``counts``; nothing is modified.
            CacheFullError: not enough free pages, or a sequence would exceed
                ``max_pages_per_seq``; nothing is modified.
        """
        ids = self._check_seq_list(seqs)
        if isinstance(counts, (list, tuple, np.ndarray)):
            if len(counts) != len(ids):
                raise ValueError(f"counts: expected {len(ids)} counts (one per sequence), got {len(counts)}")
            counts = [_non_negative_int(c, f"counts[{i}]") for i, c in enumerate(counts)]
        else:
            counts = [_non_negative_int(counts, "counts")] * len(ids)
        P = self.page_size
        lens = [self._lens[s] for s in ids]
        new_lens = [n + c for n, c in zip(lens, counts)]
        need = [_ceil_div(m, P) - len(self._pages[s]) for s, m in zip(ids, new_lens)]
        longest = max((_ceil_div(m, P) for m in new_lens), default=0)
        self._reserve(sum(need), longest, f"reserve of {sum(counts)} tokens for {len(ids)} sequence(s)")
        top = len(self._free)
        fresh = self._free[top - sum(need):][::-1]  # in pop() order
        slots, cells, offset = [], [], 0
        for s, n0, n1, k in zip(ids, lens, new_lens, need):
            # only the pages the new tokens land in: host work per step must
            # not grow with the sequence
            first = n0 // P
            pages = np.asarray(self._pages[s][first:] + fresh[offset:offset + k], dtype=np.int64)
            cells += [(s, len(self._pages[s]) + j, fresh[offset + j]) for j in range(k)]
            offset += k
            pos = np.arange(n0, n1, dtype=np.int64)
            slots.append(pages[pos // P - first] * P + pos % P)
        parts = [np.concatenate(slots) if slots else np.zeros(0, np.int64)]
        parts += [np.asarray([c[i] for c in cells], dtype=np.int64) for i in range(3)]
        parts += [np.asarray(ids, dtype=np.int64), np.asarray(new_lens, dtype=np.int64)]
        packed = self._index_tensor(np.concatenate(parts), torch.int64)
        slot_mapping, row_d, col_d, page_d, seq_d, len_d = packed.split([len(x) for x in parts])
        self._commit([
            (self.block_table, (row_d, col_d), page_d.to(torch.int32), None),
            (self.seq_lens, (seq_d,), len_d.to(torch.int32), None),
        ])
        del self._free[top - sum(need):]
        offset = 0
        for s, m, k in zip(ids, new_lens, need):
            self._pages[s].extend(fresh[offset:offset + k])
            offset += k
            self._lens[s] = m
        return slot_mapping

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *, layer: int = 0,
              backend: str = "auto") -> None:
        """Store one layer's new tokens at ``slot_mapping`` (from ``reserve``)
        and update the statistics of the pages they touch.

        The device half of a graph-safe write: no host synchronisation and
        no finiteness check (a non-finite key is stored, and its page's
        statistics are recomputed from its rows, as ``append`` does with
        ``check_finite=False``), so it can be captured in a CUDA graph.
        Appending one token per sequence gives the same bits as ``append``.

        Args:
            k, v: [T, kv_heads, head_dim], any floating dtype (cast to the
                storage dtype; detached), on the cache device.
            slot_mapping: int32/int64 [T] on the cache device (< 0 skips a token).
            layer: which layer's pages (0 .. num_layers - 1).
            backend: "auto" (Triton on CUDA), "reference" or "triton".
        """
        from .ops import write_kv

        write_kv(self.layer(layer), k, v, slot_mapping, backend=backend)

    def enable_sketches(self, dims: int = 8, bases=None) -> None:
        """Give every layer per-token key sketches (``entmaxkv.sketch``):
        the certified policy then bounds pages by their tokens' sketches as
        well as by their boxes, and every later write keeps them up to date.

        Args:
            dims: sketch coordinates per token (int8 codes), 1..head_dim;
                a token then costs dims + 4 bytes per KV head.
            bases: None to fit each layer's basis (per KV head: mean,
                leading principal directions, code step) to the keys the
                cache holds now (at least one token must be stored, e.g.
                after the prefill); or one (mean [H, D], basis [H, D, dims],
                step [H, dims]) per layer (``sketch.fit_basis`` gives them).
                A fit reads an even sample of about FIT_SAMPLE stored
                keys per layer.

        The stored tokens are encoded at once. Raises ValueError naming
        ``dims`` or ``bases``; the cache is unchanged on any error.
        """
        D, L = self.head_dim, len(self._layers)
        dims = _positive_int(dims, "dims", upper=D)
        if bases is None:
            rows = [s for s in self.active_seqs() if self._lens[s] > 0]
            if not rows:
                raise ValueError("bases: None fits the bases to the stored keys, but the cache holds none; "
                                 "prefill first or pass bases")
            bases = []
            total = sum(self._lens[s] for s in rows)
            every = -(-total // FIT_SAMPLE)  # an even sample bounds the fit's memory
            for lay in self._layers:
                keys = torch.cat([gather_row(lay, self.page_ids(s), self._lens[s])[0].transpose(0, 1)[::every]
                                  for s in rows])  # [~FIT_SAMPLE, H, D]
                bases.append(sketch_mod.fit_basis(keys, dims))
        else:
            bases = list(bases) if isinstance(bases, (list, tuple)) else None
            if bases is None or len(bases) != L:
                raise ValueError(f"bases: expected None or {L} (mean, basis, step) triples, one per layer")
        valid = torch.zeros(self.num_pages, dtype=torch.long)  # valid rows of each physical page
        for s in self.active_seqs():
            for j, page in enumerate(self._pages[s]):
                valid[page] = min(self.page_size, self._lens[s] - j * self.page_size)
        valid = valid.to(self.device)
        built = []
        for i, (lay, base) in enumerate(zip(self._layers, bases)):
            try:
                mean, basis, step = (t.to(self.device) for t in base)
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"bases[{i}]: expected a (mean, basis, step) triple of tensors") from None
            if basis.dim() != 3 or tuple(basis.shape[:2]) != (self.kv_heads, D) or basis.shape[2] != dims:
                raise ValueError(f"bases[{i}]: expected a basis [{self.kv_heads}, {D}, {dims}], got "
                                 f"{tuple(basis.shape)}")
            sk = sketch_mod.KeySketch.empty(self.num_pages, self.page_size, mean, basis, step)
            per = max(1, (1 << 22) // (self.kv_heads * self.page_size * D))  # pages per float64 batch
            for lo in range(0, self.num_pages, per):
                codes, radii = _encode_pages(sk, lay.k_pages[lo:lo + per])
                sk.codes[lo:lo + per] = codes
                sk.radii[lo:lo + per] = radii
                box, rad = sketch_mod.page_boxes(codes, radii, valid[lo:lo + per])
                sk.page_codes[lo:lo + per] = box
                sk.page_radii[lo:lo + per] = rad
            built.append(sk)
        self._layers = tuple(dataclasses.replace(lay, sketch=sk) for lay, sk in zip(self._layers, built))
        self.sketch = self._layers[0].sketch

    # ---------------------------------------------------------------- reads
    def gather(self, seq: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies (k, v), each [length, kv_heads, head_dim], storage dtype.

        Meant for references and tests, not for the decode loop.
        """
        seq = self._check_seq(seq, "seq")
        n = self._lens[seq]
        pages = self._index_tensor(self._pages[seq], torch.int64)  # [np]

        def contiguous(pool: torch.Tensor) -> torch.Tensor:
            blocks = pool[pages]  # [np, H, P, D]
            tokens = blocks.permute(0, 2, 1, 3).reshape(-1, self.kv_heads, self.head_dim)
            return tokens[:n].contiguous()  # [n, H, D]

        return contiguous(self.k_pages), contiguous(self.v_pages)

    # ---------------------------------------------------------- test helper
    @classmethod
    def from_dense(
        cls,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: Sequence[int],
        page_size: int,
        *,
        dtype: Optional[torch.dtype] = None,
        spare_pages: int = 0,
        shuffle: bool = True,
        generator: Optional[torch.Generator] = None,
        device: Optional[Union[str, torch.device]] = None,
        max_seqs: Optional[int] = None,
        max_pages_per_seq: Optional[int] = None,
    ) -> Tuple["PagedKVCache", List[int]]:
        """Build a cache holding a padded batch of sequences (for tests/benchmarks).

        Sequence ``b`` is ``k[b, :lens[b]]`` / ``v[b, :lens[b]]``. With
        ``shuffle`` the free list is put in random order first (``randperm``
        drawn from ``generator``, a CPU generator), so the block tables point
        to scattered physical pages, as in a long-running server.

        Args:
            k, v: [batch, n_max, kv_heads, head_dim], floating (checked for
                NaN/inf after the cast, as by ``prefill``).
            lens: ``batch`` ints in 0..n_max.
            page_size: tokens per page.
            dtype: storage dtype; defaults to ``k.dtype``.
            spare_pages: free pages left in the pool after filling.
            shuffle: scatter the pages in random physical order.
            generator: CPU ``torch.Generator`` for the shuffle.
            device: defaults to ``k.device``.
            max_seqs: slots; defaults to ``batch`` (more leave free slots).
            max_pages_per_seq: defaults to the total number of pages; must
                hold the longest sequence.

        Returns:
            (cache, slots) with ``slots[b]`` the slot id of sequence ``b``.
        """
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be a 4-d floating tensor [batch, n_max, kv_heads, head_dim], "
                    f"got {got}"
                )
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        batch, n_max = k.shape[0], k.shape[1]
        try:
            lens = list(lens)
        except TypeError:
            raise ValueError(f"lens must be a sequence of {batch} ints, got {type(lens).__name__}") from None
        if len(lens) != batch:
            raise ValueError(f"lens must have {batch} entries (one per row of k), got {len(lens)}")
        for b, n in enumerate(lens):
            n = _non_negative_int(n, f"lens[{b}]")
            if n > n_max:
                raise ValueError(f"lens[{b}] must be an int in 0..{n_max}, got {n}")
            lens[b] = n
        page_size = _positive_int(page_size, "page_size", upper=MAX_PAGE_SIZE)
        spare_pages = _non_negative_int(spare_pages, "spare_pages")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be a bool, got {type(shuffle).__name__} {shuffle!r}")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValueError(f"generator must be None or a CPU torch.Generator, got {generator!r}")
        if max_seqs is not None and _positive_int(max_seqs, "max_seqs") < batch:
            raise ValueError(f"max_seqs must be at least batch={batch}, got {max_seqs}")
        longest = max((_ceil_div(n, page_size) for n in lens), default=0)
        if max_pages_per_seq is not None and _positive_int(
            max_pages_per_seq, "max_pages_per_seq"
        ) < longest:
            raise ValueError(
                f"max_pages_per_seq must hold the longest sequence ({max(lens)} tokens: "
                f"{longest} pages of {page_size}), got {max_pages_per_seq}"
            )
        if dtype is None and k.dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"k has dtype {k.dtype}, which is not a storage dtype, and dtype was not "
                f"given; pass dtype= one of torch.float32, torch.float16, torch.bfloat16"
            )
        needed = sum(_ceil_div(n, page_size) for n in lens)
        cache = cls(
            max(needed + spare_pages, 1),
            page_size,
            k.shape[2],
            k.shape[3],
            max_seqs=max(batch, 1) if max_seqs is None else max_seqs,
            max_pages_per_seq=max_pages_per_seq,
            dtype=k.dtype if dtype is None else dtype,
            device=k.device if device is None else device,
        )
        if shuffle:
            order = torch.randperm(cache.num_pages, generator=generator)
            cache._free = order.tolist()
        slots = [
            cache.allocate(k[b, :n].to(cache.device), v[b, :n].to(cache.device))
            for b, n in enumerate(lens)
        ]
        return cache, slots

    # ------------------------------------------------------------ internals
    def _index_tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        """Host list (or NumPy array) -> device tensor without blocking the host."""
        t = torch.from_numpy(data).to(dtype) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _reserve(self, need: int, pages_per_seq: int, what: str) -> None:
        """Raise CacheFullError unless ``need`` pages are free and fit a row."""
        if pages_per_seq > self.max_pages_per_seq:
            raise CacheFullError(
                f"{what} needs {pages_per_seq} pages in one sequence, more than "
                f"max_pages_per_seq={self.max_pages_per_seq}; nothing was written"
            )
        if need > len(self._free):
            raise CacheFullError(
                f"{what} needs {need} new pages but only {len(self._free)} are "
                f"free; nothing was written"
            )

    def _claim(self, seq: int) -> None:
        """Mark the lowest free slot, ``seq``, allocated (host only)."""
        assert self._free_slots[0] == seq
        heapq.heappop(self._free_slots)
        self._active[seq] = True

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it will be stored, [layers, n, H, D]: detached (so writes
        work under autograd and never make the cache require grad), in the
        storage dtype."""
        t = t.detach().to(self.dtype)
        return t[None] if t.dim() == 3 else t

    def _wants_finite_check(self, check_finite) -> bool:
        """Resolve a write's ``check_finite`` (None, True or False) to a bool."""
        if check_finite is None:
            # The check reads a device value on the host, which a CUDA graph
            # capture forbids.
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            return not capturing
        if isinstance(check_finite, (bool, np.bool_)):
            return bool(check_finite)
        raise ValueError(
            f"check_finite must be None, True or False, got "
            f"{type(check_finite).__name__} {check_finite!r}"
        )

    def _check_rows(
        self,
        kc: torch.Tensor,
        vc: torch.Tensor,
        describe: Callable[[int], str],
        extra: Optional[torch.Tensor] = None,
    ) -> bool:
        """Raise ValueError if a token of ``kc`` / ``vc`` ([layers, n, H, D],
        already in the storage dtype) is not finite; ``describe(i)`` says
        where token ``i`` goes. Returns whether ``extra`` (any tensor, or
        None) is finite, read in the same, single host synchronisation."""
        flags = [torch.isfinite(kc).all(), torch.isfinite(vc).all()]
        if extra is not None:
            flags.append(torch.isfinite(extra).all())
        flags = torch.stack(flags).tolist()  # the one host synchronisation
        for name, t, ok in (("k", kc, flags[0]), ("v", vc, flags[1])):
            if not ok:
                bad = (~torch.isfinite(t).flatten(2).all(dim=2)).nonzero()[0]
                layer, i = int(bad[0]), int(bad[1])
                where = f"{name}[{layer}, {i}]" if self.num_layers > 1 else f"{name}[{i}]"
                raise ValueError(
                    f"{where} ({describe(i)}) is not finite after the cast to the "
                    f"storage dtype {self.dtype} (NaN or inf); nothing was written "
                    f"(check_finite=False stores it anyway)"
                )
        return bool(flags[2]) if extra is not None else True

    def _write_tokens(self, seq: int, k, v, check: bool, *, claim: bool) -> None:
        """Append ``k``, ``v`` ([n, H, D], or [layers, n, H, D]) to slot
        ``seq`` (prefill / extend).

        With ``claim`` the slot is free (and empty) and is claimed once the
        tokens are written. Everything is validated and computed first; the
        cache changes only in ``_commit`` and the host updates after it.
        """
        n = self._check_kv(k, v, None)
        if n == 0:
            if claim:
                self._claim(seq)
            return
        P = self.page_size
        pages = self._pages[seq]
        old_len = self._lens[seq]
        new_len = old_len + n
        have, total = len(pages), _ceil_div(new_len, P)
        need = total - have
        self._reserve(need, total, f"prefill of {n} tokens into seq {seq}")
        kc, vc = self._stored(k), self._stored(v)  # [L, n, H, D]
        if check:
            self._check_rows(
                kc, vc, lambda i: f"token {i} of the prefill, position {old_len + i} of sequence {seq}"
            )

        # Host plan: the pages the free-list stack hands out next, in pop()
        # order, and the touched pages (the old last one, if partially
        # filled, and the new ones). Only the last can be partially filled.
        fresh = self._free[len(self._free) - need:][::-1]
        first = old_len // P  # first touched logical page
        touched = (pages + fresh)[first:]  # physical ids
        T = len(touched)
        valid = [P] * (T - 1) + [new_len - (total - 1) * P]
        meta = self._index_tensor(touched + valid + fresh + [seq, new_len], torch.int64)
        touched_d, valid_d = meta[:T], meta[T:2 * T]
        fresh_d, seq_d, len_d = meta[2 * T:2 * T + need], meta[-2:-1], meta[-1:]

        # The touched pages as they will be: token old_len + t goes to page
        # (old_len + t) // P, row (old_len + t) % P.
        pos = torch.arange(old_len, new_len, device=self.device)  # [n]
        pidx, row = pos // P - first, pos % P
        count = valid_d.to(torch.float32)[:, None, None]
        writes = [(self.seq_lens, (seq_d,), len_d.to(torch.int32), None)]
        for lay, kl, vl in zip(self._layers, kc, vc):
            old_k = lay.k_pages[touched_d]  # [T, H, P, D], copies
            new_k = old_k.clone()
            new_k[pidx, :, row] = kl
            new_v = lay.v_pages[touched_d]
            new_v[pidx, :, row] = vl
            bounds, welford = stats.page_stats(new_k, valid_d)
            writes += [
                (lay.k_bounds, (touched_d,), bounds, None),
                (lay.welford, (touched_d,), welford, None),
                (lay.k_moments, (touched_d,), stats.moments(welford, count, self.dtype), None),
                (lay.k_pages, (touched_d,), new_k, old_k),
                (lay.v_pages, (touched_d,), new_v, None),
            ]
            if lay.sketch is not None:  # every row of the touched pages (stale rows are masked when read)
                codes, radii = _encode_pages(lay.sketch, new_k)
                box, rad = sketch_mod.page_boxes(codes, radii, valid_d)
                writes += [(lay.sketch.codes, (touched_d,), codes, None),
                           (lay.sketch.radii, (touched_d,), radii, None),
                           (lay.sketch.page_codes, (touched_d,), box, None),
                           (lay.sketch.page_radii, (touched_d,), rad, None)]
        if need:
            cols = torch.arange(have, total, device=self.device)
            writes.append((self.block_table, (seq_d, cols), fresh_d.to(torch.int32), None))
        self._commit(writes)
        # Host mirrors, after every device write succeeded.
        del self._free[len(self._free) - need:]
        pages.extend(fresh)
        self._lens[seq] = new_len
        if claim:
            self._claim(seq)

    @staticmethod
    def _commit(writes) -> None:
        """Apply ``writes``, a list of (target, index, value, old), in order;
        on any exception restore every target and re-raise.

        ``target[index] = value`` with an index that holds a tensor (advanced
        indexing), so ``target[index]`` is a copy; ``old`` is that copy taken
        before the write, or None to take it here. Each old value is kept
        before its write starts, so even a write that fails after changing
        its target is undone.
        """
        done = []
        try:
            for target, index, value, old in writes:
                done.append((target, index, target[index] if old is None else old))
                target[index] = value
        except BaseException:
            for target, index, old in reversed(done):
                target[index] = old
            raise

    def _recompute_stats(
        self, pages: torch.Tensor, valid: torch.Tensor, layer: int = 0
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_min, k_max, mean, M2) [T, H, D] of the stored rows of ``pages``
        (int64 [T]) of ``layer``, computed from scratch; reads only.
        ``valid`` (int64 [T]) is the number of valid rows of each page."""
        bounds, welford = stats.page_stats(self._layers[layer].k_pages[pages], valid)
        return bounds[:, :, 0], bounds[:, :, 1], welford[:, :, 0], welford[:, :, 1]

    def _check_seq(self, seq, name: str) -> int:
        if isinstance(seq, bool):
            raise ValueError(f"{name} must be an int slot id, got bool {seq!r}")
        try:
            seq = operator.index(seq)
        except TypeError:
            raise ValueError(
                f"{name} must be an int slot id, got {type(seq).__name__} {seq!r}"
            ) from None
        if not 0 <= seq < self.max_seqs:
            raise ValueError(f"{name}={seq} is out of range 0..{self.max_seqs - 1}")
        if not self._active[seq]:
            raise ValueError(f"{name}={seq} is not an allocated sequence")
        return seq

    def _check_seq_list(self, seqs) -> List[int]:
        if isinstance(seqs, torch.Tensor):
            if seqs.device.type != "cpu":
                raise ValueError(
                    f"seqs must be a list of ints or a CPU tensor (reading a "
                    f"{seqs.device} tensor would synchronise), got device {seqs.device}"
                )
            if seqs.dim() != 1 or seqs.is_floating_point() or seqs.is_complex():
                raise ValueError(
                    f"seqs must be a 1-d integer tensor, got {seqs.dtype} "
                    f"shape {tuple(seqs.shape)}"
                )
            seqs = seqs.tolist()
        elif isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
            raise ValueError(f"seqs must be a list of ints, got {type(seqs).__name__}")
        ids = [self._check_seq(s, "seqs") for s in seqs]
        if len(set(ids)) != len(ids):
            dup = sorted({s for s in ids if ids.count(s) > 1})
            raise ValueError(f"seqs must be distinct, got duplicates {dup}")
        return ids

    def _check_kv(self, k, v, n: Optional[int]) -> int:
        """Validate k, v as [n, kv_heads, head_dim] (a one-layer cache) or
        [num_layers, n, kv_heads, head_dim]; return n."""
        H, D, L = self.kv_heads, self.head_dim, self.num_layers
        tokens = "n" if n is None else n
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if L == 1:
                expect, what = f"[{tokens}, {H}, {D}]", "(tokens, kv_heads, head_dim)"
                ok = t.dim() == 3 and tuple(t.shape[1:]) == (H, D)
            else:
                expect, what = f"[{L}, {tokens}, {H}, {D}]", "(layers, tokens, kv_heads, head_dim)"
                ok = t.dim() == 4 and t.shape[0] == L and tuple(t.shape[2:]) == (H, D)
            if not ok:
                raise ValueError(f"{name} must have shape {expect} {what}, got {tuple(t.shape)}")
            if n is not None and t.shape[-3] != n:
                raise ValueError(
                    f"{name} must have shape {expect}: one token per sequence in "
                    f"seqs, got {tuple(t.shape)}"
                )
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")
        if v.shape[-3] != k.shape[-3]:
            raise ValueError(
                f"v must hold as many tokens as k ({k.shape[-3]}), got {v.shape[-3]}"
            )
        return k.shape[-3]
