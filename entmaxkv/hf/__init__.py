"""Hugging Face transformers integration (extra ``entmaxkv[hf]``, transformers >= 5.17, < 5.24).

    import entmaxkv.hf
    from entmaxkv import TopK

    entmaxkv.hf.register()                       # adds attn_implementation "entmaxkv" and its mask
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="entmaxkv")
    cache = entmaxkv.hf.EntmaxKVCache(model, policy=TopK(1024), max_len=32768)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

The prompt (and any chunk of it) is attended densely, every new token is
decoded through EntmaxKV with the cache's policy; left padding never enters
the cache. What it does not support raises ``Unsupported`` (a ValueError)
naming it: beam search, assisted decoding, batch reshuffles, sliding-window
or soft-capped attention, attention sinks.
"""
from __future__ import annotations

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .attention import entmaxkv_attention, entmaxkv_mask
from .cache import EntmaxKVCache, Unsupported
from .twin import MODEL_TYPE, ByteTokenizer, TwinConfig, TwinForCausalLM, convert

__all__ = ["ATTN_IMPLEMENTATION", "ByteTokenizer", "EntmaxKVCache", "TwinConfig", "TwinForCausalLM",
           "Unsupported", "convert", "register"]

ATTN_IMPLEMENTATION = "entmaxkv"
SUPPORTED = ((5, 17), (5, 24))  # transformers versions: [from, to)


def _version() -> tuple:
    return tuple(int(x) for x in transformers.__version__.split(".")[:2])


def register() -> str:
    """Register with transformers (idempotent): the "entmaxkv" attention
    implementation and its mask, and the twins (TwinConfig, TwinForCausalLM,
    ByteTokenizer) with the Auto classes. Returns the name to pass as
    ``attn_implementation``. Raises ImportError for an unsupported version."""
    if not SUPPORTED[0] <= _version() < SUPPORTED[1]:
        raise ImportError(f"entmaxkv.hf supports transformers >= 5.17, < 5.24; this is {transformers.__version__}")
    AttentionInterface.register(ATTN_IMPLEMENTATION, entmaxkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, entmaxkv_mask)
    AutoConfig.register(MODEL_TYPE, TwinConfig, exist_ok=True)
    AutoModelForCausalLM.register(TwinConfig, TwinForCausalLM, exist_ok=True)
    AutoTokenizer.register(TwinConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)
    return ATTN_IMPLEMENTATION
