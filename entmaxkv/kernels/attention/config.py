"""AttentionConfig: the attention kernels' launch choices (docs/tuning.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionConfig:
    """Launch choices of the sparse / dense attention kernels."""
