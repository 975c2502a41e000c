"""The model's whole decode step, replayed from one CUDA graph.

Eager decoding pays the host for every launch of every layer: embedding,
projections, the cache write, the selection and attention kernels, the MLP.
``ModelStep`` splits a step in two:

- the host half, each step: reserve the new tokens' cache slots (pages are
  allocated here, all or nothing), copy the tokens, positions and slot
  mapping into the step's static buffers, plan the decoder (block table and
  lengths are device tensors whose addresses never change);
- the device half, which reads only those buffers: for every layer,
  projections, ``PagedKVCache.write`` through the slot mapping, the planned
  EntmaxKV attention, the MLP; then the logits.

On CUDA the device half is captured once per (batch size, dense or not)
after one eager warm-up and replayed after that; elsewhere (and with
``cuda_graph=False``) it runs eagerly, the same code. Rows keep their place
in the batch for the whole generation (a row that has finished keeps
decoding; ``generate`` feeds it its stop token), so one graph serves every
step.

The certified policy's cost check runs per step for all layers at once:
the decoder decides whether the step runs the dense pass (exact, certified
by construction) or the certified selection, and the two are separate
graphs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._checks import as_bool, as_choice, describe
from ..backend import BACKENDS
from ..cache import PagedKVCache
from ..planner import Decoder
from ..policies import Full, check_policy
from .lm import TransformerLM

__all__ = ["ModelStep"]


class _Captured:
    """One batch size's static buffers and, once captured, its graph."""

    def __init__(self, B: int, vocab: int, device, dtype) -> None:
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slots = torch.zeros(B, dtype=torch.long, device=device)
        self.logits = torch.zeros(B, vocab, dtype=dtype, device=device)
        self.graphs: Dict[bool, torch.cuda.CUDAGraph] = {}
        self.warm: Dict[bool, int] = {}


class ModelStep:
    """Decode steps of a ``TransformerLM`` over one multi-layer ``PagedKVCache``.

    Args:
        model: the TransformerLM (eval mode; its device is the cache's).
        cache: a PagedKVCache with ``num_layers == model.cfg.n_layers`` and
            the model's KV heads and head dim, holding the sequences (fill
            it with ``model.prefill_paged``).
        policy: Full() (default), TopK, Gaussian or Certified (checked
            against the model's alpha and the cache's page size).
        cuda_graph: capture and replay the device half on CUDA (Triton
            backend only); False runs it eagerly everywhere.
        backend: "auto", "reference" or "triton".

    ``step(tokens, seqs)``: tokens long [B] (one per sequence, on any
    device), seqs the B sequence ids (a list of ints, the same every step
    of a generation for replays) -> logits [B, vocab] in the model's dtype.
    With graphs the logits are a static buffer, overwritten by the next step
    of the same batch size (clone them to keep them).
    """

    def __init__(self, model: TransformerLM, cache: PagedKVCache, policy=None, *, cuda_graph: bool = True,
                 backend: str = "auto") -> None:
        if not isinstance(model, TransformerLM):
            raise ValueError(f"model: expected a TransformerLM, got {describe(model)}")
        cfg = model.cfg
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache: expected a PagedKVCache, got {describe(cache)}")
        if (cache.num_layers, cache.kv_heads, cache.head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"cache: expected num_layers, kv_heads, head_dim = {cfg.n_layers}, {cfg.n_kv_heads}, "
                             f"{cfg.head_dim} (the model's), got {cache.num_layers}, {cache.kv_heads}, "
                             f"{cache.head_dim}")
        device = next(model.parameters()).device
        if cache.device != device:
            raise ValueError(f"cache: on {cache.device}, but the model is on {device}")
        self.policy = Full() if policy is None else policy
        check_policy(self.policy, alpha=cfg.attn_alpha, page_size=cache.page_size)
        backend = as_choice(backend, "backend", BACKENDS)
        self.model, self.cache, self.device = model, cache, device
        slopes = model.slopes if bool((model.slopes != 0).any()) else None
        self.decoder = Decoder(self.policy, q_heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                               page_size=cache.page_size, alpha=cfg.attn_alpha, scale=model.scale,
                               alibi_slopes=slopes, device=device, backend=backend, cuda_graphs=False)
        self.backend = backend
        self.cuda_graph = (as_bool(cuda_graph, "cuda_graph") and device.type == "cuda"
                           and self.decoder._ops.name == "triton")
        self.layers = [cache.layer(i) for i in range(cfg.n_layers)]
        self._captured: Dict[int, _Captured] = {}
        self._pool = None
        self.last_dense = False  # whether the last step ran the dense pass (the certified cost check)

    # ------------------------------------------------------------ the step
    def step(self, tokens: torch.Tensor, seqs: Sequence[int], *, return_stats: bool = False):
        """One token per sequence -> logits [B, vocab] (see the class
        docstring); ``return_stats``: an eager step that also returns every
        layer's ``DecodeStats`` (pages and tokens read, coverage)."""
        return_stats = as_bool(return_stats, "return_stats")
        seqs = list(seqs)
        B = len(seqs)
        if not isinstance(tokens, torch.Tensor) or tokens.shape != (B,) or tokens.dtype != torch.long:
            raise ValueError(f"tokens: expected a long tensor of shape ({B},) (one per sequence), got "
                             f"{describe(tokens)}")
        positions = [self.cache.length(s) for s in seqs]  # host mirrors: no synchronisation
        slots = self.cache.reserve(seqs, 1)  # checks seqs; CacheFullError before any change
        self.decoder.plan(self.cache.block_table, self.cache.seq_lens, seqs)
        dense = self.last_dense = self.decoder.dense_now(self.layers)
        c = self._captured.get(B)
        if c is None:
            c = self._captured[B] = _Captured(B, self.model.cfg.vocab_size, self.device,
                                              self.model.embed.weight.dtype)
        c.tokens.copy_(tokens, non_blocking=True)
        c.positions.copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        c.slots.copy_(slots)
        if return_stats:
            stats: list = []
            self._body(c, dense, stats)
            return c.logits, stats
        if not self.cuda_graph:
            self._body(c, dense)
            return c.logits
        graph = c.graphs.get(dense)
        if graph is None and c.warm.get(dense, 0) >= 1:
            graph = self._capture(c, dense)
        if graph is None:
            self._body(c, dense)  # warm-up: compiles every kernel, sizes the decoder's workspace
            c.warm[dense] = c.warm.get(dense, 0) + 1
            if self.decoder.workspace_grew:
                self._drop_graphs()
        else:
            graph.replay()
            self.decoder.replayed(self.layers, dense)
        return c.logits

    __call__ = step

    def _body(self, c: _Captured, dense: bool, stats: Optional[list] = None) -> None:
        """The device half: reads c's buffers, writes c.logits (and appends
        each layer's DecodeStats to ``stats`` when given)."""
        m = self.model
        x = m.embed(c.tokens)[:, None]  # [B, 1, C]
        B = x.shape[0]
        for i, blk in enumerate(m.blocks):
            q, k, v = blk.attn.project(blk.attn_norm(x), c.positions[:, None])  # [B, 1, *, D]
            self.cache.write(k[:, 0], v[:, 0], c.slots, layer=i, backend=self.backend)
            res = self.decoder.run(q[:, 0].contiguous(), self.layers[i], dense=dense,
                                   return_stats=stats is not None)  # [B, H, D]
            if stats is not None:
                res, st = res
                stats.append(st)
            o = res
            x = x + blk.attn.wo(o.reshape(B, 1, -1).to(x.dtype))
            x = x + blk.mlp(blk.mlp_norm(x))
        c.logits.copy_(m._logits(x[:, 0]))

    def _capture(self, c: _Captured, dense: bool) -> Optional[torch.cuda.CUDAGraph]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._body(c, dense)
        if self.decoder.workspace_grew:  # the capture read a buffer that was replaced
            self._drop_graphs()
            return None
        c.graphs[dense] = graph
        return graph

    def _drop_graphs(self) -> None:
        for c in self._captured.values():
            c.graphs.clear()
            c.warm.clear()

    def graphs(self) -> List[Tuple[int, bool]]:
        """The captured (batch size, dense) steps."""
        return sorted((B, d) for B, c in self._captured.items() for d in c.graphs)
