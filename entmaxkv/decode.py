"""The one public decode entry point: validate, select pages, attend.

``decode`` runs one decoding step for a batch of sequences (one new query
token each) against a PagedKVCache. On CUDA tensors it uses the Triton
kernels of ``entmaxkv.kernels`` when Triton is available; elsewhere the
pure-PyTorch reference, which is also the oracle the kernels are tested
against. Validation only looks at shapes, dtypes and host-side bookkeeping,
except the optional finiteness check of the query (see ``check_finite``).
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Sequence, Tuple, Union

import torch

from .backend import BACKENDS
from .cache import PagedKVCache
from .policies import Full, Policy, check_policy
from ._checks import as_bool, as_choice, as_float, as_ids, describe
from .limits import POSITION_MAX, check_alpha, effective_alpha


def _seq_ids(seq_ids, cache: PagedKVCache, batch: int):
    """Validate sequence ids against the host bookkeeping: a tuple of ints,
    or the given int tensor when it lives on the GPU (which cannot be
    checked without a synchronisation).

    ``seq_ids``: an int32/int64 tensor [B], or a sequence (list, tuple, NumPy
    array) of B ints (NumPy ints included).
    """
    want = f"a list of {batch} ints or an int32/int64 tensor of shape ({batch},)"
    host = as_ids(seq_ids, "seq_ids", want)
    if isinstance(seq_ids, torch.Tensor) and seq_ids.device.type != "cpu" and seq_ids.device != cache.device:
        raise ValueError(f"seq_ids: expected a tensor on {cache.device} (the cache's device), got {seq_ids.device}")
    n = len(host) if host is not None else seq_ids.numel()
    if n != batch:
        raise ValueError(f"seq_ids: expected {batch} ids (one per query row), got {n}")
    if host is None:
        return seq_ids
    active, lens = cache._active, cache._lens
    for s in host:
        if not (0 <= s < len(active)) or not active[s]:
            raise ValueError(f"seq_ids: sequence {s} is not allocated in the cache")
        if lens[s] == 0:
            raise ValueError(f"seq_ids: sequence {s} is empty; append its token first")
    return host


def _check_query(q: torch.Tensor, cache: PagedKVCache, check_finite: Optional[bool]) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else describe(q)
        raise ValueError(f"q: expected a [batch, q_heads, head_dim] tensor, got {shape}")
    if not q.is_floating_point():
        raise ValueError(f"q: expected a floating dtype, got {q.dtype}")
    B, HQ, D = q.shape
    if D != cache.head_dim:
        raise ValueError(f"q: head_dim {D} does not match the cache's head_dim {cache.head_dim}")
    if HQ == 0 or HQ % cache.kv_heads:
        raise ValueError(
            f"q: q_heads ({HQ}) must be a positive multiple of the cache's kv_heads ({cache.kv_heads})"
        )
    if B == 0:
        raise ValueError("q: expected at least one query row (batch >= 1)")
    if q.device != cache.device:
        raise ValueError(f"q: on {q.device}, but the cache is on {cache.device}")
    if check_finite is None:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        check_finite = not capturing
    if check_finite and not bool(torch.isfinite(q).all()):
        raise ValueError("q: contains NaN or infinite values (expected finite values)")


def _check_scalars(alpha, scale, D: int) -> Tuple[float, float]:
    """alpha in [1, ALPHA_MAX] (returned as the effective alpha: 1.0 below
    1 + SOFTMAX_BELOW, see limits.py) and scale > 0 (default 1/sqrt(D)) as
    Python floats; see _checks for what is a number."""
    alpha = effective_alpha(check_alpha(alpha))
    scale = 1.0 / math.sqrt(D) if scale is None else as_float(scale, "scale", lo=0.0, lo_open=True)
    return alpha, scale


def _check_slopes(slopes, HQ: int, cache: PagedKVCache) -> Optional[torch.Tensor]:
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or slopes.shape != (HQ,) or not slopes.is_floating_point():
        got = f"shape {tuple(slopes.shape)} dtype {slopes.dtype}" if isinstance(slopes, torch.Tensor) else describe(slopes)
        raise ValueError(f"alibi_slopes: expected a float tensor of shape ({HQ},), got {got}")
    if slopes.device.type == "cpu" and not bool(torch.isfinite(slopes).all()):
        raise ValueError("alibi_slopes: contains NaN or infinite values (expected finite slopes)")
    capacity = cache.max_pages_per_seq * cache.page_size
    if capacity > POSITION_MAX:
        # Relative positions are float32, where integers are exact only up to 2^24.
        raise ValueError(
            f"alibi_slopes: ALiBi needs a cache of at most {POSITION_MAX} tokens per sequence "
            f"(positions are float32), but cache holds up to {capacity} (max_pages_per_seq="
            f"{cache.max_pages_per_seq} x page_size={cache.page_size}); build it with a smaller "
            "max_pages_per_seq"
        )
    return slopes.to(device=cache.device, dtype=torch.float32)


def _check_kernel_config(config) -> None:
    """None or a KernelConfig. The class is looked up among the loaded modules:
    importing the kernels package needs Triton, and a KernelConfig instance
    can only exist once that package has been imported."""
    if config is None:
        return
    mod = sys.modules.get("entmaxkv.kernels.config")
    if mod is None or not isinstance(config, mod.KernelConfig):
        raise ValueError(
            f"kernel_config: expected an entmaxkv.kernels.KernelConfig or None, got {describe(config)}"
        )


def check_call(q, cache, policy, alpha, scale, alibi_slopes, return_stats, backend, check_finite, kernel_config):
    """The checks every decode entry point makes (``cache``: anything with
    the cache's shape attributes and ``max_pages_per_seq``). Returns
    (policy, alpha, scale, float32 slopes or None, return_stats), all
    resolved; raises ValueError naming the argument otherwise."""
    if check_finite is not None:
        check_finite = as_bool(check_finite, "check_finite")
    return_stats = as_bool(return_stats, "return_stats")
    as_choice(backend, "backend", BACKENDS)
    _check_kernel_config(kernel_config)
    _check_query(q, cache, check_finite)
    alpha, scale = _check_scalars(alpha, scale, q.shape[2])
    policy = Full() if policy is None else policy
    check_policy(policy, alpha=alpha, page_size=cache.page_size)
    return policy, alpha, scale, _check_slopes(alibi_slopes, q.shape[1], cache), return_stats


def decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    seq_ids: Union[Sequence[int], torch.Tensor],
    policy: Optional[Policy] = None,
    *,
    alpha: float = 1.5,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    return_stats: bool = False,
    backend: str = "auto",
    check_finite: Optional[bool] = None,
    kernel_config=None,
    layer: int = 0,
):
    """One decoding step of alpha-entmax (or softmax) attention over a paged cache.

    The cache must already hold each sequence's current token (append its K/V
    first, as serving engines do); the query attends over positions
    0 .. len-1 and sits at position len-1 for ALiBi.

    Args:
        q: [batch, q_heads, head_dim] float32/float16/bfloat16 (float64 for
            the reference oracle); q_heads a multiple of the cache's kv_heads.
        cache: PagedKVCache holding the sequences.
        seq_ids: the cache slot of each query row: a sequence of ints (list,
            tuple or NumPy array) or an int32/int64 tensor [batch] (a CUDA
            tensor skips the host-side existence check).
        policy: Full() (default), TopK(budget), Gaussian(...) or Certified(...).
        alpha: entmax alpha in [1, 4] (limits.ALPHA_MAX); 1 is softmax (TopK
            with alpha = 1 is Quest), and so is alpha < 1 + 2^-33
            (limits.SOFTMAX_BELOW, see docs/limits.md).
        scale: score scale > 0, default 1/sqrt(head_dim). alpha and scale
            are Python or NumPy numbers (not bool, not tensors: reading a
            tensor's value would be a host synchronisation).
        alibi_slopes: optional float [q_heads]; score += slope * (j - pos_q),
            slope 0 = no positional bias (NAPE mixes both). Needs a cache of
            at most 2^24 tokens per sequence (limits.POSITION_MAX:
            max_pages_per_seq * page_size), where float32 positions are exact.
        out: optional [batch, q_heads, head_dim] tensor, q's dtype, written in place.
        return_stats: also return DecodeStats (pages/tokens read, coverage,
            final tau, certificate).
        backend: "auto" (Triton on CUDA when available, else reference),
            "reference" or "triton".
        check_finite: None or a bool: check q for NaN/inf. This costs one host synchronisation;
            the default (None) checks unless a CUDA graph is being captured.
            Pass False in a latency-critical loop.
        kernel_config: the Triton kernels' launch choices
            (``entmaxkv.kernels.KernelConfig``; None: the measured defaults).
            Unused by the reference backend.
        layer: which layer of the cache (``PagedKVCache(num_layers=...)``).
    Returns:
        out [batch, q_heads, head_dim] in q's dtype, or (out, DecodeStats).
        A head whose whole row is masked (cannot happen for a non-empty
        sequence) gets zeros, never NaN.
    Raises:
        ValueError naming the offending argument for bad input.
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {describe(cache)}")
    policy, alpha, scale, slopes, return_stats = check_call(q, cache, policy, alpha, scale, alibi_slopes,
                                                            return_stats, backend, check_finite, kernel_config)
    B, HQ, D = q.shape
    if out is not None and (
        not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
        or out.device != q.device
    ):
        raise ValueError(f"out: expected a tensor of shape {tuple(q.shape)}, dtype {q.dtype}, on {q.device}, "
                         f"got {describe(out)}")
    ids = _seq_ids(seq_ids, cache, B)
    kv = cache.layer(layer)
    dec = _decoder(cache, policy, alpha, scale, alibi_slopes, slopes, HQ, backend, kernel_config)
    dec.plan(cache.block_table, cache.seq_lens, ids)
    if out is not None and out.stride(-1) != 1:  # the kernels write rows with a unit stride
        res = dec.run(q, kv, return_stats=return_stats)
        out.copy_(res[0] if return_stats else res)
        return (out, res[1]) if return_stats else out
    return dec.run(q, kv, out, return_stats=return_stats)


_MAX_DECODERS = 16  # per cache: one per (policy, alpha, scale, slopes, heads, backend, config) in use


def _decoder(cache, policy, alpha, scale, user_slopes, slopes, HQ, backend, kernel_config):
    """The cache's planned decoder for these settings (made on first use).

    Keyed by the caller's slopes tensor and its version counter, so an
    in-place change of the slopes gives a new decoder."""
    from .planner import Decoder

    skey = None if user_slopes is None else (id(user_slopes), user_slopes._version)
    key = (policy, alpha, scale, skey, HQ, backend, kernel_config)
    store = cache.__dict__.setdefault("_decoders", {})
    hit = store.get(key)
    if hit is not None and hit[0] is user_slopes:
        return hit[1]
    dec = Decoder(policy, q_heads=HQ, kv_heads=cache.kv_heads, head_dim=cache.head_dim, page_size=cache.page_size,
                  alpha=alpha, scale=scale, alibi_slopes=slopes, device=cache.device, backend=backend,
                  kernel_config=kernel_config)
    if len(store) >= _MAX_DECODERS:
        store.pop(next(iter(store)))
    store[key] = (user_slopes, dec)
    return dec
