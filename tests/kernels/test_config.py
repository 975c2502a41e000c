"""KernelConfig: the kernels' launch choices are values passed in, not module state."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, TopK, decode  # noqa: E402
from entmaxkv.kernels.config import DEFAULT, resolve  # noqa: E402
from entmaxkv.testing import random_case, rel_err  # noqa: E402


def test_resolve_defaults_and_rejects_other_values():
    assert resolve(None) is DEFAULT and resolve(K.KernelConfig(pdl=False)).pdl is False
    for bad in ("pdl=False", {"pdl": False}, K.TopKConfig()):
        with pytest.raises(ValueError, match="config: expected a KernelConfig"):
            resolve(bad)


def test_configs_are_frozen_values():
    cfg = K.KernelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pdl = False
    assert cfg == K.KernelConfig() and hash(cfg) == hash(K.KernelConfig())
    assert isinstance(cfg.attention, K.AttentionConfig) and isinstance(cfg.topk, K.TopKConfig)
    assert isinstance(cfg.gaussian, K.GaussianConfig)


def test_decode_takes_a_kernel_config():
    cache, ids, q, sl = random_case([90, 37], 2, 2, 16, 4, seed=3, slopes=True)
    ref = decode(q, cache, ids, Certified(seed=TopK(24)), alpha=1.5, alibi_slopes=sl, backend="reference")
    for cfg in (None, K.KernelConfig(pdl=False)):
        out = decode(q, cache, ids, Certified(seed=TopK(24)), alpha=1.5, alibi_slopes=sl, backend="triton",
                     kernel_config=cfg)
        assert rel_err(out, ref) < 1e-4
    with pytest.raises(ValueError, match="config"):
        decode(q, cache, ids, TopK(24), alpha=1.5, backend="triton", kernel_config="fast")
    assert torch.isfinite(ref).all()


def test_command_line_fields_make_a_config():
    """The benchmarks' --config FIELD=VALUE / STAGE.FIELD=VALUE options
    (benchmarks.harness.kernel_config) build the same frozen values the
    tests pass, and name an unknown field."""
    from benchmarks.harness import kernel_config

    assert kernel_config([]) is None
    cfg = kernel_config(["pdl=False", "attention.finish=False", "topk.keys_tune=(('KCH', 8),)"])
    assert cfg == K.KernelConfig(pdl=False, attention=K.AttentionConfig(finish=False),
                                 topk=K.TopKConfig(keys_tune=(("KCH", 8),)))
    hash(cfg)
    for bad in ("attention.FINISH=False", "nosuch=1"):
        with pytest.raises(ValueError, match="--config"):
            kernel_config([bad])
