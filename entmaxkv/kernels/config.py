"""KernelConfig: every launch choice of the decode step's kernels, in one value.

Each stage has its own frozen dataclass (``AttentionConfig``, ``TopKConfig``,
``GaussianConfig``), defined here so that this module imports nothing of the
kernels (every kernel module imports it); their defaults are the measured best on the H200
(docs/tuning.md). Public kernel entry points take ``config=None`` (the
defaults); tests and benchmarks pass a config instead of changing modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(frozen=True)
class AttentionConfig:
    """Launch choices of the sparse and dense attention kernels (kernels/attention)."""


@dataclass(frozen=True)
class TopKConfig:
    """Launch choices of the top-k selection kernels (kernels/topk)."""


@dataclass(frozen=True)
class GaussianConfig:
    """Launch choices of the Gaussian selection kernels (kernels/gaussian)."""

__all__ = ["AttentionConfig", "GaussianConfig", "KernelConfig", "TopKConfig", "resolve"]


@dataclass(frozen=True)
class KernelConfig:
    """The stage configs plus the choices shared by all stages.

    Attributes:
        attention, topk, gaussian: the stages' launch choices.
        pdl: launch the step's kernels with programmatic dependent launch
            (sm_90+; ignored elsewhere): a kernel's programs may be scheduled
            while its predecessor drains, hiding the gap between dependent
            launches.
    """

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    topk: TopKConfig = field(default_factory=TopKConfig)
    gaussian: GaussianConfig = field(default_factory=GaussianConfig)
    pdl: bool = True


DEFAULT = KernelConfig()


def resolve(config) -> KernelConfig:
    """``config`` itself, or the defaults for None; anything else is a ValueError."""
    if config is None:
        return DEFAULT
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    return config
