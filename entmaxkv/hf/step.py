"""One decode step of an EntmaxKVCache layer: the cache write and the attention.

transformers runs its model eagerly, layer after layer, and calls the
attention function in between; what the host spends there is paid on every
layer of every token. ``LayerSteps`` makes a layer's decode (one new token
per row) one launch on CUDA: the new token's K/V written through the step's
slot mapping and the planned EntmaxKV attention are captured once per
(layer, dense or not) in a CUDA graph, after one direct warm-up run, and
replayed after that. The host copies q, k and v into the layer's static
buffers (the slot mapping once per step, at layer 0) and replays.

Elsewhere (the CPU, the reference backend, ``cuda_graphs=False``) the same
write and attention run directly.

The certified policy's cost check is per layer: each layer's step runs
the certified selection or the dense pass (two graphs), as the decoder
decides from that layer's last coverage.
"""
from __future__ import annotations

import torch

from ..cache import PagedKVCache
from ..graphs import StepGraphs
from ..planner import Decoder

__all__ = ["LayerSteps"]


class LayerSteps:
    """Decode steps of every layer of one paged cache at batch ``B``.

    Args:
        decoder: the cache's planned ``Decoder`` (``cuda_graphs=False``: the
            graphs are made here, around the write as well).
        paged: the multi-layer ``PagedKVCache``.
        B: rows per step; q_dtype / kv_dtype: the dtypes of the model's q
            and k, v (the static buffers').
        graphs: capture and replay (CUDA with the Triton backend only).
        backend: the cache write's backend.

    Per step: ``begin(slot_mapping)`` (int64 [B] from ``PagedKVCache.reserve``,
    after the decoder's plan), then ``run(layer, q, k, v)`` for every layer.
    """

    def __init__(self, decoder: Decoder, paged: PagedKVCache, B: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                 *, graphs: bool, backend: str) -> None:
        dev = paged.device
        L, HQ, H, D = paged.num_layers, decoder.q_heads, paged.kv_heads, paged.head_dim
        self.decoder, self.paged, self.backend = decoder, paged, backend
        self.graphs = graphs and decoder.capturable
        self.layers = [paged.layer(i) for i in range(L)]
        self.q = torch.zeros(B, HQ, D, dtype=q_dtype, device=dev)
        self.k = torch.zeros(B, H, D, dtype=kv_dtype, device=dev)
        self.v = torch.zeros(B, H, D, dtype=kv_dtype, device=dev)
        self.slots = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.out = torch.zeros(L, B, HQ, D, dtype=q_dtype, device=dev)
        self._graphs = StepGraphs(decoder)

    def key(self) -> tuple:
        """What these buffers were made for: (B, q dtype, k/v dtype)."""
        return self.q.shape[0], self.q.dtype, self.k.dtype

    def begin(self, slot_mapping: torch.Tensor) -> None:
        """The step's slot mapping (int64 [B] on the cache's device)."""
        self.slots.copy_(slot_mapping)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s new tokens and attend.

        Args:
            q: [B, HQ, D]; k, v: [B, H, D] (any strides), in the dtypes the
                steps were made for.
        Returns:
            [B, HQ, D] in q's dtype. With graphs this is the layer's static
            output buffer, overwritten by the layer's next step.
        """
        lay = self.layers[layer]
        dense = self.decoder.dense_now([lay])
        if not self.graphs:
            self.paged.write(k, v, self.slots, layer=layer, backend=self.backend)
            return self.decoder.run(q.contiguous(), lay, dense=dense)
        torch._foreach_copy_((self.q, self.k, self.v), (q, k, v))  # one host call for the three
        if self._graphs.run((layer, dense), lambda: self._body(layer, dense)):
            self.decoder.replayed([lay], dense)
        return self.out[layer]

    def _body(self, layer: int, dense: bool) -> None:
        """The device half of a layer's step: reads the static buffers, writes out[layer]."""
        self.paged.write(self.k, self.v, self.slots, layer=layer, backend=self.backend)
        self.decoder.run(self.q, self.layers[layer], self.out[layer], dense=dense)

    def captured(self) -> list:
        """The captured (layer, dense) steps."""
        return self._graphs.keys()
