"""Shared builders for tests: random paged caches and their dense twins."""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

import torch

from entmaxkv import PagedKVCache


def random_cache(
    lens: Sequence[int],
    kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    dtype=torch.float32,
    spare_pages: int = 3,
    seed: int = 0,
    device="cpu",
    key_scale: float = 1.0,
):
    """A cache with one sequence per entry of ``lens`` in shuffled physical pages.

    Returns (cache, slot ids, k, v) with k, v float32 [B, n_max, H, D] as stored
    (rounded through the storage dtype).
    """
    gen = torch.Generator().manual_seed(seed)
    B, n_max = len(lens), max(lens)
    k = torch.randn(B, n_max, kv_heads, head_dim, generator=gen) * key_scale
    v = torch.randn(B, n_max, kv_heads, head_dim, generator=gen)
    cache, slots = PagedKVCache.from_dense(
        k, v, list(lens), page_size, dtype=dtype, spare_pages=spare_pages, shuffle=True,
        generator=gen, device=device,
    )
    return cache, slots, k.to(dtype).float(), v.to(dtype).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def alibi(q_heads: int, nape: bool = True) -> torch.Tensor:
    """ALiBi slopes; with ``nape`` the second half of the heads gets slope 0."""
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / q_heads) for i in range(q_heads)])
    if nape:
        s[q_heads // 2:] = 0.0
    return s


def load_kernels():
    """entmaxkv.kernels, (re)imported so that it matches TRITON_INTERPRET.

    Set TRITON_INTERPRET=1 before calling on a machine without CUDA: Triton
    picks the interpreter when ``@triton.jit`` runs, so kernel modules that
    another test imported in compiled mode are dropped and imported again.
    """
    import entmaxkv

    mod = sys.modules.get("entmaxkv.kernels._common")
    if mod is not None and not torch.cuda.is_available() and not mod.interpreting():
        for name in [m for m in sys.modules if m.startswith("entmaxkv.kernels")]:
            del sys.modules[name]
        if hasattr(entmaxkv, "kernels"):
            delattr(entmaxkv, "kernels")
    return importlib.import_module("entmaxkv.kernels")
