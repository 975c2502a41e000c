"""Builders for tests and checks: random paged caches, their dense twins, errors.

Used by the test suite and by the GPU checks; nothing in the library imports it.
"""
from __future__ import annotations

from typing import List, Sequence, Set

import torch

from .cache import PagedKVCache

# Relative RMS error allowed of a kernel output against the float64 reference:
# the kernels compute in float32 and round the output to the query dtype.
KERNEL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# Where kernel tests run: the GPU when there is one, else the CPU (under
# Triton's interpreter, which tests/conftest.py switches on).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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

    Returns (cache, slot ids, k, v) with k, v float32 ``[B, n_max, H, D]`` as
    stored (rounded through the storage dtype).
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


def random_case(lens, H, G, D, P, dtype=torch.float32, seed=0, key_scale=1.5, slopes=False, device=None):
    """A random decode case: (cache, ids int32 ``[B]``, q ``[B, H*G, D]`` in
    ``dtype``, ALiBi slopes ``[H*G]`` or None), all on ``device`` (default DEVICE)."""
    device = DEVICE if device is None else device
    cache, slots, _, _ = random_cache(list(lens), H, D, P, dtype=dtype, seed=seed, key_scale=key_scale,
                                      device=device)
    gen = torch.Generator().manual_seed(seed + 101)
    q = (torch.randn(len(lens), H * G, D, generator=gen) * 1.5).to(dtype).to(device)
    ids = torch.tensor(slots, dtype=torch.int32, device=device)
    sl = alibi(H * G).to(device) if slopes else None
    return cache, ids, q, sl


def page_sets(sel) -> List[List[Set[int]]]:
    """A Selection's kept logical pages as one set per (row, selection head)."""
    B, S, _ = sel.pages.shape
    p, c = sel.pages.cpu(), sel.counts.cpu()
    return [[set(p[b, s, : int(c[b, s])].tolist()) for s in range(S)] for b in range(B)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def alibi(q_heads: int, nape: bool = True) -> torch.Tensor:
    """ALiBi slopes ``[q_heads]`` float32 (geometric); with ``nape`` the second
    half of the heads gets slope 0 (no position)."""
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / q_heads) for i in range(q_heads)])
    if nape:
        s[q_heads // 2:] = 0.0
    return s
