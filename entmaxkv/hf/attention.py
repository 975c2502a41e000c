"""The "entmaxkv" attention implementation for transformers, and its mask.

``entmaxkv_mask`` replaces transformers' 4-D mask by what the attention
function needs: which of the new positions of each row are real tokens
(not left padding), as a bool tensor [B, 1, T, 1]. transformers passes a
4-D mask through its own mask code unchanged, and its shape does not grow
with the cache, so a compiled decode step sees the same shape every token.
``entmaxkv_attention`` then, for the layer's new tokens (q [B, HQ, T, D],
k, v [B, H, T, D]):

- writes the real ones (padding never enters the cache) into the layer of
  the paged cache: at layer 0 the pages are reserved for every layer
  (``PagedKVCache.reserve``), each layer writes through the slot mapping;
- T = 1 for every row (decoding): one planned EntmaxKV step with the
  cache's policy (plan at layer 0; per layer the write and the attention,
  one CUDA graph on CUDA: ``entmaxkv.hf.step``);
- otherwise (a prompt, or a chunk of one after cached context): dense
  causal attention of each row's new real tokens over its cached and new
  tokens, alpha-entmax or softmax: on CUDA the GPU prefill (SDPA or the
  fused Triton kernel, no T x T scores), else ``entmaxkv.prefill``; a
  padding query gets zeros.

Eagerly, the cache update and the attention reserve pages and plan on
the host. When transformers compiles a model's decode step (a compileable
cache), the decode of an armed cache is one traced custom op per layer
(``traced.py``, no graph break); anything else (an unarmed cache, more
than one new token) is called through ``torch.compiler.disable``, a graph
break. Run eagerly, they are called directly (the disable wrapper's host
cost would be paid on every layer of every token).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import resolve_backend
from ..prefill import paged_prefill
from . import traced  # noqa: F401  (registers torch.ops.entmaxkv.hf_decode_layer)

__all__ = ["entmaxkv_attention", "entmaxkv_mask"]


def entmaxkv_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                  device=None, **kwargs) -> torch.Tensor:
    """transformers' mask interface for "entmaxkv": bool [B, 1, q_length, 1],
    True where a new position is a real token. The new positions are
    ``q_offset .. q_offset + q_length - 1`` (the cache's count; an int, or
    an int64 [] device tensor inside a compiled step of an armed cache) of
    ``attention_mask`` [B, positions] (1 real, 0 padding); positions past
    its end are real tokens. ``kv_length`` is not read. The result has
    standard strides, which do not change from token to token."""
    if attention_mask is None:
        return torch.ones(batch_size, 1, q_length, 1, dtype=torch.bool, device=device)
    # (positions past the given mask are real tokens)
    mask = torch.cat((attention_mask.to(torch.bool),
                      torch.ones(attention_mask.shape[0], q_length, dtype=torch.bool, device=attention_mask.device)),
                     dim=-1)
    if isinstance(q_offset, torch.Tensor):  # (no host value: a gather at the device offset)
        idx = (q_offset.to(mask.device) + torch.arange(q_length, device=mask.device)).clamp(max=mask.shape[-1] - 1)
        pad = mask.index_select(-1, idx)
    else:
        start = min(int(q_offset), mask.shape[-1] - q_length)
        pad = mask[:, start:start + q_length]
    # (a copy with standard strides: a view's would follow the mask's
    # length, even where contiguous() keeps it (size-1 dims), and a compiled
    # step guards on strides: it would be traced again every token)
    return pad.clone(memory_format=torch.contiguous_format)[:, None, :, None]


def entmaxkv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                       scaling: Optional[float] = None, dropout: float = 0.0, **kwargs):
    """transformers' attention interface for "entmaxkv" (see the module docstring).
    ``alibi_slopes`` (a keyword, float [HQ]): ALiBi biases over the cached
    tokens' positions (the twins' NAPE heads; stock models pass none).

    Returns (output [B, T, HQ, D] in q's dtype, None)."""
    if torch.compiler.is_compiling():
        tag = getattr(key, "_entmaxkv", None)
        if tag is not None and tag[0]._armed and query.shape[2] == 1 and not dropout:
            cache, layer = tag
            real = attention_mask[:, 0, 0, 0]
            out = torch.ops.entmaxkv.hf_decode_layer(query[:, :, 0].contiguous(), key[:, :, 0], value[:, :, 0],
                                                     real, cache._handle, layer, cache._layout)
            return out[:, None], None
        return _outside_compile(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """``entmaxkv_attention``'s work (host planning included)."""
    tag = getattr(key, "_entmaxkv", None)
    if tag is None:
        raise ValueError("past_key_values: the 'entmaxkv' attention needs an entmaxkv.hf.EntmaxKVCache "
                         "(pass past_key_values=EntmaxKVCache(model, ...) to generate or forward)")
    cache, layer = tag
    B, HQ, T, D = query.shape
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and tuple(attention_mask.shape) == (B, 1, T, 1)):
        raise ValueError("attention_mask: expected the 'entmaxkv' mask, bool [batch, 1, tokens, 1] (call "
                         "entmaxkv.hf.register() before building the model's masks)")
    if dropout:
        raise ValueError(f"dropout: the 'entmaxkv' attention is for inference, got dropout={dropout}")
    scale = float(scaling) if scaling is not None else D ** -0.5
    slopes = kwargs.get("alibi_slopes")
    paged = cache.paged
    with torch.no_grad():
        if layer == 0:
            counts = attention_mask[:, 0, :, 0].sum(-1).tolist()  # (host values: the pages are decided on the host)
            cache._slot_mapping = paged.reserve(cache.slots, counts)
            cache._decoding = T == 1 and all(c == 1 for c in counts)
            if cache._decoding:
                cache.decoder(scale, slopes).plan_cache(paged, cache.slots)
                cache.steps(query.dtype, key.dtype).begin(cache._slot_mapping)
        if cache._decoding:  # one real token per row: the layer's write and attention in one step
            out = cache.steps(query.dtype, key.dtype).run(layer, query[:, :, 0], key[:, :, 0], value[:, :, 0])
            return out[:, None], None
        real = attention_mask[:, 0, :, 0].to(query.device)  # [B, T]
        k_real = key.transpose(1, 2)[real]  # [tokens, H, D], row after row
        v_real = value.transpose(1, 2)[real]
        paged.write(k_real, v_real, cache._slot_mapping, layer=layer, backend=cache.backend)
        out = _dense(query, real, paged, cache, layer, scale, slopes, cache.prefill_scores)
        if cache.compileable and layer == cache.num_layers - 1:
            cache._arm(scale, slopes, query.dtype)  # (the prompt is in: ready for compiled decode steps)
        return out, None


_outside_compile = torch.compiler.disable(_attention)


def _dense(query, real, paged, cache, layer: int, scale: float, slopes, budget: int) -> torch.Tensor:
    """Causal attention of each row's new real tokens over its cached tokens
    (the new ones last, already written), per row. Where the cache's backend
    resolves to Triton (``backend.resolve_backend``) and the fused kernel
    takes the head dim (``head_dim_supported``): torch SDPA's causal kernel for
    softmax without ALiBi over a whole prompt, else EntmaxKV's fused
    prefill kernel (no T x T scores either way); otherwise
    ``prefill.paged_prefill`` in query chunks of ``budget`` scores. A
    padding query gets zeros."""
    B, HQ, T, D = query.shape
    out = torch.zeros(B, T, HQ, D, dtype=query.dtype, device=query.device)
    lay = paged.layer(layer)
    fused = False
    if resolve_backend(cache.backend, query.device).name == "triton":
        from ..kernels.prefill.launch import head_dim_supported

        fused = head_dim_supported(D)
    for b, slot in enumerate(cache.slots):
        idx = real[b].nonzero().flatten()
        if idx.numel() == 0:
            continue
        q = query[b, :, idx].transpose(0, 1)  # [t, HQ, D]
        n = paged.length(slot)
        if fused:
            out[b, idx] = _kernel_row(q, lay, paged.page_ids(slot), n, cache.alpha, scale, slopes)
            continue
        out[b, idx] = paged_prefill(q, lay, paged.page_ids(slot), n, alpha=cache.alpha,
                                    scale=scale, alibi_slopes=slopes, max_scores=budget)
    return out


def _kernel_row(q, lay, pages, n: int, alpha: float, scale: float, slopes) -> torch.Tensor:
    """One row's prefill through the kernels (``model.lm.kernel_prefill``):
    q [t, HQ, D] (the last t of the row's n cached tokens) -> [t, HQ, D]."""
    from ..model.lm import kernel_prefill
    from ..prefill import gather_row

    k, v = gather_row(lay, pages, n)  # [H, n, D]
    o = kernel_prefill(q.transpose(0, 1)[None], k[None].to(q.dtype), v[None].to(q.dtype), alpha=alpha,
                       scale=scale, slopes=slopes)
    return o[0].transpose(0, 1)
