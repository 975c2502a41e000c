"""Scratch memory for the decode kernels: a bump allocator over one device buffer.

A decode step needs a dozen scratch tensors (candidate lists, key tables,
partial outputs) whose sizes follow from the shapes alone. ``Workspace``
hands them out as views of one buffer it owns, in the order the launchers
ask, and starts over at every step (``begin``), so a planned decoder
allocates nothing per call and a captured CUDA graph always sees the same
addresses. Scratch of one step is distinct; consecutive steps reuse the same
memory, which is safe because the kernels run in stream order (the same
reuse PyTorch's caching allocator makes between eager calls).

Sizing: a step that asks for more than the buffer holds gets the rest from
``torch.empty`` and records how much it needed; ``end`` then grows the
buffer to that high-water mark (``grew`` says so; ``version`` counts the
buffers), and later steps fit.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

__all__ = ["Workspace", "TORCH_ALLOC"]

_ALIGN = 256  # bytes: every view starts on a 256-byte boundary (vectorised loads)


class _TorchAlloc:
    """``Workspace``'s interface over plain ``torch.empty`` / ``torch.zeros``
    (what the stage functions use when no workspace is given)."""

    @staticmethod
    def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)


TORCH_ALLOC = _TorchAlloc()


class Workspace:
    """A growable scratch arena on one device (see the module docstring).

    Args:
        device: where the buffer lives.
        nbytes: initial size in bytes (0: sized by the first step).
    """

    def __init__(self, device: Union[str, torch.device], nbytes: int = 0) -> None:
        self.device = torch.device(device)
        self._buf = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        self._off = 0
        self._need = 0  # bytes the current step asked for
        self._high = 0  # the most any step asked for
        self.grew = False
        self.version = 0  # buffers replaced so far: a graph captured under another version reads freed memory

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self._buf.numel()

    def begin(self) -> None:
        """Start a step: every view handed out from now on may reuse the last step's memory."""
        self._off = 0
        self._need = 0

    def end(self) -> bool:
        """End a step; grow the buffer if the step did not fit. Returns ``grew``."""
        self._high = max(self._high, self._need)
        self.grew = self._high > self._buf.numel()
        if self.grew:
            self._buf = torch.empty(self._high, dtype=torch.uint8, device=self.device)
            self.version += 1
        return self.grew

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype, device=None) -> torch.Tensor:
        """An uninitialised ``dtype`` tensor of ``shape`` (``device``, if
        given, must be the workspace's: it is accepted for the signature of
        ``torch.empty``)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size() if dtype not in _ITEMSIZE else _ITEMSIZE[dtype]
        nbytes = math.prod(shape) * itemsize
        start = self._off
        self._off = start + -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        self._need = max(self._need, self._off)
        if self._off > self._buf.numel():
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._buf[start:start + nbytes].view(dtype).view(shape)

    def zeros(self, shape: Union[int, Sequence[int]], dtype: torch.dtype, device=None) -> torch.Tensor:
        """``empty`` filled with zeros (one fill launch)."""
        return self.empty(shape, dtype).zero_()


_ITEMSIZE = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 2,
             torch.int32: 4, torch.int64: 8, torch.uint8: 1, torch.int8: 1, torch.bool: 1}
