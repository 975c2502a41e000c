"""The project's twin models as transformers models (``AutoModelForCausalLM``).

``TwinConfig`` mirrors ``entmaxkv.model.ModelConfig`` (plus the names
transformers and ``EntmaxKVCache`` look for: num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, entmax_alpha);
``TwinForCausalLM`` wraps the same ``TransformerLM`` modules, so a
checkpoint converts by renaming nothing (``convert``); ``ByteTokenizer`` is
the twins' byte-level tokenizer (token id = UTF-8 byte). ``register()``
(entmaxkv.hf) makes all three loadable with the Auto classes.

Attention: "entmaxkv" (with an EntmaxKVCache: the paged, sparse decode;
ALiBi slopes reach it as a keyword) or "eager" (the model's own dense
causal attention, NAPE positions and entmax or softmax, over a transformers
DynamicCache, left padding masked).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel, PreTrainedTokenizer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..entmax import entmax
from ..model.checkpoint import load_model
from ..model.lm import ModelConfig, TransformerLM

__all__ = ["ByteTokenizer", "TwinConfig", "TwinForCausalLM", "convert"]

MODEL_TYPE = "entmaxkv_twin"


class TwinConfig(PretrainedConfig):
    """The twin architecture's hyper-parameters (``ModelConfig``'s fields)."""

    model_type = MODEL_TYPE

    def __init__(self, vocab_size=256, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=704,
                 attention="entmax", alpha=1.5, positions="nape", rope_base=10000.0, norm_eps=1e-5,
                 train_context=2048, init_std=0.02, **kwargs):
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)
        mc = ModelConfig(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, attention, alpha, positions,
                         rope_base, norm_eps, train_context, init_std)  # (checks every field)
        for name, value in mc.to_dict().items():
            setattr(self, name, value)
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = n_layers, n_heads, n_kv_heads
        self.hidden_size, self.head_dim = d_model, mc.head_dim
        self.entmax_alpha = mc.attn_alpha
        self.max_position_embeddings = 1 << 24

    def model_config(self) -> ModelConfig:
        return ModelConfig(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.n_kv_heads, self.d_ff,
                           self.attention, self.alpha, self.positions, self.rope_base, self.norm_eps,
                           self.train_context, self.init_std)


class TwinForCausalLM(PreTrainedModel, GenerationMixin):
    """A twin (``TransformerLM``) behind transformers' model interface."""

    config_class = TwinConfig
    base_model_prefix = "lm"
    _supports_attention_backend = True
    _tied_weights_keys = {}
    _no_split_modules = ["Block"]

    def __init__(self, config: TwinConfig) -> None:
        super().__init__(config)
        self.lm = TransformerLM(config.model_config())
        self._slopes = {}
        self.post_init()

    def slopes(self, device) -> torch.Tensor:
        """ALiBi slopes float32 [n_heads] on ``device`` (from the config: a
        non-persistent buffer is not restored by from_pretrained)."""
        device = torch.device(device)
        if device not in self._slopes:
            value = torch.tensor(self.config.model_config().alibi_slopes(), dtype=torch.float32)
            self._slopes[device] = value.to(device)
            with torch.no_grad():  # and the wrapped model's own buffer (for its prefill / decode_step)
                self.lm.slopes.copy_(value)
        return self._slopes[device]

    def _init_weights(self, module) -> None:  # (the twin initialises itself)
        return

    def get_input_embeddings(self):
        return self.lm.embed

    def set_input_embeddings(self, value):
        self.lm.embed = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None, use_cache=None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        lm, cfg = self.lm, self.config
        B, T = input_ids.shape
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(T, device=input_ids.device) + seen)[None].expand(B, T)
        x = lm.embed(input_ids)
        mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        impl = cfg._attn_implementation
        for i, blk in enumerate(lm.blocks):
            q, k, v = blk.attn.project(blk.attn_norm(x), position_ids)  # [B, T, H|KV, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, i)
            if impl == "eager":
                o = self._eager(q, k, v, mask, position_ids)
            else:
                o, _ = ALL_ATTENTION_FUNCTIONS[impl](blk.attn, q, k, v, mask, scaling=lm.scale,
                                                     alibi_slopes=self.slopes(q.device))
            x = x + blk.attn.wo(o.reshape(B, T, -1).to(x.dtype))
            x = x + blk.mlp(blk.mlp_norm(x))
        x = x if not logits_to_keep else x[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=lm._logits(x), past_key_values=past_key_values)

    def _eager(self, q, k, v, mask, position_ids) -> torch.Tensor:
        """Dense causal attention with the NAPE bias: q [B, H, T, D] over the
        cached k, v [B, KV, S, D] (positions: the last T of S are the new
        ones; the mask masks the left padding). Returns [B, T, H, D]."""
        lm = self.lm
        B, H, T, D = q.shape
        S = k.shape[2]
        G = H // k.shape[1]
        s = torch.matmul(q.float(), k.float().repeat_interleave(G, 1).transpose(2, 3)) * lm.scale  # [B, H, T, S]
        # key j sits at position j - (S - T) relative to the first new token
        rel = torch.arange(S, device=q.device)[None, :] - (S - T) - torch.arange(T, device=q.device)[:, None]
        s = s + self.slopes(q.device).view(1, H, 1, 1) * rel.float()
        if mask is not None:
            s = s + mask.float()
        else:
            s = s.masked_fill(rel > 0, float("-inf"))
        p = entmax(s, self.config.entmax_alpha, dim=-1)
        return torch.matmul(p, v.float().repeat_interleave(G, 1)).transpose(1, 2)


class ByteTokenizer(PreTrainedTokenizer):
    """The twins' tokenizer: one token per UTF-8 byte (ids 0..255); the pad
    and end tokens are the NUL byte (0)."""

    vocab_files_names = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        # the NUL byte pads and ends (it is never in the corpus, so nothing stops on it)
        kwargs.setdefault("pad_token", "<0x00>")
        kwargs.setdefault("eos_token", "<0x00>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self):
        return {chr(i) if i >= 32 else f"<0x{i:02X}>": i for i in range(256)} | self.added_tokens_encoder

    def _tokenize(self, text, **kwargs):
        return [f"<0x{b:02X}>" for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return int(token[3:5], 16) if token.startswith("<0x") and len(token) == 6 else 0

    def _convert_id_to_token(self, index):
        return f"<0x{index:02X}>"

    def convert_tokens_to_string(self, tokens):
        return bytes(self._convert_token_to_id(t) for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()


def convert(checkpoint: Union[str, Path], out: Union[str, Path]) -> Path:
    """Write a twin checkpoint (``entmaxkv.model`` format) as a
    ``save_pretrained`` folder with its tokenizer; returns the folder."""
    model = load_model(checkpoint)
    cfg = TwinConfig(**model.cfg.to_dict())
    hf = TwinForCausalLM(cfg)
    hf.lm.load_state_dict(model.state_dict())
    out = Path(out)
    hf.save_pretrained(out)
    ByteTokenizer().save_pretrained(out)
    meta = json.loads((Path(checkpoint) / "config.json").read_text()).get("meta", {})
    (out / "entmaxkv_meta.json").write_text(json.dumps(meta, indent=1))
    return out

