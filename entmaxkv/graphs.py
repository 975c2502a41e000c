"""CUDA graphs of decode steps that read a planned decoder's scratch.

A step (a whole model's, ``model.step.ModelStep``, or one layer's of a
transformers cache, ``hf.step.LayerSteps``) runs directly once per key, which
compiles its kernels and sizes the decoder's workspace, is captured on its
second run and replayed after that. All graphs share one memory pool. When
the decoder's workspace is replaced (a step outgrew it), every graph reads
freed memory: all of them are dropped and warm up again. Whoever replaced
the workspace (a direct run elsewhere, a step with statistics), a graph
captured under another ``Decoder.workspace_version`` is captured again
before it would replay. A graph also reads the tensors of the plan it was
captured under (``Decoder.plan_key``): under another plan it is captured
again. A capture after every graph was dropped takes a new pool.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional

import torch

__all__ = ["StepGraphs"]


class StepGraphs:
    """Captured steps by key, for one ``planner.Decoder``'s workspace."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self._graphs: Dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._warm: Dict[Hashable, int] = {}
        self._plans: Dict[Hashable, tuple] = {}  # (plan key, workspace version) each graph was captured under
        self._pool = None

    def run(self, key: Hashable, body: Callable[[], None]) -> bool:
        """Run step ``key``: ``body()`` directly (warm-up) or its graph
        (captured on the key's second run). Returns whether a graph was
        replayed (the caller then does the host bookkeeping a direct run
        does, e.g. ``Decoder.replayed``)."""
        graph = self._graphs.get(key)
        if graph is not None and self._plans[key] != self._reads():
            del self._graphs[key]  # its plan's tensors or the workspace moved: capture again
            graph = None
        if graph is None and self._warm.get(key, 0) >= 1:
            graph = self._capture(key, body)
        if graph is None:
            body()
            self._warm[key] = self._warm.get(key, 0) + 1
            if self.decoder.workspace_grew:
                self.clear()
            return False
        graph.replay()
        return True

    def _capture(self, key, body) -> Optional[torch.cuda.CUDAGraph]:
        if self._pool is None or not self._graphs:
            # a pool whose graphs were all dropped must not be captured into
            # again: the allocator keeps it (its blocks may still be in use)
            # with no user left and refuses to take it back (an internal
            # assert); a fresh pool is always accepted
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            body()
        if self.decoder.workspace_grew:  # the capture read a buffer that was replaced
            self.clear()
            return None
        self._graphs[key] = graph
        self._plans[key] = self._reads()
        return graph

    def _reads(self) -> tuple:
        """What a graph captured now reads of the decoder: its plan and its workspace."""
        return self.decoder.plan_key, self.decoder.workspace_version

    def clear(self) -> None:
        """Drop every graph (each key warms up again)."""
        self._graphs.clear()
        self._warm.clear()
        self._plans.clear()

    def keys(self) -> List[Hashable]:
        """The captured keys, sorted."""
        return sorted(self._graphs)
