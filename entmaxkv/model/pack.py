"""Row-packed projection weights for the decode step.

At decode a projection is a matrix-vector product per row of the batch:
its cost is its weight's bytes plus a fixed cost per launch, which for
the small k and v projections is most of it. Stacking the q, k and v
weights into one [H*D + 2*KV*D, C] matrix and SwiGLU's gate and up
weights into one [2*F, C] makes a layer's seven products four, with the
same bytes read.

The modules keep their parameters: each weight becomes a view of the
packed matrix (same values, shared memory, ``state_dict`` unchanged), so
an in-place update of either reaches both and no weight is stored twice.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from .._checks import describe

__all__ = ["PackedRows"]


class PackedRows:
    """One packed weight over ``linears`` (bias-free ``nn.Linear``s with
    the same ``in_features``, dtype and device).

    ``weight()`` -> [sum of out_features, in_features]: the matrix whose row
    blocks are the modules' weights in order. Construction packs them
    (copies once; each module's weight then views the packed matrix), or
    finds them packed already (by another step over the same model) and
    shares that matrix.
    ``stale()`` says whether a module's weight has been replaced since (by
    ``model.to``, ``load_state_dict(assign=True)`` or an assignment): the
    packed matrix no longer holds it, and ``repack()`` must run before the
    next product. The check reads pointers only (no device work).
    """

    def __init__(self, linears: Sequence[nn.Linear], name: str) -> None:
        self.linears: List[nn.Linear] = list(linears)
        self.name = name
        self.sizes = [lin.out_features for lin in self.linears]
        self.repack()

    def check(self) -> None:
        """Raise ValueError unless the modules can be packed."""
        first = self.linears[0].weight
        for lin, n in zip(self.linears, self.sizes):
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise ValueError(f"{self.name}: expected bias-free nn.Linear modules, got {describe(lin)}")
            w = lin.weight
            if w.dim() != 2 or w.shape[0] != n:
                raise ValueError(f"{self.name}: expected a weight of {n} rows (the packed split), got "
                                 f"{tuple(w.shape)}")
            if w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device:
                raise ValueError(f"{self.name}: expected weights with one in_features, dtype and device, got "
                                 f"{tuple(first.shape)} {first.dtype} on {first.device} and {tuple(w.shape)} "
                                 f"{w.dtype} on {w.device}")

    @torch.no_grad()
    def repack(self) -> None:
        """Copy the modules' current weights into a new packed matrix and
        make each weight a view of it."""
        self.check()
        packed = self._packed_already()
        if packed is None:
            packed = torch.cat([lin.weight.detach() for lin in self.linears], dim=0)
            start = 0
            for lin, n in zip(self.linears, self.sizes):
                lin.weight.data = packed[start:start + n]
                start += n
        self._packed = packed
        self._ptrs = [lin.weight.data_ptr() for lin in self.linears]
        # the modules' parameter dicts (kept across assignments): read without nn.Module's __getattr__
        self._params = [lin._parameters for lin in self.linears]

    def _packed_already(self):
        """The packed matrix as a view, when the weights are consecutive row
        blocks of one storage already; else None."""
        ws = [lin.weight.detach() for lin in self.linears]
        base, cols = ws[0], ws[0].shape[1]
        start = base.storage_offset()
        for w, n in zip(ws, self.sizes):
            if (not w.is_contiguous() or w.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                    or w.storage_offset() != start):
                return None
            start += n * cols
        return base.as_strided((sum(self.sizes), cols), (cols, 1), base.storage_offset())

    def stale(self) -> bool:
        """Whether some module's weight is no longer a view of the packed matrix."""
        for params, ptr in zip(self._params, self._ptrs):
            if params["weight"].data_ptr() != ptr:
                return True
        return False

    def weight(self) -> torch.Tensor:
        """The packed matrix [sum of out_features, in_features] (no grad)."""
        return self._packed
