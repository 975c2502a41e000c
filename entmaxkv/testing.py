"""Builders for tests and checks: random paged caches, their dense twins, errors.

Used by the test suite and by the GPU checks; nothing in the library imports it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Sequence, Set

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


POISON_KINDS = ("nan-k", "nan-kv", "nan-v", "inf-k", "overflow", "nan-q")


def poisoned_case(kind: str, where: str, lens: Sequence[int], page_size: int, group: int, dtype,
                  *, seed: int = 0, kv_heads: int = 2, head_dim: int = 16, device="cpu"):
    """A cache whose row 0 holds one bad value of KV head 0, for the
    non-finite-input tests; every other row is clean.

    kind: "nan-k", "nan-kv", "nan-v", "inf-k", "overflow" (1e5 in a key:
    finite in float32, inf once stored as float16) or "nan-q" (the bad value
    is in query head 0 instead). where: "kept" (the last page, which every
    policy keeps) or "dropped" (page 0). Returns (cache, seq ids, q
    ``[len(lens), kv_heads * group, head_dim]`` in ``dtype``), on ``device``.
    """
    if kind not in POISON_KINDS:
        raise ValueError(f"kind: expected one of {POISON_KINDS}, got {kind!r}")
    if where not in ("kept", "dropped"):
        raise ValueError(f"where: expected 'kept' or 'dropped', got {where!r}")
    gen = torch.Generator().manual_seed(seed)
    P, H, D = page_size, kv_heads, head_dim
    cache = PagedKVCache(sum(-(-n // P) for n in lens) + 2, P, H, D, max_seqs=len(lens), dtype=dtype,
                         device=device)
    q = torch.randn(len(lens), H * group, D, generator=gen) * 1.5
    seqs = []
    for b, n in enumerate(lens):
        k = torch.randn(n, H, D, generator=gen) * 1.5
        v = torch.randn(n, H, D, generator=gen)
        if b == 0 and kind != "nan-q":
            j = n - 1 if where == "kept" else 1
            if kind in ("nan-k", "nan-kv"):
                k[j, 0, 3] = float("nan")
            if kind in ("nan-v", "nan-kv"):
                v[j, 0, 5] = float("nan")
            if kind == "inf-k":
                k[j, 0, 3] = float("inf")
            if kind == "overflow":
                k[j, 0, 3] = 1e5
        seqs.append(cache.allocate(k.to(device), v.to(device), check_finite=False))
    if kind == "nan-q":
        q[0, 0, 2] = float("nan")
    return cache, seqs, q.to(dtype).to(device)


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


# ------------------------------------------------------------ cache state
# Every host mirror; the device tensors come from PagedKVCache.state_tensors
# (pages, statistics and Welford state of every layer, block table, lengths).
_STATE_HOST = ("_free", "_free_slots", "_active", "_lens", "_pages")
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cache_state(cache: PagedKVCache) -> Dict[str, Any]:
    """A snapshot of every piece of state of ``cache``, for ``assert_same_state``.

    Holds clones of the device tensors (pages, statistics, Welford state,
    block table, lengths), whether each requires grad or is an inference
    tensor, and deep copies of the host mirrors (free list, free slots,
    active flags, lengths, page lists).
    """
    state: Dict[str, Any] = {}
    for name, t in cache.state_tensors().items():
        state[name] = t.detach().clone()
        state[name + ".flags"] = (t.requires_grad, t.grad_fn is not None, t.is_inference())
    for name in _STATE_HOST:
        state[name] = copy.deepcopy(getattr(cache, name))
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so NaN payloads and -0.0 compare exactly)."""
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def assert_same_state(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    """Assert two ``cache_state`` snapshots are bit-identical.

    Raises AssertionError naming the first piece of state that differs (and,
    for a tensor, how many of its elements do).
    """
    assert a.keys() == b.keys(), f"different state keys: {sorted(a.keys() ^ b.keys())}"
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device, (
                f"{name}: {x.dtype} {tuple(x.shape)} on {x.device} vs "
                f"{y.dtype} {tuple(y.shape)} on {y.device}"
            )
            if not torch.equal(_bits(x), _bits(y)):
                diff = int((_bits(x) != _bits(y)).sum())
                raise AssertionError(f"{name}: {diff} of {x.numel()} elements differ")
        else:
            assert x == y, f"{name}: {x!r} != {y!r}"


class InjectedFailure(RuntimeError):
    """Raised by a function wrapped by ``inject_failure``."""


class _CallCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.fired = False


@contextlib.contextmanager
def inject_failure(owner: Any, name: str, *, on_call: int, after: bool = False) -> Iterator[_CallCounter]:
    """Make ``owner.name`` raise ``InjectedFailure`` on its ``on_call``-th call (1-based).

    ``owner`` is a module or a class, e.g. ``(torch, "where")`` or
    ``(torch.Tensor, "__setitem__")``. With ``after`` the failing call runs
    first and then raises (a failure after its effect). The original is put
    back when the block exits. Yields a counter: ``calls`` made so far and
    ``fired`` (whether the failure was raised), so a caller can sweep
    ``on_call = 1, 2, ...`` until a call completes without ``fired``.
    """
    if on_call < 1:
        raise ValueError(f"on_call must be >= 1, got {on_call}")
    original = getattr(owner, name)
    had_own = name in vars(owner)
    own = vars(owner).get(name)
    counter = _CallCounter()

    def wrapper(*args, **kwargs):
        counter.calls += 1
        if counter.calls != on_call:
            return original(*args, **kwargs)
        counter.fired = True
        if after:
            original(*args, **kwargs)
        raise InjectedFailure(f"injected failure in call {on_call} of {name}")

    # A staticmethod found on a class must stay one, or it would be bound.
    setattr(owner, name, staticmethod(wrapper) if isinstance(own, staticmethod) else wrapper)
    try:
        yield counter
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


def tau_hat_oracle(q, cache, seq_ids, *, scale: float, slopes=None, alpha: float, pooled: bool = False):
    """The Gaussian policy's tau_hat from float64 page statistics (the
    reference solve, run to convergence): float64 ``[batch, q_heads]``, what
    the kernels' float32 statistics and float64 iterate are checked against."""
    from .gaussian import pooled_moments, solve_tau_hat
    from .scoring import gaussian_stats

    sl = None if slopes is None else slopes.double()
    mu, sg, n = gaussian_stats(q.double(), cache, seq_ids, scale=scale, slopes=sl)
    w = n[:, None, :].expand_as(mu)
    if pooled:
        a, b, c = pooled_moments(mu, sg, w)
        return solve_tau_hat(a[..., None], b[..., None], c[..., None], alpha, iters=120)
    return solve_tau_hat(mu, sg, w, alpha, iters=120)


def gpu_quick() -> bool:
    """Whether the GPU tests (tests/gpu) run their short sweeps: the
    environment variable ENTMAXKV_GPU_QUICK set to anything but "" or "0"."""
    import os

    return os.environ.get("ENTMAXKV_GPU_QUICK", "0") not in ("", "0")
