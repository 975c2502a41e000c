"""Quest top-k page selection fused with the bound computation.

Reference: ``entmaxkv.policies.select`` with ``TopK``. Shapes: B batch,
S selection heads (H, or HQ per query head), NG = HQ // S query heads per
selection row, M logical pages, K = pages kept per row, W = selection width.

A page's rank is its largest Quest bound over the NG heads of its selection
row; forced pages (the last page, ``sinks`` first and ``window`` last pages)
rank +inf, pages past the end are never kept. Each row keeps its
max(budget // P, forced) best pages. No sort and no torch.topk. The files,
by pass (launch.py runs them; plan.py chooses among them from shapes and the
TopKConfig; search.py holds the jit searches over int32 rank keys):

0. keys.py: ``_topk_keys_kernel`` (grid B x page blocks; one query head per
   KV head only): the rank keys of a block of pages for a group of heads per
   step, from contiguous reads of their k_min/k_max (packed cache layout),
   written to a [B*S, NCH*CH] key table; then ``_topk_gmax_kernel`` (grid
   B*S x group blocks): the largest key of each of about gmax_groups page
   groups per row. The K-th largest group maximum lb is a lower bound on
   the row's K-th key (the pre-filter).
1. chain.py: ``_topk_lb_kernel`` (grid B*S) finds lb once per row;
   ``_topk_chunk_kernel`` (grid B*S x NCH) otherwise scores CH pages
   (CH = NSUB * BLOCK_M) of one row from k_min/k_max and maps each rank to
   an int32 key with the same order. With the pre-filter, a chunk with at
   most K keys >= lb keeps them all; otherwise it finds its K-th largest key
   by bisection on the key bits between max(lb, smallest key) and its
   largest key (about 24 counting passes over registers). It writes at most
   K candidates (key, page); with a single chunk, the Selection directly.
2. chain.py: ``_topk_merge_kernel`` (grid B*S): the same bisection (from lb)
   over the NCH * K candidate slots of a row (held in registers when they
   fit), then the kept pages in any order (the Selection contract allows
   unsorted pages).

For widths up to rowsel_max_w (except short rows with small budgets when
there are at least as many rows as SMs: ``plan.use_rowsel``) one
``_topk_rowsel_kernel`` program per row (rowsel.py, grid B*S) replaces the
lb, chunk and merge launches: it finds lb from the group maxima, reads only
the keys of the groups whose maximum reaches lb and selects among those
>= lb.

The overlapped selection (``plan.use_overlap``: batch >= 2, rows of at most
overlap_max_keys key slots, PDL): _topk_keys_kernel runs in batch order and
raises a counter per batch row as its chunks are stored, and
_topk_rowsel_kernel, launched without waiting for it, polls its batch row's
counter and takes the row's group maxima itself (no _topk_gmax_kernel), so
the first batch rows are selected while the last are still being read.

Every stage writes fixed-shape buffers; nothing synchronises with the host
(the counters are zeroed by a memset and polled on the device).
"""
from .launch import select_topk
from .plan import topk_width

__all__ = ["select_topk", "topk_width"]
