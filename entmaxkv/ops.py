"""Functional ops over plain tensors: the layer an engine calls.

Nothing here needs an object of ours: the cache is a ``layout.PagedKV``
(pages, statistics, block table, lengths; ``PagedKV.from_buffers`` wraps an
engine's own tensors), and every op takes and returns tensors.

- ``write_kv``: store new tokens' K/V at a slot mapping and update the
  touched pages' statistics (graph-safe on CUDA).
- ``decode``: one decoding step of every row of the block table (or of the
  rows ``seq_ids`` names) with a policy. One call plans and runs; a model
  that decodes many layers per step should plan once and run per layer
  (``planner.Decoder``).
- ``refresh_stats``: recompute the statistics of the pages the rows use
  from their keys (for buffers filled by someone else).

The same ops are registered with ``torch.library`` (``torch.ops.entmaxkv.write_kv``,
``torch.ops.entmaxkv.decode``) with fake implementations, so ``torch.compile``
and CUDA-graph capture of a whole model step can hold them. Policies cross
the op boundary as text (``policy_spec`` / ``parse_policy``).
"""
from __future__ import annotations

import ast
import functools
from typing import Optional

import torch

from . import stats
from ._checks import describe
from .backend import resolve_backend
from .layout import PagedKV
from .types import POLICIES, Certified, Full, Gaussian, TopK

__all__ = ["decode", "parse_policy", "policy_spec", "refresh_stats", "write_kv"]


def _check_tokens(kv: PagedKV, k, v, slot_mapping) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != (kv.kv_heads, kv.head_dim):
            raise ValueError(f"{name}: expected a [tokens, {kv.kv_heads}, {kv.head_dim}] tensor, got {describe(t)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor, got {t.dtype}")
        if t.device != kv.device:
            raise ValueError(f"{name}: on {t.device}, but the cache is on {kv.device}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or slot_mapping.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected an int32/int64 tensor [tokens], got {describe(slot_mapping)}")
    if slot_mapping.device != kv.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, but the cache is on {kv.device}")
    if not (k.shape[0] == v.shape[0] == slot_mapping.shape[0]):
        raise ValueError(f"slot_mapping: expected one slot per token of k and v ({k.shape[0]}, {v.shape[0]}), "
                         f"got {slot_mapping.shape[0]}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():  # free to check here
        top = int(slot_mapping.max())
        if top >= kv.num_pages * kv.page_size:
            raise ValueError(f"slot_mapping: slot {top} is past the last slot {kv.num_pages * kv.page_size - 1} "
                             f"(num_pages * page_size - 1)")


def write_kv(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
             backend: str = "auto") -> None:
    """Store one layer's new tokens and update the statistics of the pages they touch.

    Token ``t`` goes to row ``slot_mapping[t] % P`` of page
    ``slot_mapping[t] // P`` (vLLM's slot mapping; a negative slot skips the
    token). The tokens of one page must come consecutively, in row order,
    the last being the page's last valid row (any append, prefill or
    chunked prefill). A page that gets one token is updated incrementally,
    bit for bit like ``PagedKVCache.append``; one that gets several, or
    whose running statistics stop being finite, is recomputed from its rows.

    Graph-safe on CUDA (Triton): the mapping is read on the device, nothing
    is allocated, the host never waits. No finiteness check (a non-finite
    key is stored and its page's statistics recomputed; check before, as
    ``PagedKVCache.append`` does, if you need it). Slots past the pool are
    refused on the CPU and must not be passed on CUDA (checking them there
    would synchronise).

    Args:
        kv: the layer's ``PagedKV`` (``welford`` required; block table unused).
        k, v: [T, kv_heads, head_dim], any floating dtype (cast to the
            storage dtype; detached), on the cache's device.
        slot_mapping: int32/int64 [T] on the cache's device.
        backend: "auto" (Triton on CUDA), "reference" or "triton".
    """
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a layout.PagedKV, got {describe(kv)}")
    kv.check(rows=False, writable=True)
    _check_tokens(kv, k, v, slot_mapping)
    ops = resolve_backend(backend, kv.device)
    if ops.name == "triton":
        k, v = (t.detach() if t.stride(-1) == 1 else t.detach().contiguous() for t in (k, v))
    ops.write_kv(kv, k, v, slot_mapping)


def refresh_stats(kv: PagedKV) -> None:
    """Recompute, from their stored keys, the statistics of every page the
    block table's rows use (up to their ``seq_lens``): for buffers written
    by someone else before ``PagedKV.from_buffers`` wrapped them. Reads the
    lengths on the host (one synchronisation on CUDA); not for the decode loop."""
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a layout.PagedKV, got {describe(kv)}")
    kv.check(rows=True, writable=True)
    P = kv.page_size
    M = kv.block_table.shape[1]
    start = torch.arange(M, device=kv.device) * P
    n_tok = (kv.seq_lens.long()[:, None] - start[None, :]).clamp(0, P)  # [R, M]
    used = n_tok > 0
    if not bool(used.any()):
        return
    phys, valid = kv.block_table.long()[used], n_tok[used]
    # a page shared by several rows (a common prefix) takes its largest count
    pages, inverse = torch.unique(phys, return_inverse=True)
    count = torch.zeros_like(pages).scatter_reduce_(0, inverse, valid, reduce="amax")
    bounds, welford = stats.page_stats(kv.k_pages[pages], count)
    kv.k_bounds[pages] = bounds
    kv.welford[pages] = welford
    kv.k_moments[pages] = stats.moments(welford, count.to(torch.float32)[:, None, None], kv.dtype)


def decode(q: torch.Tensor, kv: PagedKV, policy=None, *, alpha: float = 1.5, scale: Optional[float] = None,
           alibi_slopes: Optional[torch.Tensor] = None, seq_ids=None, out: Optional[torch.Tensor] = None,
           return_stats: bool = False, backend: str = "auto", kernel_config=None):
    """One decoding step over a ``PagedKV`` (rows of its block table).

    Args:
        q: [batch, q_heads, head_dim] float16/bfloat16/float32, on the
            cache's device; q_heads a multiple of kv_heads.
        kv: the layer's ``PagedKV`` with ``block_table`` int32 [rows,
            max_pages] and ``seq_lens`` int32 [rows] (the current token
            already written).
        policy: Full() (default), TopK, Gaussian or Certified.
        alpha, scale, alibi_slopes: as for ``entmaxkv.decode``.
        seq_ids: which rows the queries decode (None: rows 0 .. batch-1, and
            then the table must have exactly batch rows).
        out: optional output [batch, q_heads, head_dim] in q's dtype.
        return_stats, backend, kernel_config: as for ``entmaxkv.decode``.
    Returns:
        out, or (out, DecodeStats).
    """
    from .planner import Decoder

    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a layout.PagedKV, got {describe(kv)}")
    kv.check(rows=True)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a [batch, q_heads, head_dim] tensor, got {describe(q)}")
    if seq_ids is None and q.shape[0] != kv.block_table.shape[0]:
        raise ValueError(f"seq_ids: None decodes every block_table row ({kv.block_table.shape[0]}), but q has "
                         f"{q.shape[0]} rows; pass seq_ids")
    dec = Decoder(policy, q_heads=q.shape[1], kv_heads=kv.kv_heads, head_dim=q.shape[2], page_size=kv.page_size,
                  alpha=alpha, scale=scale, alibi_slopes=alibi_slopes, device=kv.device, backend=backend,
                  kernel_config=kernel_config, cuda_graphs=False)
    dec.plan(kv.block_table, kv.seq_lens, seq_ids)
    return dec.run(q, kv, out, return_stats=return_stats)


# ---------------------------------------------------------------------------
# policies as text (what a custom op's schema can carry)
# ---------------------------------------------------------------------------


def policy_spec(policy) -> str:
    """``policy`` as text, e.g. ``"TopK(budget=1024, sinks=0, window=0, per_query_head=False)"``
    (``parse_policy`` reads it back)."""
    if not isinstance(policy, (Full, TopK, Gaussian, Certified)):
        raise ValueError(f"policy: expected Full, TopK, Gaussian or Certified, got {describe(policy)}")
    return repr(policy)


@functools.lru_cache(maxsize=256)
def parse_policy(spec: str):
    """The policy ``policy_spec`` wrote: a call of Full / TopK / Gaussian /
    Certified with literal keyword arguments (a Certified's seeds nested
    calls, or None). Parsed, never evaluated; ValueError naming ``policy`` otherwise."""
    classes = {cls.__name__: cls for cls in POLICIES.values()}

    def build(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes and not node.args:
            kwargs = {kw.arg: build(kw.value) for kw in node.keywords}
            return classes[node.func.id](**kwargs)
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float))):
            return node.value  # None: an unset optional field (Certified.alibi_seed)
        raise ValueError(f"policy: cannot read {ast.unparse(node)!r} in {spec!r}")

    try:
        tree = ast.parse(spec, mode="eval")
    except SyntaxError:
        raise ValueError(f"policy: expected a policy written by policy_spec, got {spec!r}") from None
    try:
        return build(tree.body)
    except TypeError as err:
        raise ValueError(f"policy: {err} in {spec!r}") from None


# ---------------------------------------------------------------------------
# torch.library registrations
# ---------------------------------------------------------------------------


@torch.library.custom_op("entmaxkv::write_kv", mutates_args=("k_pages", "v_pages", "k_bounds", "k_moments",
                                                             "welford"))
def _write_kv_op(k_pages: torch.Tensor, v_pages: torch.Tensor, k_bounds: torch.Tensor, k_moments: torch.Tensor,
                 welford: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` over the layer's tensors (schema: the five cache tensors are mutated)."""
    write_kv(PagedKV(k_pages, v_pages, k_bounds, k_moments, None, None, welford), k, v, slot_mapping)


@_write_kv_op.register_fake
def _write_kv_fake(k_pages, v_pages, k_bounds, k_moments, welford, k, v, slot_mapping) -> None:
    return None


@torch.library.custom_op("entmaxkv::decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, k_bounds: torch.Tensor,
               k_moments: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               seq_ids: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], policy: str, alpha: float,
               scale: float) -> torch.Tensor:
    """``decode`` over plain tensors; the policy as ``policy_spec`` text. Returns the output [B, HQ, D]."""
    kv = PagedKV(k_pages, v_pages, k_bounds, k_moments, block_table, seq_lens)
    return decode(q, kv, parse_policy(policy), alpha=alpha, scale=scale, alibi_slopes=alibi_slopes,
                  seq_ids=seq_ids)


@_decode_op.register_fake
def _decode_fake(q, k_pages, v_pages, k_bounds, k_moments, block_table, seq_lens, seq_ids, alibi_slopes, policy,
                 alpha, scale):
    return torch.empty_like(q)
