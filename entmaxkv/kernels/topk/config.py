"""TopKConfig: the top-k selection kernels' launch choices (docs/tuning.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopKConfig:
    """Launch choices of the top-k selection kernels."""
