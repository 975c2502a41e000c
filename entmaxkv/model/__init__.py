"""A compact entmax/softmax language model served through EntmaxKV.

- ``lm``: ModelConfig and TransformerLM (full causal forward, prefill into
  paged caches, decode steps through ``entmaxkv.decode``).
- ``checkpoint``: safetensors save/load (config.json alongside).
- ``generate``: DecodeSession, ``generate`` and the ``entmaxkv generate`` CLI hooks.
- ``data``: the byte-level corpus, its train/test split and passkey prompts.
- ``train``: lockstep training of the entmax/softmax twins.
"""
from .checkpoint import load_model, save_model
from .lm import ModelConfig, TransformerLM

__all__ = ["ModelConfig", "TransformerLM", "load_model", "save_model"]
