"""The decode step of a compileable EntmaxKVCache as one custom op.

When transformers compiles a model's decode step (``torch.compile``; on a
GPU with CUDA graphs), nothing in the step may run host code that the
compiled graph cannot replay. The eager decode path does: it reserves
pages, builds the slot mapping and plans the decoder on the host. A
compileable cache therefore arms the device for decoding at the end of
each prefill (``EntmaxKVCache._arm``, on the host, uncompiled):

- the pages for every row's remaining ``max_len`` tokens are reserved at
  once (the host mirror counts the rows as full; the device lengths stay
  the true ones);
- the decoder is planned over the cache's block table, lengths and rows,
  and run once, so its scratch is sized before any capture.

Each layer's decode is then ``torch.ops.entmaxkv.hf_decode_layer``: at
layer 0 the device lengths of the real rows and the device count of
positions grow by one (a row past ``max_len`` stops the step with a
device-side assert first: a compiled step cannot raise on the host; in
``generate`` the cache refuses on the host before the step); the new token's
slot comes from the block table on the device; the layer's K/V are
written there (a padding row's slot is -1: nothing is written); the
planned attention runs; a padding row's output is zeros. The op has a fake
implementation, so dynamo traces the whole step with no graph break, and
its launches are graph-safe, so the compiled step's CUDA graphs hold them.
Those graphs replay the addresses they were captured with, so the op's
arguments name the layout the step was traced for (``layout``, a string:
dynamo guards on its value); when the cache's tensors or the decoder's
scratch move, the layout's name changes and the step is traced again.

The op reaches the cache's tensors through a handle (the cache's state is
not a graph input: the compiled graph must not copy the cache's pages into
static buffers before every replay). No host number that changes per
step is read in the traced step (dynamo would make it a graph input, and
the CUDA graphs would be recorded again for each value): the count of
positions stays on the device while armed. The host mirror of the
lengths and that count are brought back from the device before the next
host-side change (``EntmaxKVCache._disarm``).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict

import torch

__all__ = ["hf_decode_layer", "register_cache"]

_CACHES: Dict[int, "weakref.ref"] = {}
_NEXT = itertools.count(1)


def register_cache(cache) -> int:
    """A handle by which the op finds ``cache`` (held weakly)."""
    handle = next(_NEXT)
    _CACHES[handle] = weakref.ref(cache, lambda _ref, h=handle: _CACHES.pop(h, None))
    return handle


def _cache(handle: int):
    ref = _CACHES.get(handle)
    cache = ref() if ref is not None else None
    if cache is None:
        raise ValueError(f"handle: no live EntmaxKVCache has handle {handle}")
    return cache


@torch.library.custom_op("entmaxkv::hf_decode_layer", mutates_args=())
def hf_decode_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, handle: int,
                    layer: int, layout: str) -> torch.Tensor:
    """One layer's decode of an armed compileable EntmaxKVCache.

    Args:
        q: [B, HQ, D]; k, v: [B, H, D], the new token of each row.
        real: bool [B]: whether a row's new token is a real one (not padding).
        handle: the cache's ``register_cache`` handle; layer: its index.
        layout: the name of the cache's tensors and scratch as armed
            (``EntmaxKVCache._layout``): a traced call made under another
            layout would launch on moved tensors, and is refused.
    Returns:
        [B, HQ, D] in q's dtype (zeros for padding rows).
    """
    cache = _cache(handle)
    if layout != cache._layout:
        raise ValueError(f"layout: this step was traced for layout {layout!r} of the cache's tensors, which "
                         f"moved since (now {cache._layout!r}); trace the step again")
    return cache._device_step(q, k, v, real, layer)


@hf_decode_layer.register_fake
def _hf_decode_layer_fake(q, k, v, real, handle, layer, layout):
    return torch.empty_like(q)
