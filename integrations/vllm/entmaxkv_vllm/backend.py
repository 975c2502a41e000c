"""EntmaxKV as a vLLM attention backend (vLLM's v1 backend interface).

- **Pages.** vLLM allocates and schedules the pages; each page row holds a
  token's K and V and a share of the page's key statistics, so a page
  carries its own metadata (``entmaxkv.layout.stats_in_pages``) and vLLM's
  memory accounting covers all of it (``customize_spec`` widens the row to
  ``layout.row_width``). Layout LBHNC; any ``--block-size`` in 1..256.
- **Writes.** ``do_kv_cache_update`` stores K/V and updates the statistics
  of the touched pages through vLLM's ``slot_mapping``
  (``entmaxkv.ops.write_kv``; one Triton launch on CUDA).
- **Decode rows** (one new token past the prompt): one planned EntmaxKV step per layer with
  the configured policy (``entmaxkv.Decoder``; its own CUDA graphs on CUDA).
- **Prefill rows** (a prompt, or a chunk of one after cached context, even
  a single token of it): dense
  causal attention over the row's pages, softmax or entmax
  (``entmaxkv.prefill.paged_prefill``).

Capabilities, declared as they are: decoder attention only, no sliding
window, no attention sinks, no logits soft-capping, no quantised KV cache,
no decode/prefill context parallelism, no speculative decoding, and no
full-model CUDA graphs around attention (``AttentionCGSupport.NEVER``:
the batch split is planned on the host; piecewise graphs of the rest of
the model still run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from entmaxkv import Decoder, ops
from entmaxkv.layout import PagedKV, row_width, stats_in_pages
from entmaxkv.prefill import paged_prefill

from .config import Settings, settings_from

__all__ = ["EntmaxKVBackend", "EntmaxKVImpl", "EntmaxKVMetadata", "EntmaxKVMetadataBuilder", "Unsupported"]


class Unsupported(ValueError):
    """A vLLM feature this backend does not implement (named in the message)."""


class EntmaxKVBackend(AttentionBackend):
    """The backend class vLLM resolves (registered as CUSTOM, and as CPU_ATTN
    on the CPU platform, which always picks that name)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["EntmaxKVImpl"]:
        return EntmaxKVImpl

    @staticmethod
    def get_builder_cls() -> type["EntmaxKVMetadataBuilder"]:
        return EntmaxKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # (any size: a manager block is never split, its statistics are per block)
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Widen each token row so that a page holds its own statistics."""
        from dataclasses import replace

        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise Unsupported(f"EntmaxKV: head_size_v {spec.head_size_v} != head_size {spec.head_size} "
                              "(K and V share the head dim)")
        width = row_width(spec.block_size, spec.head_size, spec.dtype)
        return replace(spec, state_content_bytes=width * torch.tensor([], dtype=spec.dtype).element_size())

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(2, 513, 2))


@dataclass
class EntmaxKVMetadata:
    """One step's batch, split on the host into decode rows and prefill rows.

    Attributes:
        num_actual_tokens: tokens of the step (vLLM may pad past them).
        block_table: int32 [rows, max_pages]; seq_lens: int32 [rows] (the
            new tokens included); slot_mapping: int64 [tokens].
        decode_rows: rows with one new token past their prompt; decode_tokens: int64 [len] on
            the device, the token index of each of them.
        prefills: (row, first token, end token, row length) of each other row.
    """

    num_actual_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    decode_rows: tuple
    decode_tokens: Optional[torch.Tensor]
    prefills: tuple


class EntmaxKVMetadataBuilder(AttentionMetadataBuilder[EntmaxKVMetadata]):
    """Splits each step into decode and prefill rows (once for all layers)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first: their queries are one slice
        self.block_size = kv_cache_spec.block_size
        self.settings = settings_from(vllm_config.additional_config)
        if vllm_config.speculative_config is not None:
            raise Unsupported("EntmaxKV: speculative decoding is not supported")
        par = vllm_config.parallel_config
        if par.decode_context_parallel_size > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
            raise Unsupported("EntmaxKV: decode/prefill context parallelism is not supported by this backend")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> EntmaxKVMetadata:
        cm = common_attn_metadata
        R = cm.num_reqs
        starts = cm.query_start_loc_cpu[: R + 1].tolist()
        lens_host = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens
        lens = [int(x) for x in lens_host[:R].tolist()]  # (free on the CPU; exact for prefill rows)
        capacity = cm.block_table_tensor.shape[1] * self.block_size
        for r, n in enumerate(lens):
            if n > capacity:
                raise ValueError(f"seq_lens: request row {r} holds {n} tokens, more than a block-table row's "
                                 f"{cm.block_table_tensor.shape[1]} pages of {self.block_size} tokens ({capacity})")
        # (a row still in its prompt attends densely even to one new token: a
        # prompt found in the prefix cache but for its last token must give
        # what the whole prompt gives)
        prompt = [False] * R if cm.is_prefilling is None else [bool(x) for x in cm.is_prefilling[:R].tolist()]
        decode_rows, decode_tokens, prefills = [], [], []
        for r in range(R):
            q0, q1 = starts[r], starts[r + 1]
            if q1 - q0 == 1 and not prompt[r]:
                decode_rows.append(r)
                decode_tokens.append(q0)
            elif q1 > q0:
                prefills.append((r, q0, q1, lens[r]))
        tokens = None
        if decode_rows:
            tokens = torch.tensor(decode_tokens, dtype=torch.int64)
            if cm.block_table_tensor.device.type == "cuda":
                tokens = tokens.pin_memory().to(cm.block_table_tensor.device, non_blocking=True)
        return EntmaxKVMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            block_table=cm.block_table_tensor[:R],
            seq_lens=cm.seq_lens[:R],
            slot_mapping=cm.slot_mapping,
            decode_rows=tuple(decode_rows),
            decode_tokens=tokens,
            prefills=tuple(prefills),
        )


class EntmaxKVImpl(AttentionImpl[EntmaxKVMetadata]):
    """One attention layer: writes through the slot mapping, decodes through
    a planned EntmaxKV decoder, prefills densely over the pages."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None, **extra) -> None:
        for name, bad in (("sliding_window", sliding_window is not None),
                          ("logits_soft_cap", bool(logits_soft_cap)),
                          ("sinks", sinks is not None),
                          (f"attn_type {attn_type!r}", attn_type != AttentionType.DECODER),
                          (f"kv_cache_dtype {kv_cache_dtype!r}",
                           kv_cache_dtype not in EntmaxKVBackend.supported_kv_cache_dtypes),
                          (f"{sorted(extra)}", bool(extra))):
            if bad:
                raise Unsupported(f"EntmaxKV: {name} is not supported by this backend")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = None
        self.slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.settings: Settings = settings_from(get_current_vllm_config().additional_config)
        self._decoder: Optional[Decoder] = None
        self._pages: Optional[tuple] = None  # (the kv_cache tensor, its PagedKV)

    # ------------------------------------------------------------ helpers
    def _kv(self, kv_cache: torch.Tensor) -> PagedKV:
        """The PagedKV over vLLM's [blocks, kv_heads, block_size, row] tensor (cached per tensor)."""
        if self._pages is None or self._pages[0] is not kv_cache:
            self._pages = (kv_cache, stats_in_pages(kv_cache, self.head_size))
        return self._pages[1]

    def _decoder_for(self, kv: PagedKV) -> Decoder:
        if self._decoder is None:
            s = self.settings
            self._decoder = Decoder(
                s.policy_obj, q_heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_size,
                page_size=kv.page_size, alpha=s.alpha, scale=self.scale,
                alibi_slopes=None if self.slopes is None else self.slopes.to(kv.device), device=kv.device,
                backend=s.backend)
        return self._decoder

    # ------------------------------------------------------------ vLLM API
    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's K/V ([tokens, kv_heads, head_size]) at ``slot_mapping``
        and update the statistics of the pages they touch."""
        n = slot_mapping.shape[0]
        ops.write_kv(self._kv(kv_cache), key[:n], value[:n], slot_mapping, backend=self.settings.backend)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[EntmaxKVMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [tokens, num_heads, head_size]; output [tokens, num_heads, head_size], written in place."""
        if output_scale is not None or output_block_scale is not None:
            raise Unsupported("EntmaxKV: fused output quantisation is not supported")
        if attn_metadata is None:  # vLLM's profiling run
            return output
        md = attn_metadata
        kv = self._kv(kv_cache)
        if md.decode_rows:
            dec = self._decoder_for(kv)
            dec.plan(md.block_table, md.seq_lens, md.decode_rows)
            q = query.index_select(0, md.decode_tokens)
            output.index_copy_(0, md.decode_tokens, dec.run(q, kv).to(output.dtype))
        for r, q0, q1, n in md.prefills:
            paged_prefill(query[q0:q1], kv, md.block_table[r], n, alpha=self.settings.alpha, scale=self.scale,
                          alibi_slopes=self.slopes, max_scores=self.settings.prefill_scores, out=output[q0:q1])
        return output
