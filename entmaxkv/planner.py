"""The planned decoder: ``plan`` once per step, ``run`` once per layer.

FlashInfer's plan/run shape. ``Decoder`` fixes what a model fixes (policy,
alpha, scale, ALiBi slopes, head counts, page size, backend and launch
choices) and validates it once, at construction. ``plan`` takes one step's
batch composition (block table, lengths, rows) and validates it once for
all layers. ``run`` decodes one layer: it checks only shapes it can compare
in constant time, takes its scratch from a ``Workspace`` the decoder owns
(sized by the first step, never reallocated after), and makes no host
synchronisation.

On CUDA ``run`` also removes the launch overhead: after one direct run per
(layer, plan shape), the step's launches are captured in a CUDA graph that
later runs replay, with the query copied in and the output copied out
(``cuda_graphs=True``, the default). When the caller is itself capturing a
graph, ``run`` launches directly into that capture.

The certified policy checks its own cost: when the certified selection of
a layer keeps more than ``Certified.dense_above`` of the pages, later steps
of that layer run the dense pass instead (full-cache attention, so the
result is exact and certified by construction), trying the selection again
every ``Certified.probe_every`` steps. The coverage is read back
asynchronously (a copy to pinned memory, read once it has landed): no step
waits for it. A caller that chooses each step's form itself
(``dense_rule="caller"``, e.g. ``ModelStep`` timing both forms) passes
``dense`` to every ``run``; the coverage is then neither computed nor read
back.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ._checks import as_bool, as_choice, as_float, as_ids, as_int, describe
from .backend import BACKENDS, resolve_backend
from .layout import PagedKV, check_rows
from .limits import POSITION_MAX, check_alpha, effective_alpha
from .policies import Certified, Full, Policy, check_policy
from .step import run_step, step_stats
from .types import DecodeStats
from .workspace import Workspace

__all__ = ["Decoder"]

DENSE_RULES = ("coverage", "caller")
_MAX_GRAPHS = 256  # captured steps kept per decoder (least recently used dropped first)


@dataclass
class _CertState:
    """Per-layer cost check of the certified policy (see the module docstring)."""

    dense: bool = False
    since_probe: int = 0
    host: Optional[torch.Tensor] = None  # pinned float32 [1]: last coverage read back
    event: Optional[torch.cuda.Event] = None
    pending: bool = False


@dataclass
class _Graph:
    """One captured step and its static input / output buffers."""

    q: torch.Tensor
    out: torch.Tensor
    graph: Optional[torch.cuda.CUDAGraph] = None
    stats: Optional[DecodeStats] = None
    runs: int = 0
    extra: dict = field(default_factory=dict)


class Decoder:
    """Plan once per step, run per layer.

    Args:
        policy: Full() (default), TopK, Gaussian or Certified.
        q_heads, kv_heads, head_dim, page_size: the model's attention shape
            (q_heads a multiple of kv_heads; page_size 1..256).
        alpha: entmax alpha in [1, 4] (1: softmax); scale: score scale > 0
            (default 1/sqrt(head_dim)); alibi_slopes: optional float
            [q_heads] (0 = no position).
        device: where the steps run (the caches' device).
        backend: "auto" (Triton on CUDA when usable), "reference" or "triton".
        kernel_config: an ``entmaxkv.kernels.KernelConfig`` or None.
        cuda_graphs: replay each (layer, plan shape)'s launches from a CUDA
            graph after its first run (CUDA only; ignored elsewhere).
        dense_rule: how a certified step chooses between its selection and
            the dense pass when ``run`` gets ``dense=None``: "coverage" (the
            kept-fraction rule above) or "caller" (the caller passes
            ``dense``; None runs the selection; no coverage is computed).

    Example::

        dec = Decoder(TopK(1024), q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                      alpha=1.5, device="cuda")
        for step in range(n):
            dec.plan(block_table, seq_lens)          # int32 [B, M], [B]
            for i, layer in enumerate(layers):
                out = dec.run(q[i], kv[i])           # q [B, 32, 128] -> out [B, 32, 128]
    """

    def __init__(
        self,
        policy: Optional[Policy] = None,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        alpha: float = 1.5,
        scale: Optional[float] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        device: Union[str, torch.device] = "cpu",
        backend: str = "auto",
        kernel_config=None,
        cuda_graphs: bool = True,
        dense_rule: str = "coverage",
    ) -> None:
        from .decode import _check_kernel_config

        self.q_heads = as_int(q_heads, "q_heads", lo=1)
        self.kv_heads = as_int(kv_heads, "kv_heads", lo=1)
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads: expected a multiple of kv_heads ({self.kv_heads}), got {self.q_heads}")
        self.head_dim = as_int(head_dim, "head_dim", lo=1)
        self.page_size = as_int(page_size, "page_size", lo=1, hi=256)
        self.alpha = effective_alpha(check_alpha(alpha))
        self.scale = (1.0 / math.sqrt(self.head_dim) if scale is None
                      else as_float(scale, "scale", lo=0.0, lo_open=True))
        self.policy = Full() if policy is None else policy
        check_policy(self.policy, alpha=self.alpha, page_size=self.page_size)
        from .cache import _resolve_device

        self.device = _resolve_device(device)
        as_choice(backend, "backend", BACKENDS)
        _check_kernel_config(kernel_config)
        self._ops = resolve_backend(backend, self.device, kernel_config)
        self.cuda_graphs = as_bool(cuda_graphs, "cuda_graphs") and self.capturable
        # the certified policy's cost check (off for other policies and with probe_every 1)
        cert = isinstance(self.policy, Certified)
        self._switch = cert and self.policy.probe_every > 1 and self.policy.dense_above < 1.0
        self.dense_rule = as_choice(dense_rule, "dense_rule", DENSE_RULES)
        self._coverage = self._switch and self.dense_rule == "coverage"
        self.slopes = self._check_slopes(alibi_slopes)
        self._ws = Workspace(self.device)
        self._ids_buf = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._last_ids = None  # the host ids last copied into _ids_buf
        self._plan = None
        self._plan_key = None
        self._layers = {}  # id(kv) -> (kv, plan tables, layer view)
        self._graphs: "OrderedDict[tuple, _Graph]" = OrderedDict()
        self._cert = {}  # id(kv) -> _CertState

    # ------------------------------------------------------------------ plan
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
             seq_ids: Union[None, Sequence[int], torch.Tensor] = None) -> "Decoder":
        """Fix one step's batch: the rows of ``block_table`` / ``seq_lens``
        the queries of the next ``run`` calls decode against.

        Args:
            block_table: int32 [rows, max_pages], contiguous, on the device:
                physical page of each logical page.
            seq_lens: int32 [rows] on the device: tokens of each row, the
                current token included (at least 1 for every decoded row).
            seq_ids: which rows the batch decodes, in query order: None
                (rows 0 .. rows-1), ints (a list, tuple or NumPy array) or
                an int32/int64 tensor [batch].
        Returns self. No host synchronisation; nothing is allocated unless
        the batch outgrows the last one.
        """
        check_rows(block_table, seq_lens, self.device, "the decoder's device")
        if self.slopes is not None and block_table.shape[1] * self.page_size > POSITION_MAX:
            raise ValueError(
                f"block_table: ALiBi needs at most {POSITION_MAX} tokens per row (positions are float32), "
                f"but {block_table.shape[1]} pages of {self.page_size} hold more")
        ids = self._plan_ids(seq_ids, block_table.shape[0])
        self._plan = (block_table, seq_lens, ids)
        # what a per-layer graph is keyed by from the plan, read once here
        # rather than in every run (host time per layer)
        self._plan_key = (block_table.data_ptr(), seq_lens.data_ptr(), ids.data_ptr(), ids.shape[0],
                          block_table.shape[1])
        return self

    def plan_cache(self, cache, seq_ids: Union[Sequence[int], torch.Tensor]) -> "Decoder":
        """``plan`` for sequences of a ``PagedKVCache`` (its block table and
        lengths), checking on the host that each id is an allocated,
        non-empty sequence (a CUDA tensor of ids is not checked: reading it
        would synchronise)."""
        from .cache import PagedKVCache

        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache: expected a PagedKVCache, got {describe(cache)}")
        self._check_cache(cache)
        host = _host_ids(seq_ids)
        if host is not None:
            active = cache._active
            for s in host:
                if not (0 <= s < cache.max_seqs) or not active[s]:
                    raise ValueError(f"seq_ids: sequence {s} is not allocated in the cache")
                if cache._lens[s] == 0:
                    raise ValueError(f"seq_ids: sequence {s} is empty; append its token first")
        return self.plan(cache.block_table, cache.seq_lens, seq_ids)

    def _plan_ids(self, seq_ids, rows: int) -> torch.Tensor:
        """int32 [batch] row ids on the device, in a buffer whose address
        stays the same from step to step (a captured graph reads it)."""
        if seq_ids is None:
            host = tuple(range(rows))
        else:
            host = _host_ids(seq_ids)
        if host is not None:
            if not host:
                raise ValueError("seq_ids: expected at least one row")
            for s in host:
                if not 0 <= s < rows:
                    raise ValueError(f"seq_ids: expected rows in 0..{rows - 1}, got {s}")
            B = len(host)
        else:  # a device tensor
            if seq_ids.dim() != 1 or seq_ids.numel() == 0:
                raise ValueError(f"seq_ids: expected a non-empty 1-d tensor, got shape {tuple(seq_ids.shape)}")
            if seq_ids.device != self.device:
                raise ValueError(f"seq_ids: expected a tensor on {self.device} (the decoder's device), got "
                                 f"{seq_ids.device}")
            B = seq_ids.numel()
        if self._ids_buf.numel() < B:
            self._ids_buf = torch.zeros(max(B, 2 * self._ids_buf.numel()), dtype=torch.int32, device=self.device)
            self._last_ids = None
            self._graphs.clear()  # they read the old buffer
        ids = self._ids_buf[:B]
        if host is None:
            ids.copy_(seq_ids)
            self._last_ids = None
        elif host != self._last_ids:
            src = torch.tensor(host, dtype=torch.int32)
            if self.device.type == "cuda":
                src = src.pin_memory()
            ids.copy_(src, non_blocking=True)
            self._last_ids = host
        return ids

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, kv, out: Optional[torch.Tensor] = None, *,
            return_stats: bool = False, dense: Optional[bool] = None):
        """Decode one layer of the planned step.

        Args:
            q: [batch, q_heads, head_dim] float16/bfloat16/float32 (float64
                on the reference backend), on the device; NaN/inf are not
                checked here (``entmaxkv.decode`` can).
            kv: the layer's ``layout.PagedKV`` (pages and statistics; the
                plan's block table and lengths replace its own), or a
                one-layer ``PagedKVCache``.
            out: optional [batch, q_heads, head_dim] in q's dtype, last dim
                contiguous, written in place (else a new tensor).
            return_stats: also return ``DecodeStats`` (new tensors).
            dense: None: the decoder decides (the certified policy's cost
                check); True / False: run the dense pass / the policy.
        Returns:
            out, or (out, DecodeStats).

        Inside a caller's CUDA-graph capture the launches go into that
        capture and the host bookkeeping of the certified cost check is left
        to the caller: ``replayed(layers, dense)`` after each replay.
        """
        if self._plan is None:
            raise ValueError("run: no plan; call plan(...) (or plan_cache(...)) first")
        block_table, seq_lens, ids = self._plan
        B = ids.shape[0]
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (B, self.q_heads, self.head_dim):
            raise ValueError(f"q: expected a tensor of shape ({B}, {self.q_heads}, {self.head_dim}) "
                             f"(the planned batch), got {describe(q)}")
        if q.device != self.device or not q.is_floating_point():
            raise ValueError(f"q: expected a floating tensor on {self.device}, got {q.dtype} on {q.device}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                                or out.device != q.device or out.stride(-1) != 1):
            raise ValueError(f"out: expected a tensor of shape {tuple(q.shape)}, dtype {q.dtype}, on {q.device}, "
                             f"last dim contiguous, got {describe(out)}")
        return_stats = as_bool(return_stats, "return_stats")
        layer = self._layer(kv, block_table, seq_lens)
        lkey = id(kv)
        dense = self._dense_now(lkey) if dense is None else as_bool(dense, "dense")
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.cuda_graphs and not capturing:
            return self._run_graph(q, layer, ids, out, return_stats, dense, lkey)
        return self._run_direct(q, layer, ids, out, return_stats, dense, lkey, keep_cov=not capturing)

    @property
    def capturable(self) -> bool:
        """Whether its steps can be captured in a CUDA graph: on CUDA with the
        Triton backend (the reference stages are not written to be captured)."""
        return self.device.type == "cuda" and self._ops.name == "triton"

    @property
    def switches(self) -> bool:
        """Whether the policy may run a step as the dense pass: the certified
        policy with switching on (``dense_above`` < 1, ``probe_every`` > 1)."""
        return self._switch

    @property
    def plan_key(self) -> Optional[tuple]:
        """What a step captured in a CUDA graph reads of the last plan (the
        addresses and shapes of its block table, lengths and row ids): a
        graph captured under another key must not be replayed."""
        return self._plan_key

    @property
    def workspace_grew(self) -> bool:
        """Whether the last run outgrew the scratch arena (it was replaced:
        a graph captured before then reads freed memory and must be dropped)."""
        return self._ws.grew

    @property
    def workspace_version(self) -> int:
        """How many times the scratch arena was replaced: a graph captured
        under another version reads freed memory, whoever grew the arena
        since (another caller's direct run, a step with statistics)."""
        return self._ws.version

    def dense_now(self, layers: Sequence) -> bool:
        """Whether the next step of these layers (their ``run`` objects)
        should run the dense pass: the certified cost check decided for a
        whole step (most layers' decision), for a caller that captures all
        layers in one graph. Always False for other policies and under
        ``dense_rule="caller"``."""
        if not self._coverage:
            return False
        votes = [self._dense_now(id(kv)) for kv in layers]
        return 2 * sum(votes) > len(votes)

    def replayed(self, layers: Sequence, dense: bool) -> None:
        """The caller replayed a captured step that ran these layers (dense
        or not): do the host bookkeeping their ``run`` calls left out
        (none unless the coverage rule decides the certified steps)."""
        if not self._coverage:
            return
        for kv in layers:
            self._after_step(id(kv), dense)

    def _run_direct(self, q, layer, ids, out, return_stats, dense, lkey, *, keep_cov=True):
        self._ws.begin()
        try:
            res = self._step(q, layer, ids, out, return_stats, dense, lkey)
        finally:
            self._ws.end()
        if self.cuda_graphs and self._ws.grew:
            self._graphs.clear()  # they hold views of the buffer just replaced
        if keep_cov:
            self._after_step(lkey, dense)
        return res

    def _step(self, q, layer, ids, out, return_stats, dense, lkey):
        """One layer's launches (what a graph captures)."""
        policy = Full() if dense else self.policy
        sel, o, tau, ub = run_step(self._ops, policy, q, layer, ids, self.alpha, self.scale, self.slopes,
                                   need_bounds=return_stats, ws=self._ws, out=out)
        if self._coverage and not dense:
            self._save_coverage(lkey, sel, layer, ids)
        if not return_stats:
            return o
        return o, step_stats(self._ops, layer, ids, sel, o, tau, ub, self.alpha, self.q_heads, q, self.scale,
                             self.slopes)

    def _run_graph(self, q, layer, ids, out, return_stats, dense, lkey):
        key = (lkey, self._plan_key, q.dtype, return_stats, dense)
        g = self._graphs.get(key)
        if g is None:
            g = _Graph(torch.empty_like(q), torch.empty_like(q))
            self._graphs[key] = g
            while len(self._graphs) > _MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        g.q.copy_(q)
        if g.graph is None and g.runs >= 1 and not self._ws.grew:
            self._capture(g, layer, ids, return_stats, dense, lkey)
        if g.graph is None:
            # warm-up on the static buffers: compiles every kernel the
            # capture will record and sizes the workspace
            res = self._run_direct(g.q, layer, ids, g.out, return_stats, dense, lkey)
            g.runs += 1
            if key not in self._graphs:  # the workspace grew: graphs were dropped
                g.runs = 0
            stats = res[1] if return_stats else None
        else:
            g.graph.replay()
            self._after_step(lkey, dense)
            stats = _clone_stats(g.stats) if return_stats else None
        if out is None:
            out = g.out.clone()
        else:
            out.copy_(g.out)
        return (out, stats) if return_stats else out

    def _capture(self, g: _Graph, layer, ids, return_stats, dense, lkey) -> None:
        graph = torch.cuda.CUDAGraph()
        self._ws.begin()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            res = self._step(g.q, layer, ids, g.out, return_stats, dense, lkey)
        grew = self._ws.end()
        if grew:  # cannot happen after a warm-up of the same key; never keep a graph on a freed buffer
            self._graphs.clear()
            return
        g.graph = graph
        g.stats = res[1] if return_stats else None

    # ------------------------------------------------------------ certified
    def _dense_now(self, lkey) -> bool:
        """Whether this step of layer ``lkey`` runs the certified policy as
        the dense pass (see the module docstring)."""
        if not self._coverage:
            return False
        st = self._cert.get(lkey)
        if st is None:
            return False
        if st.pending and (st.event is None or st.event.query()):
            st.pending = False
            st.dense = float(st.host[0]) > self.policy.dense_above
            st.since_probe = 0
        if st.dense and st.since_probe >= self.policy.probe_every - 1:
            st.since_probe = 0
            return False  # probe: run the selection again
        return st.dense

    def _save_coverage(self, lkey, sel, layer, ids) -> None:
        """Queue the fraction of valid pages the certified selection kept
        (over the batch and the selection heads) for an asynchronous read."""
        st = self._cert.get(lkey)
        if st is None:
            pin = self.device.type == "cuda"
            st = self._cert[lkey] = _CertState(host=torch.zeros(1, dtype=torch.float32, pin_memory=pin))
        st.host.copy_(self._ops.kept_fraction(sel, layer, ids, ws=self._ws), non_blocking=True)

    def _after_step(self, lkey, dense: bool) -> None:
        st = self._cert.get(lkey)
        if st is None or not self._coverage:
            return
        if dense:
            st.since_probe += 1
            return
        # a certified step ran: its coverage is on its way to st.host
        if self.device.type == "cuda":
            st.event = st.event or torch.cuda.Event()
            st.event.record()
        st.pending = True

    # ------------------------------------------------------------ helpers
    def _layer(self, kv, block_table, seq_lens) -> PagedKV:
        """``kv`` (PagedKV or one-layer PagedKVCache) under the plan's rows,
        checked the first time this object and these tables are seen."""
        hit = self._layers.get(id(kv))
        if hit is not None and hit[0] is kv and hit[1] is block_table and hit[2] is seq_lens:
            return hit[3]
        from .cache import PagedKVCache

        if isinstance(kv, PagedKVCache):
            if kv.num_layers != 1:
                raise ValueError(f"kv: a cache of {kv.num_layers} layers; pass one of them, cache.layer(i)")
            base = kv.layer(0)
        elif isinstance(kv, PagedKV):
            base = kv
        else:
            raise ValueError(f"kv: expected a layout.PagedKV or a PagedKVCache, got {describe(kv)}")
        base.check(rows=False)
        self._check_cache(base, "kv")
        if base.num_pages * base.page_size >= 2**31:
            raise ValueError("kv: num_pages * page_size must stay below 2**31 (token ids are int32)")
        layer = base.with_rows(block_table, seq_lens)
        self._layers[id(kv)] = (kv, block_table, seq_lens, layer)
        return layer

    def _check_cache(self, cache, name: str = "cache") -> None:
        """``cache`` (a PagedKVCache or a PagedKV, called ``name``) has the decoder's shape and device."""
        if (cache.kv_heads, cache.head_dim, cache.page_size) != (self.kv_heads, self.head_dim, self.page_size):
            raise ValueError(f"{name}: expected kv_heads, head_dim, page_size = {self.kv_heads}, {self.head_dim}, "
                             f"{self.page_size} (the decoder's), got {cache.kv_heads}, {cache.head_dim}, "
                             f"{cache.page_size}")
        if cache.device != self.device:
            raise ValueError(f"{name}: expected tensors on {self.device} (the decoder's device), got {cache.device}")

    def _check_slopes(self, slopes) -> Optional[torch.Tensor]:
        if slopes is None:
            return None
        HQ = self.q_heads
        if not isinstance(slopes, torch.Tensor) or slopes.shape != (HQ,) or not slopes.is_floating_point():
            raise ValueError(f"alibi_slopes: expected a float tensor of shape ({HQ},), got {describe(slopes)}")
        if not bool(torch.isfinite(slopes).all()):  # once, at construction
            raise ValueError("alibi_slopes: contains NaN or infinite values (expected finite slopes)")
        return slopes.to(device=self.device, dtype=torch.float32).contiguous()


def _host_ids(seq_ids):
    """``seq_ids`` as a tuple of Python ints, or None for a device tensor."""
    return as_ids(seq_ids, "seq_ids", "a sequence of ints or an int32/int64 tensor [batch]")


def _clone_stats(st: DecodeStats) -> DecodeStats:
    return DecodeStats(*(t.clone() for t in (st.pages_read, st.tokens_read, st.coverage, st.tau, st.certified)))

