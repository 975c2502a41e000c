"""TritonBackend: the kernels under the stage contract of ``entmaxkv.backend.Backend``."""
from __future__ import annotations

from .attention import attend, dense_attend
from .certified import certify
from .config import resolve
from .scoring import quest_bounds
from .select import select


class TritonBackend:
    """The Triton kernels with one launch config (``KernelConfig``; None: defaults)."""

    name = "triton"

    def __init__(self, config=None):
        self.config = resolve(config)

    def quest_bounds(self, q, cache, seq_ids, *, scale, slopes=None):
        return quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, config=self.config)

    def select(self, policy, q, cache, seq_ids, *, alpha, scale, slopes=None, ub=None):
        # The kernels fuse the bound into the selection; a given ub is not needed.
        return select(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, config=self.config)

    def attend(self, q, cache, seq_ids, sel, *, alpha, scale, slopes=None, tau_init=None):
        return attend(q, cache, seq_ids, sel, alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init,
                      config=self.config)

    def dense_attend(self, q, cache, seq_ids, *, alpha, scale, slopes=None):
        return dense_attend(q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, config=self.config)

    def certify(self, ub, sel, tau, alpha, seq_lens, *, page_size, slack=None):
        return certify(ub, sel, tau, alpha, seq_lens, page_size=page_size, slack=slack, config=self.config)
