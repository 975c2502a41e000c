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
the step runs either the certified selection or the dense pass (exact,
certified by construction), and the two are separate graphs. Eagerly the
decoder's coverage rule decides (``Certified.dense_above``); with graphs
the step times both forms' replays with CUDA events and runs the faster
(``entmaxkv.model.switch``), trying the other after ``probe_every`` steps
(a wait that grows while the probes confirm the choice); the layers then
compute no kept fraction (steps with statistics run the selection).

Outside attention a decode step is a few rows of elementwise work, whose
cost is its launches (a fixed cost each, replayed or not). With ``fused`` (the
default on the Triton backend on CUDA) they are ``entmaxkv.kernels.model``'s
kernels: one RMSNorm launch fused with the residual add before it, one
rotary launch for q and k, one SwiGLU product, the logits written in place:
3 (NAPE) / 4 (RoPE) elementwise launches per bfloat16 layer, where the
PyTorch code makes 22 / 56 (docs/prefill.md). The fused step also runs
each layer's q, k and v projections as one product and SwiGLU's gate and
up as one (``entmaxkv.model.pack``: the weights are packed once, the
modules' parameters become views of the packed matrices). Otherwise the
step runs the model's PyTorch code.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._checks import as_bool, as_choice, describe
from ..backend import BACKENDS
from ..cache import PagedKVCache
from ..graphs import StepGraphs
from ..planner import Decoder
from ..policies import Full, check_policy
from .lm import TransformerLM, rope_inv_freq
from .pack import PackedRows
from .switch import TimedSwitch

__all__ = ["ModelStep"]


class _Captured:
    """One batch size's static buffers."""

    def __init__(self, B: int, vocab: int, device, dtype) -> None:
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slots = torch.zeros(B, dtype=torch.long, device=device)
        self.logits = torch.zeros(B, vocab, dtype=dtype, device=device)


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
        fused: run the elementwise work outside attention (norms with the
            residual adds before them, RoPE, SwiGLU's product) as the fused
            kernels of ``entmaxkv.kernels.model``. None (default): on the
            Triton backend on CUDA; True also runs them on the CPU under
            Triton's interpreter (tests); it needs the Triton backend.
            False: the model's PyTorch code, as the reference backend and
            the CPU always run it (bit for bit ``decode_step``'s numbers).
            Fused results equal those to float32 rounding.
        kernel_config: the attention kernels' launch choices
            (``entmaxkv.kernels.KernelConfig``; None: the measured defaults).

    ``step(tokens, seqs)``: tokens long [B] (one per sequence, on any
    device), seqs the B sequence ids (a list of ints, the same every step
    of a generation for replays) -> logits [B, vocab] in the model's dtype.
    With graphs the logits are a static buffer, overwritten by the next step
    of the same batch size (clone them to keep them).
    """

    def __init__(self, model: TransformerLM, cache: PagedKVCache, policy=None, *, cuda_graph: bool = True,
                 backend: str = "auto", fused: Optional[bool] = None, kernel_config=None) -> None:
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

        def decoder(rule: str) -> Decoder:
            return Decoder(self.policy, q_heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           page_size=cache.page_size, alpha=cfg.attn_alpha, scale=model.scale,
                           alibi_slopes=slopes, device=device, backend=backend, cuda_graphs=False,
                           kernel_config=kernel_config, dense_rule=rule)

        self.decoder = decoder("coverage")
        self.backend = backend
        self.cuda_graph = as_bool(cuda_graph, "cuda_graph") and self.decoder.capturable
        if self.cuda_graph and self.decoder.switches:
            # the timed switch chooses every replayed step's form: no layer
            # computes its kept fraction or copies it to the host
            self.decoder = decoder("caller")
        if fused is None:
            self.fused = self.decoder._ops.name == "triton" and device.type == "cuda"
        else:
            self.fused = as_bool(fused, "fused")
            if self.fused and self.decoder._ops.name != "triton":
                raise ValueError(f"fused: the fused kernels run with the Triton backend (CUDA, or the CPU under "
                                 f"TRITON_INTERPRET=1); backend {backend!r} resolved to "
                                 f"{self.decoder._ops.name!r} here")
        # RoPE's frequencies, once, as rope_rotate computes them on this device (the fused path's)
        self._inv_freq = (rope_inv_freq(cfg.head_dim, cfg.rope_base, device)
                          if self.fused and cfg.positions == "rope" else None)
        self.layers = [cache.layer(i) for i in range(cfg.n_layers)]
        # per block: (q|k|v, gate|up); packed here, outside any capture
        self._packs = [(PackedRows([b.attn.wq, b.attn.wk, b.attn.wv], "model"),
                        PackedRows([b.mlp.w_gate, b.mlp.w_up], "model")) for b in model.blocks] if self.fused else []
        self._captured: Dict[int, _Captured] = {}
        self._graphs = StepGraphs(self.decoder)  # by (batch size, dense)
        self._switches: Dict[int, TimedSwitch] = {}  # by batch size (certified, replayed steps)
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
        self._check_packs()
        positions = [self.cache.length(s) for s in seqs]  # host mirrors: no synchronisation
        slots = self.cache.reserve(seqs, 1)  # checks seqs; CacheFullError before any change
        self.decoder.plan(self.cache.block_table, self.cache.seq_lens, seqs)
        switch = None
        if self.cuda_graph and self.decoder.switches and not return_stats:
            switch = self._switches.get(B)
            if switch is None:
                switch = self._switches[B] = TimedSwitch(self.policy.probe_every)
            switch.poll()
            dense = switch.choose()
        else:
            dense = self.decoder.dense_now(self.layers)
        self.last_dense = dense
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
        if switch is None:
            replayed = self._graphs.run((B, dense), lambda: self._body(c, dense))
        else:
            captured = (B, dense) in self._graphs.keys()
            start = switch.begin()
            replayed = self._graphs.run((B, dense), lambda: self._body(c, dense))
            # not the replay right after a capture: it runs slower than the later ones
            switch.end(start, dense, keep=replayed and captured)
        if replayed:
            self.decoder.replayed(self.layers, dense)
        return c.logits

    __call__ = step

    def _check_packs(self) -> None:
        """Pack again any weight replaced since it was packed (checked for
        every pack before any is changed), and drop the graphs that read the
        old packed matrices."""
        stale = [p for pair in self._packs for p in pair if p.stale()]
        if stale:
            for p in stale:
                p.check()
            for p in stale:
                p.repack()
            self._graphs.clear()

    def _body(self, c: _Captured, dense: bool, stats: Optional[list] = None) -> None:
        """The device half: reads c's buffers, writes c.logits (and appends
        each layer's DecodeStats to ``stats`` when given)."""
        if self.fused:
            self._body_fused(c, dense, stats)
            return
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

    @torch.no_grad()
    def _body_fused(self, c: _Captured, dense: bool, stats: Optional[list]) -> None:
        """``_body`` with the elementwise work fused (``fused``): per layer
        the attention norm (fused with the residual add of the layer
        before), one RoPE launch, the MLP norm fused with the attention's
        residual add, SwiGLU's product; the last residual add fused with the
        model's norm; the logits written into c.logits (inference only: the
        kernels have no backward, and mm's out= refuses inputs that need
        gradients)."""
        from ..kernels.model import add_rms_norm, rms_norm, rope_qk, silu_mul

        m = self.model
        cfg = m.cfg
        blocks = list(m.blocks)
        x = m.embed(c.tokens)[:, None]  # [B, 1, C]: the residual stream
        B = x.shape[0]
        h = rms_norm(x, blocks[0].attn_norm.weight, blocks[0].attn_norm.eps)  # the block's input
        hd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for i, blk in enumerate(blocks):
            at = blk.attn
            qkv_w, gate_up_w = self._packs[i]
            qkv = torch.nn.functional.linear(h, qkv_w.weight())  # [B, 1, (H + 2 KV) D]
            q = qkv[..., :hd].view(B, 1, cfg.n_heads, cfg.head_dim)
            k = qkv[..., hd:hd + kvd].view(B, 1, cfg.n_kv_heads, cfg.head_dim)
            v = qkv[..., hd + kvd:].view(B, 1, cfg.n_kv_heads, cfg.head_dim)
            if self._inv_freq is not None:
                q, k = rope_qk(q, k, c.positions[:, None], self._inv_freq)  # new contiguous tensors
            self.cache.write(k[:, 0], v[:, 0], c.slots, layer=i, backend=self.backend)
            o = self.decoder.run(q[:, 0].contiguous(), self.layers[i], dense=dense,
                                 return_stats=stats is not None)  # [B, H, D] (q[:, 0] is contiguous)
            if stats is not None:
                o, st = o
                stats.append(st)
            h, x = add_rms_norm(x, at.wo(o.reshape(B, 1, -1).to(x.dtype)), blk.mlp_norm.weight, blk.mlp_norm.eps)
            gate_up = torch.nn.functional.linear(h, gate_up_w.weight())  # [B, 1, 2 F]
            d = blk.mlp.w_down(silu_mul(gate_up[..., :cfg.d_ff], gate_up[..., cfg.d_ff:]))
            last = i + 1 == len(blocks)
            norm = m.norm if last else blocks[i + 1].attn_norm
            h, x = add_rms_norm(x, d, norm.weight, norm.eps, keep_residual=not last)
        torch.mm(h[:, 0], m.embed.weight.t(), out=c.logits)  # the tied output head, no copy

    def graphs(self) -> List[Tuple[int, bool]]:
        """The captured (batch size, dense) steps."""
        return self._graphs.keys()
