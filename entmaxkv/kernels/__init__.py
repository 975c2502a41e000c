"""Triton kernels for the whole decode step (twins of the reference stages).

Stage functions, with the reference signatures (docs/contracts.md):

    quest_bounds(q, cache, seq_ids, *, scale, slopes=None)          scoring.py
    gaussian_stats(q, cache, seq_ids, *, scale, slopes=None)        scoring.py
    select(policy, q, cache, seq_ids, *, alpha, scale, slopes)      select.py
        (topk/, gaussian/, certified.py)
    attend(q, cache, seq_ids, sel, *, alpha, scale, slopes, tau_init=None)
    dense_attend(q, cache, seq_ids, *, alpha, scale, slopes)        attention/
    certify(ub, sel, tau, alpha, seq_lens, *, page_size, slack=None) certified.py

Each also takes ``config``: a ``KernelConfig`` (config.py) of launch choices,
None for the defaults. ``TritonBackend`` (backend.py) bundles them under the
``entmaxkv.backend.Backend`` contract that ``decode`` runs on.

They run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this package is imported). Nothing reads a
GPU value on the host, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from ._common import interpreting
from .attention import attend, dense_attend
from .backend import TritonBackend
from .certified import certify
from .config import AttentionConfig, GaussianConfig, KernelConfig, TopKConfig
from .scoring import gaussian_stats, quest_bounds
from .select import select

__all__ = [
    "AttentionConfig",
    "GaussianConfig",
    "KernelConfig",
    "TopKConfig",
    "TritonBackend",
    "attend",
    "certify",
    "dense_attend",
    "gaussian_stats",
    "is_available",
    "quest_bounds",
    "select",
]


def is_available() -> bool:
    """True when the kernels can run here: a CUDA device, or the Triton interpreter."""
    return torch.cuda.is_available() or interpreting()
