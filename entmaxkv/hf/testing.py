"""What the HF tests share (tests/test_hf.py on the CPU, tests/gpu/test_hf.py
on the device): tiny random stock models built offline from configs, and a
dense alpha-entmax attention registered with transformers as
"entmax_dense" (eager attention with entmax in place of softmax: the
reference an EntmaxKVCache generation is compared with)."""
from __future__ import annotations

import torch
from transformers import (AttentionInterface, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from ..entmax import entmax

__all__ = ["DENSE", "MODELS", "SMALL", "generate", "register_dense", "tiny_model"]

DENSE = "entmax_dense"
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=256)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=16, **SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(sliding_window=None, **SMALL)),
}


def _entmax_dense(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, dim=1)
    v = value.repeat_interleave(G, dim=1)
    s = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling
    if attention_mask is not None:
        s = s + attention_mask.float()
    p = entmax(s, module.config.entmax_alpha, dim=-1)
    return torch.matmul(p, v.float()).to(query.dtype).transpose(1, 2).contiguous(), None


def register_dense() -> str:
    """Register "entmax_dense" (attention and eager mask) with transformers."""
    AttentionInterface.register(DENSE, _entmax_dense)
    AttentionMaskInterface.register(DENSE, eager_mask)
    return DENSE


def tiny_model(name: str, seed: int = 0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return MODELS[name]().to(device=device, dtype=dtype).eval()


def generate(model, impl: str, ids, mask, cache=None, n: int = 8, **kw):
    """Greedy generation with attention implementation ``impl``: (new tokens
    [B, n], scores float [B, n, vocab]). Uncompiled unless
    ``disable_compile=False`` is passed (transformers compiles the decode
    step of a compileable cache on the GPU by default)."""
    kw.setdefault("disable_compile", True)
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, past_key_values=cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1).float()
