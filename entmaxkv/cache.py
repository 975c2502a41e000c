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
the host.
"""
from __future__ import annotations

import heapq
import operator
from typing import List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["PagedKVCache", "CacheFullError", "STORAGE_DTYPES", "MAX_PAGE_SIZE"]

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
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
    the host, so no method of the decode loop synchronises with the device.

    Args:
        num_pages: physical pages in the pool.
        page_size: tokens per page, 1..256.
        kv_heads: key/value heads.
        head_dim: size of one key/value vector.
        max_seqs: sequence slots (rows of ``block_table``).
        max_pages_per_seq: columns of ``block_table``; defaults to
            ``num_pages``.
        dtype: storage dtype, one of float32, float16, bfloat16.
        device: where every tensor lives.
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
    ) -> None:
        num_pages = _positive_int(num_pages, "num_pages", upper=_INT32_MAX)
        page_size = _positive_int(page_size, "page_size", upper=MAX_PAGE_SIZE)
        kv_heads = _positive_int(kv_heads, "kv_heads")
        head_dim = _positive_int(head_dim, "head_dim")
        max_seqs = _positive_int(max_seqs, "max_seqs")
        if max_pages_per_seq is None:
            max_pages_per_seq = num_pages
        # Lengths are stored as int32, so a full sequence must fit in one.
        max_pages_per_seq = _positive_int(
            max_pages_per_seq, "max_pages_per_seq", upper=_INT32_MAX // page_size
        )
        if dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"dtype must be one of torch.float32, torch.float16, "
                f"torch.bfloat16, got {dtype!r}"
            )
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device is not a valid torch device: {device!r}") from err

        P, H, D = page_size, kv_heads, head_dim
        self.k_pages = torch.zeros(num_pages, H, P, D, dtype=dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        # Pairs read together by one policy share a tensor (see the docstring);
        # every write below goes through the views (index_put_ on a view
        # writes its base).
        self.k_bounds = torch.zeros(num_pages, H, 2, D, dtype=dtype, device=device)
        self.k_moments = torch.zeros_like(self.k_bounds)
        self.k_min, self.k_max = self.k_bounds[:, :, 0], self.k_bounds[:, :, 1]
        self.k_mean, self.k_std = self.k_moments[:, :, 0], self.k_moments[:, :, 1]
        # float32 Welford state behind k_mean / k_std.
        self._mean32 = torch.zeros(num_pages, H, D, dtype=torch.float32, device=device)
        self._m2 = torch.zeros_like(self._mean32)
        self.block_table = torch.zeros(
            max_seqs, max_pages_per_seq, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)

        self._device = self.k_pages.device  # resolved, e.g. "cuda" -> "cuda:0"
        self._max_pages_per_seq = max_pages_per_seq
        # Host mirrors. The free list is a stack: pop() hands out pages
        # 0, 1, 2, ... on a fresh cache.
        self._free: List[int] = list(range(num_pages - 1, -1, -1))
        self._free_slots: List[int] = list(range(max_seqs))  # a min-heap
        self._active: List[bool] = [False] * max_seqs
        self._lens: List[int] = [0] * max_seqs
        self._pages: List[List[int]] = [[] for _ in range(max_seqs)]

    # ------------------------------------------------------------------ shape
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
    def allocate(self) -> int:
        """Claim an empty sequence slot and return its id (the lowest free one).

        Raises:
            CacheFullError: every slot is in use.
        """
        if not self._free_slots:
            raise CacheFullError(
                f"no free sequence slot: all max_seqs={self.max_seqs} are in use"
            )
        seq = heapq.heappop(self._free_slots)
        self._active[seq] = True
        return seq

    def free(self, seq: int) -> None:
        """Release slot ``seq`` and return its pages to the free list."""
        seq = self._check_seq(seq, "seq")
        pages = self._pages[seq]
        # Pushed in reverse so the next pops hand them out in their old order.
        self._free.extend(reversed(pages))
        self._pages[seq] = []
        self._lens[seq] = 0
        self._active[seq] = False
        heapq.heappush(self._free_slots, seq)
        self.block_table[seq].zero_()
        self.seq_lens[seq].fill_(0)

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
        self, seq: int, k: torch.Tensor, v: torch.Tensor, *, check_finite: bool = True
    ) -> None:
        """Append ``n`` tokens to sequence ``seq`` in one vectorised write.

        The sequence may already hold tokens (its last page partially filled),
        so this is also ``extend``. The statistics of every touched page are
        recomputed from the stored (rounded) keys.

        Temporary memory: a few float32 copies of the touched pages (the
        statistics are reduced in float32); split very long prompts.

        Args:
            seq: an allocated slot id.
            k, v: [n, kv_heads, head_dim], any floating dtype (cast to the
                storage dtype), on the cache device. ``n`` may be 0.
            check_finite: reject NaN/inf in ``k`` or ``v`` (costs one host
                synchronisation; pass False to skip it).

        Raises:
            ValueError: bad ``seq``, ``k`` or ``v``.
            CacheFullError: not enough free pages, or the sequence would
                exceed ``max_pages_per_seq``; nothing is modified.
        """
        seq = self._check_seq(seq, "seq")
        n = self._check_kv(k, v, None)
        if check_finite and n > 0:
            finite = torch.isfinite(k).all() & torch.isfinite(v).all()
            if not bool(finite):  # one host sync, outside the decode loop
                raise ValueError("k and v must be finite (found NaN or inf)")
        if n == 0:
            return

        P = self.page_size
        old_len = self._lens[seq]
        new_len = old_len + n
        have = len(self._pages[seq])
        total = _ceil_div(new_len, P)
        self._reserve(total - have, total, f"prefill of {n} tokens into seq {seq}")

        # Host bookkeeping: take the new pages from the free list.
        new_pages = [self._free.pop() for _ in range(total - have)]
        self._pages[seq].extend(new_pages)
        self._lens[seq] = new_len
        first = old_len // P  # first touched logical page
        touched = self._pages[seq][first:total]  # physical ids, host list
        touched_d = self._index_tensor(touched, torch.int64)  # [T]

        # Block table and length on the device.
        if new_pages:
            self.block_table[seq, have:total] = self._index_tensor(new_pages, torch.int32)
        self.seq_lens[seq].fill_(new_len)  # a kernel; item assignment would sync

        # Scatter tokens: token old_len + t goes to page (old_len + t) // P,
        # row (old_len + t) % P.
        pos = torch.arange(old_len, new_len, device=self.device)  # [n]
        phys = touched_d[pos // P - first]  # [n]
        row = pos % P  # [n]
        self.k_pages[phys, :, row] = k.to(self.dtype)  # [n, H, D]
        self.v_pages[phys, :, row] = v.to(self.dtype)

        # Statistics of the touched pages, from the stored keys. Only the last
        # touched page can be partially filled.
        T = len(touched)
        valid = [P] * (T - 1) + [new_len - (total - 1) * P]
        self._recompute_stats(touched_d, self._index_tensor(valid, torch.int64))

    extend = prefill

    def append(
        self,
        seqs: Union[Sequence[int], torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Append one token to each sequence in ``seqs`` (a decode step).

        One vectorised scatter for the whole batch and an O(kv_heads *
        head_dim) incremental update of each touched page's statistics:
        elementwise min/max and a Welford step of the float32 mean / M2, then
        ``k_mean``, ``k_std`` refreshed for those pages only. A sequence whose
        last page is full gets a new page from the free list (decided on the
        host). No host synchronisation.

        Args:
            seqs: distinct allocated slot ids, a list of ints or an integer
                tensor on the CPU (a device tensor would force a sync).
            k, v: [len(seqs), kv_heads, head_dim], any floating dtype, on the
                cache device. NaN/inf are not checked here.

        Raises:
            ValueError: bad or duplicate ``seqs``, bad ``k`` or ``v``.
            CacheFullError: the batch needs more new pages than are free, or a
                sequence would exceed ``max_pages_per_seq``; nothing is
                modified.
        """
        ids = self._check_seq_list(seqs)
        self._check_kv(k, v, len(ids))
        if not ids:
            return

        P = self.page_size
        need = sum(1 for s in ids if self._lens[s] % P == 0)
        longest = max(self._lens[s] // P + 1 for s in ids)
        self._reserve(need, longest, f"append to {len(ids)} sequence(s)")

        # Host side: where each token goes, one (slot, physical page, row in
        # the page, logical page, new length) per sequence.
        where = []
        for s in ids:
            length = self._lens[s]
            lpage, row = divmod(length, P)
            if row == 0:
                self._pages[s].append(self._free.pop())
            self._lens[s] = length + 1
            where.append((s, self._pages[s][lpage], row, lpage, length + 1))
        columns = list(zip(*where))  # 5 tuples of B ints
        slot, phys, row, lpage, new_len = self._index_tensor(columns, torch.int64).unbind(0)

        # Rewriting an existing block-table entry with its own value is
        # harmless and avoids a data-dependent mask.
        self.block_table[slot, lpage] = phys.to(torch.int32)
        self.seq_lens[slot] = new_len.to(torch.int32)

        kc = k.to(self.dtype)  # [B, H, D], the stored (rounded) keys
        self.k_pages[phys, :, row] = kc
        self.v_pages[phys, :, row] = v.to(self.dtype)

        # Incremental statistics. The first token of a page resets them.
        first = (row == 0)[:, None, None]  # [B, 1, 1]
        count = (row + 1).to(torch.float32)[:, None, None]  # tokens in page after append
        self.k_min[phys] = torch.where(first, kc, torch.minimum(self.k_min[phys], kc))
        self.k_max[phys] = torch.where(first, kc, torch.maximum(self.k_max[phys], kc))
        x = kc.to(torch.float32)
        mean = torch.where(first, 0.0, self._mean32[phys])
        m2 = torch.where(first, 0.0, self._m2[phys])
        delta = x - mean
        mean = mean + delta / count
        m2 = m2 + delta * (x - mean)
        self._mean32[phys] = mean
        self._m2[phys] = m2
        self.k_mean[phys] = mean.to(self.dtype)
        self.k_std[phys] = torch.sqrt(m2.clamp_min(0.0) / count).to(self.dtype)

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
            k, v: [batch, n_max, kv_heads, head_dim].
            lens: ``batch`` ints in 0..n_max.
            page_size: tokens per page.
            dtype: storage dtype; defaults to ``k.dtype``.
            spare_pages: free pages left in the pool after filling.
            shuffle: scatter the pages in random physical order.
            generator: CPU ``torch.Generator`` for the shuffle.
            device: defaults to ``k.device``.
            max_seqs: slots; defaults to ``batch`` (more leave free slots).
            max_pages_per_seq: defaults to the total number of pages.

        Returns:
            (cache, slots) with ``slots[b]`` the slot id of sequence ``b``.
        """
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError(
                f"k must be a 4-d tensor [batch, n_max, kv_heads, head_dim], got "
                f"{tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__}"
            )
        if not isinstance(v, torch.Tensor) or v.shape != k.shape:
            raise ValueError(
                f"v must have the shape of k {tuple(k.shape)}, got "
                f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
            )
        batch, n_max = k.shape[0], k.shape[1]
        lens = list(lens)
        if len(lens) != batch:
            raise ValueError(f"lens must have {batch} entries (one per row of k), got {len(lens)}")
        for b, n in enumerate(lens):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= n_max:
                raise ValueError(f"lens[{b}] must be an int in 0..{n_max}, got {n!r}")
        page_size = _positive_int(page_size, "page_size", upper=MAX_PAGE_SIZE)
        if isinstance(spare_pages, bool) or not isinstance(spare_pages, int) or spare_pages < 0:
            raise ValueError(f"spare_pages must be a non-negative int, got {spare_pages!r}")

        if max_seqs is not None and _positive_int(max_seqs, "max_seqs") < batch:
            raise ValueError(f"max_seqs must be at least batch={batch}, got {max_seqs}")
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
        slots = []
        for b, n in enumerate(lens):
            s = cache.allocate()
            cache.prefill(s, k[b, :n].to(cache.device), v[b, :n].to(cache.device))
            slots.append(s)
        return cache, slots

    # ------------------------------------------------------------ internals
    def _index_tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor without blocking the host."""
        t = torch.tensor(data, dtype=dtype)
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

    def _recompute_stats(self, pages: torch.Tensor, valid: torch.Tensor) -> None:
        """Recompute every statistic of ``pages`` (int64 [T]) from stored keys.

        ``valid`` (int64 [T]) is the number of valid rows of each page.
        """
        P = self.page_size
        keys = self.k_pages[pages]  # [T, H, P, D] storage dtype
        mask = (torch.arange(P, device=self.device) < valid[:, None])[:, None, :, None]
        inf = float("inf")
        self.k_min[pages] = torch.where(mask, keys, inf).amin(dim=2)  # [T, H, D]
        self.k_max[pages] = torch.where(mask, keys, -inf).amax(dim=2)
        x = keys.to(torch.float32)
        count = valid.to(torch.float32)[:, None, None]  # [T, 1, 1]
        mean = torch.where(mask, x, 0.0).sum(dim=2) / count  # [T, H, D]
        dev = torch.where(mask, x - mean[:, :, None], 0.0)  # [T, H, P, D]
        m2 = (dev * dev).sum(dim=2)
        self._mean32[pages] = mean
        self._m2[pages] = m2
        self.k_mean[pages] = mean.to(self.dtype)
        self.k_std[pages] = torch.sqrt(m2 / count).to(self.dtype)

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
        """Validate k, v as [n, kv_heads, head_dim]; return n."""
        H, D = self.kv_heads, self.head_dim
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            expect = f"[{'n' if n is None else n}, {H}, {D}]"
            if t.dim() != 3 or t.shape[1] != H or t.shape[2] != D:
                raise ValueError(
                    f"{name} must have shape {expect} (tokens, kv_heads, head_dim), "
                    f"got {tuple(t.shape)}"
                )
            if n is not None and t.shape[0] != n:
                raise ValueError(
                    f"{name} must have shape {expect}: one token per sequence in "
                    f"seqs, got {tuple(t.shape)}"
                )
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")
        if v.shape[0] != k.shape[0]:
            raise ValueError(
                f"v must hold as many tokens as k ({k.shape[0]}), got {v.shape[0]}"
            )
        return k.shape[0]
