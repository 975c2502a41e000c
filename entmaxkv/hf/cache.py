"""EntmaxKVCache: a transformers ``Cache`` whose layers live in one paged EntmaxKV cache.

transformers calls ``Cache.update(k, v, layer)`` in every attention module
and then the registered attention function ("entmaxkv", attention.py).
Here ``update`` only hands the new K/V on (tagged with the cache and layer):
the attention function writes the real tokens (never the left padding,
which only the mask knows) into the paged cache and attends, densely for a
prompt or a chunk of one, through the planned EntmaxKV decoder for one new
token per row.

A compileable cache (``compileable=True``) is armed at the end of each
prefill for a compiled decode step: ``traced.py`` says how.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._checks import as_bool, as_choice, as_float, as_int, describe
from ..backend import BACKENDS
from ..cache import CacheFullError, PagedKVCache
from ..limits import check_alpha, effective_alpha
from ..planner import Decoder
from ..policies import Full, check_policy
from .step import LayerSteps
from .traced import register_cache

__all__ = ["EntmaxKVCache", "Unsupported"]


class Unsupported(ValueError):
    """A transformers feature EntmaxKV does not implement (named in the message)."""


def _refuse(what: str) -> None:
    raise Unsupported(f"EntmaxKVCache: {what} is not supported (EntmaxKV decodes one new token per row "
                      "over a paged cache that only grows)")


class _Layer(CacheLayerMixin):
    """One model layer's view: counts the positions transformers has seen.
    Compileable when its cache is: in transformers' compiled decode step an
    armed cache's ``update`` is traced (``_update_armed``) and the attention
    is the traced custom op (``traced.py``); anything else runs outside the
    compiled graph (through ``torch.compiler.disable``). Nothing in the step
    is sized by the cache (the mask's shape does not grow with it), and
    nothing in it reads or writes a host number that changes from step to
    step: while armed, the count of positions lives on the device
    (``EntmaxKVCache._seen_dev``), so dynamo has no per-step integer to make
    a graph input of (its CUDA graphs would be recorded again for every
    value)."""

    is_sliding = False

    def __init__(self, owner: "EntmaxKVCache", index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_compileable = owner.compileable
        self.seen = 0  # positions processed, left padding included (transformers' view)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if torch.compiler.is_compiling():
            if self.owner._armed and key_states.shape[-2] == 1:
                return self._update_armed(key_states, value_states)
            return self._update_outside(key_states, value_states)
        return self._update(key_states, value_states)

    def _update_armed(self, key_states, value_states):
        """``_update`` for one new token per row of an armed cache in a
        compiled step (no host work: the rows and pages were taken when it
        was armed; the op counts the position on the device)."""
        owner = self.owner
        owner._check_states(key_states, value_states)
        if key_states.shape[0] != len(owner._slots):
            _refuse(f"a batch of {key_states.shape[0]} rows after {len(owner._slots)} (the batch changed "
                    "between steps)")
        key_states._entmaxkv = value_states._entmaxkv = (owner, self.index)
        return key_states, value_states

    def _update(self, key_states, value_states):
        """Take the batch's rows at the first update; tag k and v with this
        layer for the attention function. An armed cache run eagerly is
        disarmed first (the host takes its counts back)."""
        self.owner._disarm()
        self.owner._bind(key_states, value_states, self.index)
        key_states._entmaxkv = value_states._entmaxkv = (self.owner, self.index)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    @torch.compiler.disable
    def _update_outside(self, key_states, value_states):
        return self._update(key_states, value_states)

    def get_seq_length(self):
        """Positions processed (left padding included): an int; while the
        cache is armed, read from the device (one synchronisation), or,
        inside a compiled step, the device count itself (int64 [], as
        transformers' static cache does)."""
        owner = self.owner
        if owner._armed:
            return owner._seen_dev[0] if torch.compiler.is_compiling() else owner._armed_seen()
        return self.seen

    def get_mask_sizes(self, query_length: int):
        """(kv_length, kv_offset) of transformers' mask code. Armed: a bound
        fixed while armed (the "entmaxkv" mask reads only the new positions,
        at the query offset); outside a compiled step it first refuses
        ``query_length`` more positions than the rows have room for."""
        owner = self.owner
        if owner._armed:
            if not torch.compiler.is_compiling():
                owner._check_room(query_length)
            return owner._seen_armed + owner._room + query_length, 0
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_len

    def reset(self) -> None:
        self.seen = 0
        self.owner._release()

    def reorder_cache(self, beam_idx) -> None:
        _refuse("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        _refuse("assisted decoding (crop)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _refuse("expanding the batch (beam search or num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        _refuse("selecting batch rows (contrastive search)")


class EntmaxKVCache(Cache):
    """The KV cache of a transformers model, decoded through EntmaxKV.

    ``model.generate(input_ids, attention_mask=..., past_key_values=cache)``
    (the model loaded or configured with ``attn_implementation="entmaxkv"``,
    after ``entmaxkv.hf.register()``) prefills densely and decodes every new
    token with ``policy``.

    Args:
        model_or_config: a transformers model or its config (a decoder with
            ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads`` and a head dim).
        policy: Full() (default), TopK, Gaussian or Certified.
        alpha: entmax alpha for prefill and decode; None: the config's
            ``entmax_alpha`` if it has one, else 1 (softmax).
        page_size: tokens per page (1..256); max_len: the longest row
            (prompt, left padding excluded, plus new tokens).
        dtype: storage dtype (None: the first K/V's); device: None: theirs.
        backend: "auto", "reference" or "triton".
        prefill_scores: int >= 1, the most attention scores a prompt's
            dense attention holds at once (it runs in query chunks).
        cuda_graphs: on CUDA with the Triton backend, run each layer's
            decode (the cache write and the attention) as one CUDA graph,
            captured after one direct run (``entmaxkv.hf.step``); False
            launches every kernel from Python.
        compileable: let transformers compile the model's decode step
            (``torch.compile``, on a GPU by default when the cache is
            compileable). Each prefill then ends by arming the cache for
            compiled decoding: the pages of every row's remaining
            ``max_len`` tokens are reserved, and each layer's decode is one
            custom op (``entmaxkv.hf.traced``) that dynamo traces with no
            graph break. False (the default): ``generate`` runs the model
            eagerly; the per-layer CUDA graphs remove most of the
            attention's launch cost.

    ``cache.reset()`` frees the rows and keeps the paged cache and the
    decoder with the layers' CUDA graphs, so one cache serves many
    ``generate`` calls without capturing again (a new cache captures one
    graph per layer in its first decode steps). A larger batch or another
    dtype after a reset builds a new paged cache.
    Raises:
        Unsupported (a ValueError) for a config with sliding-window or
        soft-capped attention or attention sinks, and, during generation, for
        beam search, assisted decoding and other batch reshuffles.
    """

    def __init__(self, model_or_config, *, policy=None, alpha: Optional[float] = None, page_size: int = 16,
                 max_len: int = 4096, dtype: Optional[torch.dtype] = None, device=None, backend: str = "auto",
                 prefill_scores: int = 1 << 26, cuda_graphs: bool = True, compileable: bool = False):
        cfg = getattr(model_or_config, "config", model_or_config)
        for name in ("num_hidden_layers", "num_attention_heads"):
            if not isinstance(getattr(cfg, name, None), int):
                raise ValueError(f"model_or_config: expected a decoder model or config with {name}, got "
                                 f"{describe(model_or_config)}")
        _check_config(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.q_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.q_heads
        if alpha is None:
            alpha = getattr(cfg, "entmax_alpha", 1.0)
        self.alpha = effective_alpha(check_alpha(alpha))
        self.page_size = as_int(page_size, "page_size", lo=1, hi=256)
        self.max_len = as_int(max_len, "max_len", lo=1)
        self.policy = Full() if policy is None else policy
        check_policy(self.policy, alpha=self.alpha, page_size=self.page_size)
        self.backend = as_choice(backend, "backend", BACKENDS)
        self.prefill_scores = as_int(prefill_scores, "prefill_scores", lo=1)
        self.cuda_graphs = as_bool(cuda_graphs, "cuda_graphs")
        self.compileable = as_bool(compileable, "compileable")
        self.dtype, self.device = dtype, device
        self._paged: Optional[PagedKVCache] = None
        self._decoder: Optional[Decoder] = None
        self._steps: Optional[LayerSteps] = None
        self._slopes = None
        self._slots = None
        # the compiled decode step's state (``_arm``): whether armed, the
        # rows' slots and the count of positions on the device (one buffer
        # each per paged cache: a compiled step's CUDA graph keeps the
        # address it was captured with), the count and the decode steps left
        # before a row is full when armed (their sum bounds every armed
        # step's kv length), and the name of what the op's launches read
        # (``_layout``)
        self._armed = False
        self._rows_buf: Optional[torch.Tensor] = None
        self._rows: Optional[torch.Tensor] = None
        self._seen_dev: Optional[torch.Tensor] = None
        self._seen_armed = 0
        self._room = 0
        self._reads: Optional[tuple] = None
        self._layout = "0"
        self._handle = register_cache(self)
        super().__init__(layers=[_Layer(self, i) for i in range(self.num_layers)])

    # ------------------------------------------------------------------ state
    @property
    def paged(self) -> Optional[PagedKVCache]:
        """The paged cache of every layer (None before the first forward)."""
        return self._paged

    def _release(self) -> None:
        """``reset``: free the rows but keep the paged cache and the decoder,
        so the next generation on this cache writes to the same tensors and
        replays the CUDA graphs captured before (made once per layer)."""
        if self._slots is not None and self._paged is not None:
            for s in self._slots:
                self._paged.free(s)
        self._slots = None
        self._armed = False

    # ------------------------------------------------- compiled decode steps
    def _arm(self, scale: float, slopes: Optional[torch.Tensor], q_dtype: torch.dtype) -> None:
        """After a prefill (host): reserve the pages of every row's
        remaining ``max_len`` tokens (the host mirror then counts the rows as
        full, the device lengths stay the true ones), plan the decoder over
        the rows and size its scratch with one run, so that a compiled
        decode step does no host work (``traced.hf_decode_layer``)."""
        paged = self._paged
        lens = [paged.length(s) for s in self._slots]
        if min(lens) == 0:
            return  # (a row with no token cannot decode; such steps take the eager path)
        dev, B = paged.device, len(self._slots)
        rows = self._rows_buf[:B]
        rows.copy_(torch.tensor(self._slots, dtype=torch.int64))
        paged.reserve(self._slots, [self.max_len - n for n in lens])
        paged.seq_lens[rows] = torch.tensor(lens, dtype=torch.int32, device=dev)
        self._rows, self._room = rows, self.max_len - max(lens)
        self._seen_armed = self.layers[0].seen
        self._seen_dev.fill_(self._seen_armed)
        self._armed = True
        dec = self.decoder(scale, slopes).plan_cache(paged, self._slots)
        dec.run(torch.zeros(B, self.q_heads, self.head_dim, dtype=q_dtype, device=dev), paged.layer(0), dense=False)
        # Every address the op's launches read. A compiled step's CUDA graph
        # replays the addresses it was captured with, and the op is opaque
        # to it: when one of them moved (a new paged cache for a larger
        # batch or another dtype, a new decoder, a grown scratch arena), the
        # layout gets a new name, which the attention passes to the op as a
        # string, so dynamo's guards fail and the step is compiled (and
        # captured) again rather than replayed.
        # (the decoder itself, not its id: held here, its id cannot name a later one)
        reads = (tuple(t.data_ptr() for t in paged.state_tensors().values()), rows.data_ptr(),
                 self._seen_dev.data_ptr(), dec,
                 dec.plan_key, dec.workspace_version)
        if reads != self._reads:
            self._reads = reads
            self._layout = str(int(self._layout) + 1)

    def _disarm(self) -> None:
        """Before host-side changes of an armed cache: the host mirror takes
        the device lengths back (one synchronisation) and the pages reserved
        past them return to the free list."""
        if not self._armed:
            return
        *lens, seen = torch.cat((self._paged.seq_lens[self._rows].long(), self._seen_dev)).tolist()
        for s, n in zip(self._slots, lens):
            self._paged._drop_unwritten(s, n)
        for layer in self.layers:
            layer.seen = seen
        self._armed = False

    def _armed_seen(self) -> int:
        """Positions processed by every layer of an armed cache (host; one
        synchronisation)."""
        return int(self._seen_dev[0])

    def _check_room(self, new: int) -> None:
        """Refuse ``new`` more positions per row of an armed cache past
        ``max_len`` (host, before the step: nothing is written)."""
        if self._armed_seen() - self._seen_armed + new > self._room:
            raise CacheFullError(f"EntmaxKVCache: a row would exceed max_len={self.max_len} tokens; "
                                 "nothing was written")

    def _device_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor,
                     layer: int) -> torch.Tensor:
        """One layer's decode of an armed cache with device state only (the
        body of ``traced.hf_decode_layer``; shapes there)."""
        paged, rows, P = self._paged, self._rows, self.page_size
        if layer == 0:
            # (a compiled step cannot raise on the host: past max_len it
            # stops on the device, before anything is changed)
            new = real.to(torch.int32)
            torch._assert_async((paged.seq_lens[rows] + new <= self.max_len).all(),
                                f"EntmaxKVCache: a row would exceed max_len={self.max_len} tokens")
            paged.seq_lens[rows] += new
            self._seen_dev += 1
        pos = paged.seq_lens[rows].long() - 1
        slot = paged.block_table[rows, pos // P].long() * P + pos % P
        slot = torch.where(real, slot, torch.full_like(slot, -1))  # (padding: nothing is written)
        paged.write(k, v, slot, layer=layer, backend=self.backend)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._decoder.run(q.contiguous(), paged.layer(layer), out, dense=False)
        return out.masked_fill_(~real[:, None, None], 0)

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or key_states.shape[1] != self.kv_heads or key_states.shape[-1] != self.head_dim:
            raise ValueError(f"key_states: expected [batch, {self.kv_heads}, tokens, {self.head_dim}] (the "
                             f"config's heads), got {tuple(key_states.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states: expected the shape of key_states {tuple(key_states.shape)}, "
                             f"got {tuple(value_states.shape)}")

    def _bind(self, key_states: torch.Tensor, value_states: torch.Tensor, index: int) -> None:
        """Build the paged cache at the first update (batch size, dtype,
        device known then), or take rows in it again after a ``reset``."""
        self._check_states(key_states, value_states)  # before anything is taken: a refused call changes nothing
        B = key_states.shape[0]
        if self._slots is None:
            dtype = self.dtype or key_states.dtype
            device = torch.device(self.device or key_states.device)
            if self._paged is not None and (B > self._paged.max_seqs or self._paged.dtype != dtype
                                            or not _same_device(self._paged.device, device)):
                self._paged = self._decoder = self._steps = None  # a larger batch, dtype or device: a new cache
            if self._paged is None:
                per_seq = -(-self.max_len // self.page_size)
                self._paged = PagedKVCache(B * per_seq, self.page_size, self.kv_heads, self.head_dim, max_seqs=B,
                                           max_pages_per_seq=per_seq, dtype=dtype, device=device,
                                           num_layers=self.num_layers)
                self._rows_buf = torch.zeros(B, dtype=torch.int64, device=self._paged.device)
                self._seen_dev = torch.zeros(1, dtype=torch.int64, device=self._paged.device)
            self._slots = [self._paged.allocate() for _ in range(B)]
        elif B != len(self._slots):
            _refuse(f"a batch of {B} rows after {len(self._slots)} (the batch changed between steps)")

    def decoder(self, scale: float, slopes: Optional[torch.Tensor] = None) -> Decoder:
        """The planned decoder of this cache (made on first use; ``slopes``:
        ALiBi slopes [q_heads], the same tensor every step)."""
        if self._decoder is None or self._decoder.scale != scale or self._slopes is not slopes:
            self._decoder = Decoder(self.policy, q_heads=self.q_heads, kv_heads=self.kv_heads,
                                    head_dim=self.head_dim, page_size=self.page_size, alpha=self.alpha,
                                    scale=scale, alibi_slopes=slopes, device=self._paged.device,
                                    backend=self.backend, cuda_graphs=False)  # (graphs: LayerSteps)
            self._slopes = slopes
            self._steps = None
        return self._decoder

    def steps(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> LayerSteps:
        """The layers' decode steps for the current batch (after ``decoder``;
        kept while the batch size, the dtypes and the decoder stay)."""
        key = (len(self._slots), q_dtype, kv_dtype)
        if self._steps is None or self._steps.key() != key:
            self._steps = LayerSteps(self._decoder, self._paged, *key, graphs=self.cuda_graphs, backend=self.backend)
        return self._steps

    @property
    def slots(self):
        return self._slots


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (a missing index matches any)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_config(cfg) -> None:
    """Refuse what EntmaxKV cannot decode exactly, by name."""
    layer_types = getattr(cfg, "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types) or (
            getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
            and not layer_types):
        _refuse("sliding-window attention")
    for name in ("attn_logit_softcapping", "final_attn_softcapping"):
        if getattr(cfg, name, None):
            _refuse(f"soft-capped attention ({name})")
    if getattr(cfg, "use_sink", False) or getattr(cfg, "attention_sinks", None) or \
            "sinks" in str(getattr(cfg, "model_type", "")):
        _refuse("attention sinks")
    as_float(getattr(cfg, "entmax_alpha", 1.0), "entmax_alpha", lo=1.0)
