"""A compact decoder-only language model with entmax or softmax attention.

Pre-norm blocks of RMSNorm -> grouped-query attention -> residual, RMSNorm
-> SwiGLU -> residual; tied input/output embeddings. Positions are either
NAPE (the first half of the query heads use ALiBi, the other half no
positional signal at all) or RoPE, chosen in the config.

Two ways to run it:

- ``forward(tokens)``: full causal attention in PyTorch (training, and the
  reference for everything else). Entmax attention calls
  ``entmaxkv.entmax.entmax`` on the materialised score rows.
- ``prefill`` / ``decode_step``: the serving path. Prefill runs the same
  full causal attention and writes every layer's K/V into that layer's
  ``PagedKVCache``; each decode step appends the new token's K/V and runs
  attention through ``entmaxkv.decode`` with any selection policy.

Shapes: B batch, T tokens, H query heads, KV key/value heads, G = H // KV,
D head dim, C d_model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import as_choice, as_float, as_int, describe


@dataclass
class ModelConfig:
    """Every hyper-parameter of the model (stored next to the weights as JSON)."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 704
    attention: str = "entmax"  # "entmax" or "softmax"
    alpha: float = 1.5  # entmax alpha (ignored for softmax)
    positions: str = "nape"  # "nape" (half ALiBi, half NoPE), "rope", "alibi", "nope"
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    train_context: int = 2048  # informational: the context it was trained at
    init_std: float = 0.02

    def __post_init__(self) -> None:
        """Check every field (ValueError naming it) and store plain Python values."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "train_context"):
            setattr(self, name, as_int(getattr(self, name), name, lo=1))
        for name in ("rope_base", "norm_eps", "init_std"):
            setattr(self, name, as_float(getattr(self, name), name, lo=0.0, lo_open=True))
        self.attention = as_choice(self.attention, "attention", ("entmax", "softmax"))
        self.positions = as_choice(self.positions, "positions", ("nape", "rope", "alibi", "nope"))
        # alpha is unused by softmax but stored with the weights: keep it a number either way.
        self.alpha = as_float(self.alpha, "alpha", lo=1.0, lo_open=self.attention == "entmax")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: expected a divisor of d_model ({self.d_model}), got {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads ({self.n_heads}), got {self.n_kv_heads}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"positions: 'rope' needs an even head_dim (d_model / n_heads), got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def attn_alpha(self) -> float:
        """The alpha that ``entmaxkv.decode`` takes: 1.0 means softmax."""
        return float(self.alpha) if self.attention == "entmax" else 1.0

    def alibi_slopes(self) -> List[float]:
        """Per query head ALiBi slope (0 = no positional bias).

        NAPE: the first half of the heads get the geometric slopes
        2^(-8 i / n) (i = 1..n, n = heads with ALiBi), the rest 0. With GQA
        the ALiBi heads then share KV heads among themselves.
        """
        H = self.n_heads
        n = {"nape": H // 2, "alibi": H}.get(self.positions, 0)
        slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)] if n else []
        return slopes + [0.0] * (H - n)

    @classmethod
    def llama8b_shape(cls, *, attention: str = "entmax", alpha: float = 1.5) -> "ModelConfig":
        """The Llama-3-8B shape, for speed measurements with random weights:
        32 layers, 32 query / 8 KV heads, head dim 128, RoPE (base 500000),
        SwiGLU 14336, vocab 128256. The input and output embeddings are
        tied; a decode step still reads one vocab x d_model matrix, as the
        8B's separate output head does."""
        return cls(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                   attention=attention, alpha=alpha, positions="rope", rope_base=500000.0, train_context=8192)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


# ----------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_inv_freq(D: int, base: float, device=None) -> torch.Tensor:
    """RoPE's frequencies base^(-2i / D), float32 [D/2] on ``device``: what
    ``rope_rotate`` multiplies the positions by (the fused decode step takes
    them from here once, so its angles are the same float32 products)."""
    return base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form). x [..., T, heads, D], positions [..., T]."""
    D = x.shape[-1]
    inv = rope_inv_freq(D, base, x.device)  # [D/2]
    ang = positions.to(torch.float32)[..., None] * inv  # [..., T, D/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]  # [..., T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    alpha: float,
    scale: float,
    slopes: torch.Tensor,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Full causal attention, the reference for training and prefill.

    q [B, H, Tq, D]; k, v [B, KV, Tk, D] with Tk >= Tq: the queries are the
    last Tq of the Tk positions (Tq < Tk: a chunk of a prompt after its
    cached context); slopes float32 [H]. Score of the query at position i
    on key j <= i: scale * q_i.k_j + slope_h * (j - i). Softmax when
    alpha == 1, else alpha-entmax over each row. ``chunk`` splits the
    queries into blocks (block c only scores keys up to its end), which
    bounds the [B, H, chunk, Tk] score tensor for long prefills.
    Returns [B, H, Tq, D] in v's dtype.
    """
    B, H, T, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    G = H // KV
    off = Tk - T
    chunk = T if chunk is None else max(1, min(chunk, T))
    outs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        C = end - start
        qc = q[:, :, start:end]  # [B, H, C, D]
        kc, vc = k[:, :, :off + end], v[:, :, :off + end]  # [B, KV, off + end, D]
        rel = (torch.arange(off + end, device=q.device)[None, :]
               - torch.arange(off + start, off + end, device=q.device)[:, None])  # [C, off + end]: j - i
        bias = slopes.view(H, 1, 1).to(torch.float32) * rel.to(torch.float32)  # [H, C, off + end]
        bias = bias.masked_fill(rel > 0, float("-inf"))
        if alpha == 1.0:
            kr = kc.repeat_interleave(G, dim=1)  # [B, H, off + end, D]
            vr = vc.repeat_interleave(G, dim=1)
            o = F.scaled_dot_product_attention(
                qc, kr, vr, attn_mask=bias.to(qc.dtype)[None], scale=scale
            )  # [B, H, C, D]
        else:
            from ..entmax import entmax

            # Grouped scores without repeating K: head h = kv * G + g.
            qg = qc.reshape(B, KV, G * C, D)
            s = torch.matmul(qg, kc.transpose(-1, -2)).float()  # [B, KV, G*C, off + end]
            s = s.view(B, H, C, off + end) * scale + bias
            p = entmax(s, alpha, dim=-1)  # [B, H, C, off + end]
            o = torch.matmul(p.to(vc.dtype).view(B, KV, G * C, off + end), vc).view(B, H, C, D)
        outs.append(o.to(v.dtype))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alpha: float, scale: float,
                      slopes: torch.Tensor, chunk: Optional[int] = None, backend: str = "auto") -> torch.Tensor:
    """``causal_attention`` for inference, without T x T scores on CUDA.

    Same arguments and result. On CUDA (backend "auto" or "triton"):
    softmax without ALiBi over a whole prompt goes to torch SDPA's causal
    (flash) kernel; everything else (entmax, ALiBi / NAPE heads, a chunk
    after cached context) to EntmaxKV's fused Triton prefill kernel. On the
    CPU, or with backend "reference", the chunked reference runs.
    """
    if q.device.type == "cuda" and backend != "reference":
        return kernel_prefill(q, k, v, alpha=alpha, scale=scale, slopes=slopes)
    return causal_attention(q, k, v, alpha=alpha, scale=scale, slopes=slopes, chunk=chunk)


def kernel_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alpha: float, scale: float,
                   slopes: Optional[torch.Tensor]) -> torch.Tensor:
    """``prefill_attention``'s kernel path on any device the kernels run on
    (CUDA, or the CPU under Triton's interpreter): torch SDPA's causal
    kernel for softmax without ALiBi over a whole prompt (Tq == Tk), else
    EntmaxKV's fused Triton prefill kernel. Shapes as ``causal_attention``;
    ``slopes`` float [H] or None (no bias)."""
    nope = slopes is None or not bool((slopes != 0).any())
    if alpha == 1.0 and nope and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    from ..kernels.prefill import causal_attention as fused

    return fused(q, k, v, alpha=alpha, scale=scale, slopes=None if nope else slopes)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, KV, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        self.wq = nn.Linear(C, H * D, bias=False)
        self.wk = nn.Linear(C, KV * D, bias=False)
        self.wv = nn.Linear(C, KV * D, bias=False)
        self.wo = nn.Linear(H * D, C, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, C], positions [B, T] or [T] -> q [B, T, H, D], k, v [B, T, KV, D]."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.positions == "rope":
            q = rope_rotate(q, positions, cfg.rope_base)
            k = rope_rotate(k, positions, cfg.rope_base)
        return q, k, v


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)


# ------------------------------------------------------------------------ model
class TransformerLM(nn.Module):
    """Decoder-only LM; see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg: expected a ModelConfig, got {describe(cfg)}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.register_buffer(
            "slopes", torch.tensor(cfg.alibi_slopes(), dtype=torch.float32), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual-branch outputs scaled down with depth (GPT-2 style).
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w_down.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)
            else:
                nn.init.ones_(p)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.head_dim)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.embed.weight)  # tied output embedding

    def _attn_full(self, blk: Block, h: torch.Tensor, positions: torch.Tensor, chunk, fused: bool = False):
        q, k, v = blk.attn.project(h, positions)  # [B, T, H|KV, D]
        attend = prefill_attention if fused else causal_attention
        o = attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            alpha=self.cfg.attn_alpha, scale=self.scale, slopes=self.slopes, chunk=chunk,
        )  # [B, H, T, D]
        B, T = h.shape[:2]
        return blk.attn.wo(o.transpose(1, 2).reshape(B, T, -1)), k, v

    def forward(self, tokens: torch.Tensor, *, chunk: Optional[int] = None) -> torch.Tensor:
        """tokens long [B, T] -> logits [B, T, vocab] (full causal attention)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        for blk in self.blocks:
            a, _, _ = self._attn_full(blk, blk.attn_norm(x), positions, chunk)
            x = x + a
            x = x + blk.mlp(blk.mlp_norm(x))
        return self._logits(x)

    @torch.no_grad()
    def prefill_logits(self, tokens: torch.Tensor, *, tail: int, chunk: Optional[int] = None) -> torch.Tensor:
        """Full-attention logits of the last ``tail`` positions [B, tail, vocab],
        computed in query blocks (about 2^28 scores per block by default)."""
        B, T = tokens.shape
        if chunk is None:
            chunk = max(64, (1 << 28) // max(1, B * self.cfg.n_heads * T))
        positions = torch.arange(T, device=tokens.device)
        x = self.embed(tokens)
        for blk in self.blocks:
            a, _, _ = self._attn_full(blk, blk.attn_norm(x), positions, chunk, fused=True)
            x = x + a
            x = x + blk.mlp(blk.mlp_norm(x))
        return self._logits(x[:, T - tail:])

    # -------------------------------------------------------------- serving
    @torch.no_grad()
    def prefill(
        self,
        tokens: torch.Tensor,
        caches: Sequence,
        slots: Sequence[int],
        *,
        chunk: Optional[int] = 1024,
        all_logits: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> torch.Tensor:
        """Run the prompt with full attention and fill one cache per layer.

        tokens long [B, T] (one row per slot, all of length T; the slots must
        be empty). ``copies``: further lists of B empty slots that receive the
        same K/V (so several policies can decode from one prefill). Returns
        the logits of the last position [B, vocab], or of every position
        [B, T, vocab] with ``all_logits``.
        """
        B, T = tokens.shape
        start = caches[0].length(slots[0])
        if start:
            raise ValueError("prefill expects empty slots (use decode_step to extend)")
        positions = torch.arange(T, device=tokens.device)
        x = self.embed(tokens)
        for blk, cache in zip(self.blocks, caches):
            a, k, v = self._attn_full(blk, blk.attn_norm(x), positions, chunk, fused=True)
            for group in [slots, *copies]:
                for b, slot in enumerate(group):
                    cache.prefill(slot, k[b], v[b], check_finite=False)  # [T, KV, D]
            x = x + a
            x = x + blk.mlp(blk.mlp_norm(x))
        return self._logits(x if all_logits else x[:, -1])

    @torch.no_grad()
    def prefill_paged(self, tokens: torch.Tensor, cache, seqs: Sequence[int], *, chunk_tokens: Optional[int] = None,
                      chunk: Optional[int] = None, backend: str = "auto") -> torch.Tensor:
        """Run a prompt into a multi-layer ``PagedKVCache`` (``ModelStep``'s cache).

        tokens long [B, T] continue the B sequences ``seqs`` (empty or not:
        the new tokens take the next positions of each). The prompt goes
        in chunks of ``chunk_tokens`` tokens (default: all at once): each
        chunk's K/V are written through ``reserve`` + ``write`` (layer by
        layer), and its queries attend to the chunk and to everything
        cached before it, so any chunking gives the same cache and logits
        (to rounding). Attention: ``prefill_attention`` (no T x T scores on
        CUDA); ``chunk`` bounds the reference's score blocks on the CPU.
        Returns the logits of the last position [B, vocab].
        """
        from ..prefill import gather_row

        B, T = tokens.shape
        seqs = list(seqs)
        if len(seqs) != B:
            raise ValueError(f"seqs: expected {B} sequence ids (one per row of tokens), got {len(seqs)}")
        if cache.num_layers != self.cfg.n_layers:
            raise ValueError(f"cache: expected {self.cfg.n_layers} layers (the model's), got {cache.num_layers}")
        starts = [cache.length(s) for s in seqs]
        if len(set(starts)) != 1:
            raise ValueError(f"seqs: expected sequences of one length (their prompts continue together), got {starts}")
        C = T if chunk_tokens is None else max(1, min(int(chunk_tokens), T))
        x = None
        for c0 in range(0, T, C):
            c1 = min(T, c0 + C)
            n0 = starts[0] + c0  # tokens cached before this chunk
            slots = cache.reserve(seqs, c1 - c0)  # [B * (c1 - c0)], row after row
            positions = torch.arange(n0, n0 + c1 - c0, device=tokens.device)
            x = self.embed(tokens[:, c0:c1])
            for i, blk in enumerate(self.blocks):
                q, k, v = blk.attn.project(blk.attn_norm(x), positions)  # [B, c, H|KV, D]
                KV, D = k.shape[2], k.shape[3]
                cache.write(k.reshape(-1, KV, D), v.reshape(-1, KV, D), slots, layer=i, backend=backend)
                if n0 == 0:  # (as stored, so that any chunking reads the same keys)
                    kt, vt = (t.transpose(1, 2).to(cache.dtype).to(q.dtype) for t in (k, v))
                else:  # the chunk's keys after every cached one, read back from the pages
                    rows = [gather_row(cache.layer(i), cache.page_ids(s), n0 + c1 - c0) for s in seqs]
                    kt = torch.stack([r[0] for r in rows]).to(q.dtype)
                    vt = torch.stack([r[1] for r in rows]).to(q.dtype)
                o = prefill_attention(q.transpose(1, 2), kt, vt, alpha=self.cfg.attn_alpha, scale=self.scale,
                                      slopes=self.slopes, chunk=chunk, backend=backend)  # [B, H, c, D]
                x = x + blk.attn.wo(o.transpose(1, 2).reshape(B, c1 - c0, -1))
                x = x + blk.mlp(blk.mlp_norm(x))
        return self._logits(x[:, -1])

    @torch.no_grad()
    def decode_step(
        self,
        tokens: torch.Tensor,
        caches: Sequence,
        slots: Sequence[int],
        policy,
        *,
        positions: torch.Tensor,
        return_stats: bool = False,
        backend: str = "auto",
        layer_hook=None,
        attend=None,
    ):
        """One token per sequence through every layer's paged cache.

        tokens long [B]; positions long [B] (the index each token gets, i.e.
        the cache length before this step). Each layer appends the token's
        K/V to its cache, then calls ``entmaxkv.decode`` with ``policy``.
        ``layer_hook(layer, q, cache, seq_ids)`` (optional) is called with
        the layer's query [B, H, D] after the append, e.g. to capture
        activations. ``attend`` replaces ``entmaxkv.decode`` (same call; e.g.
        ``entmaxkv.distributed.decode`` over sharded caches). Returns logits
        [B, vocab] and, with ``return_stats``, a list of per-layer stats.
        """
        from ..decode import decode

        attend = decode if attend is None else attend
        cfg = self.cfg
        B = tokens.shape[0]
        seq_ids = torch.as_tensor(list(slots), dtype=torch.int32, device=tokens.device)
        x = self.embed(tokens)[:, None]  # [B, 1, C]
        stats = []
        for layer, (blk, cache) in enumerate(zip(self.blocks, caches)):
            q, k, v = blk.attn.project(blk.attn_norm(x), positions[:, None])  # [B, 1, *, D]
            cache.append(list(slots), k[:, 0], v[:, 0], check_finite=False)
            q = q[:, 0]  # [B, H, D]
            if layer_hook is not None:
                layer_hook(layer, q, cache, seq_ids)
            res = attend(
                q, cache, seq_ids, policy, alpha=cfg.attn_alpha, scale=self.scale,
                alibi_slopes=self.slopes, return_stats=return_stats, backend=backend,
                check_finite=False,
            )
            if return_stats:
                o, st = res
                stats.append(st)
            else:
                o = res
            x = x + blk.attn.wo(o.reshape(B, 1, -1).to(x.dtype))
            x = x + blk.mlp(blk.mlp_norm(x))
        logits = self._logits(x[:, 0])
        return (logits, stats) if return_stats else logits
