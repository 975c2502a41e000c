"""TritonBackend: the kernels under the stage contract of ``entmaxkv.backend.Backend``."""
from __future__ import annotations

import torch

from .attention import attend, candidates, dense_attend
from .certified import certify, kept_fraction
from .config import resolve
from .scoring import bounds_with_slack, gaussian_stats, quest_bounds
from .select import select
from .write import write_kv


class TritonBackend:
    """The Triton kernels with one launch config (``KernelConfig``; None: defaults)."""

    name = "triton"

    def __init__(self, config=None):
        self.config = resolve(config)

    def quest_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, config=self.config, ws=ws)

    def select(self, policy, q, cache, seq_ids, *, alpha, scale, slopes=None, ub=None, ws=None):
        # The kernels fuse the bound into the selection; a given ub is not needed.
        return select(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, config=self.config,
                      ws=ws)

    def attend(self, q, cache, seq_ids, sel, *, alpha, scale, slopes=None, tau_init=None, ws=None, out=None):
        return attend(q, cache, seq_ids, sel, alpha=alpha, scale=scale, slopes=slopes, tau_init=tau_init,
                      config=self.config, ws=ws, out=out)

    def dense_attend(self, q, cache, seq_ids, *, alpha, scale, slopes=None, ws=None, out=None):
        return dense_attend(q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, config=self.config,
                            ws=ws, out=out)

    def certify(self, ub, sel, tau, alpha, seq_lens, *, page_size, slack=None, ws=None):
        return certify(ub, sel, tau, alpha, seq_lens, page_size=page_size, slack=slack, config=self.config,
                       ws=ws)

    def write_kv(self, kv, k, v, slot_mapping):
        write_kv(kv, k, v, slot_mapping)

    def kept_fraction(self, sel, cache, seq_ids, *, ws=None):
        return kept_fraction(sel, cache.seq_lens, seq_ids, cache.page_size, ws=ws)

    def gaussian_stats(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return gaussian_stats(q, cache, seq_ids, scale=scale, slopes=slopes, config=self.config, ws=ws)

    def safe_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        bound = bounds_with_slack(q, cache, seq_ids, scale=scale, slopes=slopes, ws=ws)
        if getattr(cache, "sketch", None) is None:
            return bound
        return torch.minimum(bound, self.sketch_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, ws=ws))

    def sketch_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        from .sketch import sketch_bounds

        return sketch_bounds(q, cache, seq_ids, scale=scale, slopes=slopes, ws=ws)

    def candidates(self, q, cache, seq_ids, sel, *, alpha, scale, slopes=None, ws=None):
        return candidates(q, cache, seq_ids, sel, alpha=alpha, scale=scale, slopes=slopes, config=self.config,
                          ws=ws)
