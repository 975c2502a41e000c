"""Paged attention over selected (or all) pages: softmax and exact alpha-entmax.

Reference: ``entmaxkv.attention.attend``. Shapes: B batch, HQ query heads,
H KV heads, G = HQ // H, S selection heads (H or HQ), NG = HQ // S query heads
served by one selection row, W selection width (pages), P page size, D head dim.

Split-K over the selected pages, in at most four launches, none of which
synchronises with the host (launch.py runs them, plan.py sizes them from
shapes and the AttentionConfig):

1. split.py, grid B*S x NSPLIT. Each program walks a contiguous share of its
   row's selected pages, loading each K tile once for the NG query heads
   that read it.
   * ``_attn_split_softmax_kernel``: online softmax over the share, also
     reading V; writes the partial (max, sum, accumulator) of each head.
   * ``_attn_split_entmax_kernel``: computes x = (alpha-1) s and never reads
     V. Any subset's threshold is <= the full threshold (docs/spec.md §1), so
     a running lower bound ``lb`` screens the tokens: only x > lb can be in
     the support. lb comes from the per-slot maxima seen so far (distinct
     tokens), raised by a Newton step from the left after each tile (valid
     because f is convex for alpha <= 2). Those *candidates* (score +
     physical token id) are the only scores written to HBM: staged per slot,
     then compacted in place into one list per (query head, split) at the
     end of the program.
2. solve.py, ``_attn_solve_kernel`` (grid B*HQ, entmax only): the exact tau
   of each query head over its candidates, whose other kept tokens have
   x <= lb <= tau and so contribute nothing. alpha = 2 / 1.5: Newton from the
   left until the support is stable, then the closed form on it; other
   alpha: safeguarded Halley (as the reference).
3. finish.py, ``_attn_vacc_kernel`` (grid B*HQ x NSPLIT, entmax only):
   p = [x - tau]_+^beta over each candidate list; V rows are gathered only
   where p > 0.
4. combine.py, ``_attn_combine_kernel`` (grid B*HQ): merges the split
   partials, writes the output in q's dtype and tau (softmax: the
   log-sum-exp; a head with no kept token gets zeros and tau = +inf).

Entmax usually replaces 2-4 with one launch, finish.py's
``_attn_finish_kernel`` (grid B*HQ): the solve, then the support (p > 0)
compacted into the head's own candidate lists and its V rows gathered, the
output written directly (AttentionConfig.finish* say when). A support
longer than finish_own tokens has the rest of its V rows gathered by
``_attn_vtail_kernel`` (grid B*HQ x finish_tail), which writes the output.
"""
from .launch import attend, candidates, dense_attend, selection_tau

__all__ = ["attend", "candidates", "dense_attend", "selection_tau"]
