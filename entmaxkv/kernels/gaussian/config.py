"""GaussianConfig: the Gaussian selection kernels' launch choices (docs/tuning.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GaussianConfig:
    """Launch choices of the Gaussian selection kernels."""
