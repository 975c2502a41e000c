"""EntmaxKV: fast long-context decoding with alpha-entmax attention.

Public API::

    from entmaxkv import PagedKVCache, decode, TopK, Gaussian, Certified, Full

    cache = PagedKVCache(num_pages, page_size, kv_heads, head_dim, max_seqs=...)
    seq = cache.allocate(); cache.prefill(seq, k, v)
    out = decode(q, cache, [seq], TopK(1024), alpha=1.5)

    dec = Decoder(TopK(1024), q_heads=..., kv_heads=..., head_dim=..., page_size=...)
    dec.plan_cache(cache, [seq]); out = dec.run(q, cache.layer(0))   # plan per step, run per layer

``entmaxkv.entmax`` is the module of the alpha-entmax mapping (thresholds,
probabilities). Its function is ``from entmaxkv.entmax import entmax``, or
``entmaxkv.alpha_entmax`` at the top level: re-exporting it as
``entmaxkv.entmax`` would hide the module (``import entmaxkv.entmax as m``
would then give the function).
"""
from .cache import CacheFullError, PagedKVCache
from .csr import block_table_to_csr, csr_to_block_table, selection_to_csr
from .decode import decode
from .entmax import entmax as alpha_entmax
from .entmax import entmax_threshold
from .metrics import Quality, dense_attention, evaluate_selection
from .planner import Decoder
from .policies import Certified, Full, Gaussian, TopK
from .types import DecodeStats, Selection

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "Certified",
    "DecodeStats",
    "Decoder",
    "Full",
    "Gaussian",
    "PagedKVCache",
    "Quality",
    "Selection",
    "TopK",
    "alpha_entmax",
    "block_table_to_csr",
    "csr_to_block_table",
    "decode",
    "dense_attention",
    "entmax_threshold",
    "evaluate_selection",
    "selection_to_csr",
]
