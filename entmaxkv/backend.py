"""The stage contract a decode step runs on, and its pure-PyTorch implementation.

``Backend`` is what ``decode`` needs of a backend: bounds, selection,
attention (sparse and dense) and the certificate, with the shapes below.
``ReferenceBackend`` (this module: the CPU path and the oracle) and
``entmaxkv.kernels.TritonBackend`` (the Triton kernels, with their launch
config) both satisfy it, so the decode step has one code path.
"""
from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

from . import attention, policies, scoring, sketch, write
from .types import Full, Policy, Selection

BACKENDS = ("auto", "reference", "triton")


class Backend(Protocol):
    """The stages of one decode step. Tensors: ``q`` [B, HQ, D]; ``seq_ids``
    int32 [B] on the cache's device; ``slopes`` float32 [HQ] or None.
    ``cache`` is anything with the attributes of ``layout.PagedKV`` (a
    ``PagedKVCache`` or one of its layers). ``ws`` is a
    ``workspace.Workspace`` the scratch may come from (None: allocated);
    ``out`` a [B, HQ, D] tensor in q's dtype to write the result to."""

    name: str

    def quest_bounds(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                     slopes: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
        """Quest upper bounds, float32 [B, HQ, max_pages] (-inf past the end)."""

    def select(self, policy: Policy, q: torch.Tensor, cache, seq_ids: torch.Tensor, *,
               alpha: float, scale: float, slopes: Optional[torch.Tensor] = None,
               ub: Optional[torch.Tensor] = None, ws=None) -> Selection:
        """The policy's pages; ``ub`` (the bounds above) may be reused when given."""

    def attend(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, sel: Selection, *,
               alpha: float, scale: float, slopes: Optional[torch.Tensor] = None,
               tau_init: Optional[torch.Tensor] = None, ws=None,
               out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Exact attention over the selected pages: (out [B, HQ, D] in q's dtype, tau float32 [B, HQ])."""

    def dense_attend(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, *, alpha: float,
                     scale: float, slopes: Optional[torch.Tensor] = None, ws=None,
                     out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention over every page (the Full policy), same outputs as ``attend``."""

    def certify(self, ub: torch.Tensor, sel: Selection, tau: torch.Tensor, alpha: float,
                seq_lens: torch.Tensor, *, page_size: int, slack: Optional[torch.Tensor] = None,
                ws=None) -> torch.Tensor:
        """bool [B, HQ]: every unselected page provably holds no support token (docs/spec.md §5)."""

    def write_kv(self, kv, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V rows at ``slot_mapping`` and update the touched pages' statistics (write.py)."""

    def kept_fraction(self, sel: Selection, cache, seq_ids: torch.Tensor, *, ws=None) -> torch.Tensor:
        """float32 [1]: kept pages over valid pages, over the batch and selection heads."""

    def gaussian_stats(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                       slopes: Optional[torch.Tensor] = None, ws=None):
        """(mu, sigma) float32 [B, HQ, max_pages] and valid tokens float32 [B, max_pages] of every page."""

    def safe_bounds(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                    slopes: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
        """Quest bounds plus their rounding slack, float32 [B, HQ, max_pages], or where the cache
        holds key sketches the smaller of that and ``sketch_bounds``: what the certificate compares."""

    def sketch_bounds(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                      slopes: Optional[torch.Tensor] = None, ws=None) -> torch.Tensor:
        """Safe page bounds from the cache's per-token key sketches (``cache.sketch`` set), float32
        [B, HQ, max_pages], rounding allowances included (``entmaxkv.sketch.sketch_bounds``)."""

    def candidates(self, q: torch.Tensor, cache, seq_ids: torch.Tensor, sel: Optional[Selection], *,
                   alpha: float, scale: float, slopes: Optional[torch.Tensor] = None, ws=None):
        """Entmax: (scores [B*HQ, C] (-inf padding), token ids int64 [B*HQ, C], lower [B*HQ]): every
        kept token that can be in the support; the others score below ``lower`` (score units), which
        is at most the kept tokens' threshold. ``sel`` None: every page."""


def _into(out: Optional[torch.Tensor], res: Tuple[torch.Tensor, torch.Tensor]):
    """(out, tau) with the result copied into ``out`` when one is given."""
    if out is None:
        return res
    out.copy_(res[0])
    return out, res[1]


class ReferenceBackend:
    """The pure-PyTorch stages (any device, float64 included). ``ws`` is not
    used: the reference allocates what it needs."""

    name = "reference"

    def quest_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return scoring.quest_bounds(q, cache, seq_ids, scale=scale, slopes=slopes)

    def select(self, policy, q, cache, seq_ids, *, alpha, scale, slopes=None, ub=None, ws=None):
        return policies.select(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, ub=ub)

    def attend(self, q, cache, seq_ids, sel, *, alpha, scale, slopes=None, tau_init=None, ws=None, out=None):
        return _into(out, attention.attend(q, cache, seq_ids, sel, alpha=alpha, scale=scale, slopes=slopes,
                                           tau_init=tau_init))

    def dense_attend(self, q, cache, seq_ids, *, alpha, scale, slopes=None, ws=None, out=None):
        sel = policies.select(Full(), q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes)
        return _into(out, attention.attend(q, cache, seq_ids, sel, alpha=alpha, scale=scale, slopes=slopes))

    def certify(self, ub, sel, tau, alpha, seq_lens, *, page_size, slack=None, ws=None):
        return attention.certify(ub, sel, tau, alpha, seq_lens, page_size=page_size, slack=slack)

    def write_kv(self, kv, k, v, slot_mapping):
        write.write_kv(kv, k, v, slot_mapping)

    def kept_fraction(self, sel, cache, seq_ids, *, ws=None):
        return attention.kept_fraction(sel, cache.seq_lens.index_select(0, seq_ids.long()), cache.page_size)

    def gaussian_stats(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return scoring.gaussian_stats(q, cache, seq_ids, scale=scale, slopes=slopes)

    def safe_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return scoring.safe_bounds(q, cache, seq_ids, scale=scale, slopes=slopes)

    def sketch_bounds(self, q, cache, seq_ids, *, scale, slopes=None, ws=None):
        return sketch.sketch_bounds(q, cache, seq_ids, scale=scale, slopes=slopes)

    def candidates(self, q, cache, seq_ids, sel, *, alpha, scale, slopes=None, ws=None):
        # the reference lists every kept token
        lay = scoring.page_layout(cache, seq_ids)
        if sel is None:
            sel = policies.select(Full(), q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes, layout=lay)
        s, _ = attention.selected_scores(q, cache, seq_ids, sel, scale=scale, slopes=slopes, layout=lay)
        B, HQ, _ = q.shape
        P = cache.page_size
        phys, _, _ = attention.selected_tokens(cache, sel, lay)  # [B, S, W]
        tokens = (phys[..., None] * P + torch.arange(P, device=phys.device)).reshape(B, sel.sel_heads, -1)
        tokens = tokens.repeat_interleave(HQ // sel.sel_heads, dim=1)
        lower = torch.full((B * HQ,), float("-inf"), dtype=s.dtype, device=s.device)
        return s.reshape(B * HQ, -1), tokens.reshape(B * HQ, -1), lower


REFERENCE = ReferenceBackend()


def _triton_backend(config):
    """The Triton backend with ``config``, or None when Triton cannot run here."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels.TritonBackend(config) if kernels.is_available() else None


def resolve_backend(backend: str, device: torch.device, config=None) -> Backend:
    """The backend to run on: ``backend`` is "auto" (Triton on CUDA when it is
    usable, else the reference), "reference" or "triton"; ``config`` is the
    kernels' KernelConfig (None: defaults; unused by the reference)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return REFERENCE
    kern = _triton_backend(config)
    if backend == "triton" and kern is None:
        raise ValueError(
            "backend: 'triton' requested but Triton is not usable here "
            "(install triton; on CPU set TRITON_INTERPRET=1)"
        )
    return kern if kern is not None else REFERENCE
