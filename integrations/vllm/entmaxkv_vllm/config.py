"""The backend's settings, read from vLLM's ``--additional-config``.

One route only: the ``"entmaxkv"`` entry of vLLM's additional config (the
command line's ``--additional-config '{"entmaxkv": {...}}'``, or
``LLM(..., additional_config={"entmaxkv": {...}})``). The page size is
vLLM's own ``--block-size``. Unknown keys and bad values are refused with a
``ValueError`` naming the key, before any model is loaded.

Keys (all optional):

    policy       "full" (default), "topk", "gaussian" or "certified"
    budget       tokens a top-k selection keeps (default 1024); the seed of "certified"
    alpha        entmax alpha in [1, 4] (default 1.0: softmax, i.e. Quest with "topk")
    q_max        the Gaussian policy's quantile (default 0.995)
    backend      "auto" (Triton on CUDA), "reference" or "triton"
    prefill_scores  the most attention scores one prefill chunk of queries holds (default 2**26)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from entmaxkv._checks import as_choice, as_int
from entmaxkv.backend import BACKENDS
from entmaxkv.limits import check_alpha, effective_alpha
from entmaxkv.policies import POLICY_NAMES, make_policy

__all__ = ["KEY", "Settings", "settings_from"]

KEY = "entmaxkv"  # the additional-config entry


@dataclass(frozen=True)
class Settings:
    """What the backend runs (see the module docstring for the keys)."""

    policy: str = "full"
    budget: int = 1024
    alpha: float = 1.0
    q_max: float = 0.995
    backend: str = "auto"
    prefill_scores: int = 1 << 26
    policy_obj: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        name = as_choice(self.policy, f"{KEY}.policy", POLICY_NAMES)
        alpha = effective_alpha(check_alpha(self.alpha, f"{KEY}.alpha"))
        as_choice(self.backend, f"{KEY}.backend", BACKENDS)
        as_int(self.prefill_scores, f"{KEY}.prefill_scores", lo=1)
        try:
            pol = make_policy(name, budget=self.budget, q_max=self.q_max)
        except ValueError as err:
            raise ValueError(f"{KEY}.{err}") from None
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "policy_obj", pol)


def settings_from(additional_config: Any) -> Settings:
    """The ``Settings`` of vLLM's ``additional_config`` (a dict or None)."""
    if additional_config is None:
        return Settings()
    if not isinstance(additional_config, Mapping):
        raise ValueError(f"additional_config: expected a mapping, got {type(additional_config).__name__}")
    raw = additional_config.get(KEY, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"additional_config[{KEY!r}]: expected a mapping of settings, got {raw!r}")
    known = {f for f in Settings.__dataclass_fields__ if f != "policy_obj"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"additional_config[{KEY!r}]: unknown keys {unknown} (expected some of {sorted(known)})")
    return Settings(**raw)
