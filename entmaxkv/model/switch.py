"""The certified step's choice between its selection and its dense pass, by time.

Both forms of a certified step give full-cache attention: the selection
proves that its pages hold the support, the dense pass reads every page.
A step may therefore run whichever is faster, and which one that is
depends on the batch, the lengths and how much the selection keeps: a
selection that keeps a given fraction of the pages can beat the dense
pass at one long row and lose to it at a batch of shorter ones, whose
rows the dense pass reads in parallel. The coverage rule
(``Certified.dense_above``) guesses from the kept fraction alone. Where
``ModelStep`` replays whole steps from CUDA graphs it measures instead: a
CUDA event pair around each replay, read once both have completed (never
waited on), and the form with the lower recent median runs; the other
form runs again after ``probe_every`` steps so that a change (longer
rows, a selection that keeps less) is seen. A probe is a step of the
slower form, so while the probes find the same form faster the wait
between them doubles, up to ``backoff`` times ``probe_every`` steps; a
change of form brings the wait back to ``probe_every``.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch

from .._checks import as_int

__all__ = ["TimedSwitch"]


class TimedSwitch:
    """Measured times of a certified step's two forms, and the next step's form.

    Args:
        probe_every: int >= 2: the probe_every-th choice after the last
            probe runs the form that is not the faster one, to measure it
            again (the wait doubles while probes confirm the choice).
        keep: how many recent times of each form the median is taken over.
        backoff: int >= 1: the longest wait between probes, in multiples
            of probe_every (1: a probe every probe_every steps).

    ``choose()`` -> bool (True: the dense pass), ``record(dense, ms)`` adds a
    measured time; on CUDA ``begin()`` / ``end(...)`` put events around a
    replay and ``poll()`` records the completed ones.
    """

    def __init__(self, probe_every: int, keep: int = 3, backoff: int = 8) -> None:
        self.probe_every = as_int(probe_every, "probe_every", lo=2)
        keep = as_int(keep, "keep", lo=1)
        self.longest = self.probe_every * as_int(backoff, "backoff", lo=1)
        self.times: Dict[bool, Deque[float]] = {False: deque(maxlen=keep), True: deque(maxlen=keep)}
        self._since_probe = 0
        self._every = self.probe_every  # the current wait between probes
        self._probed: Optional[bool] = None  # the faster form when the last probe ran
        self._pending: List[Tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []
        self._free: List[torch.cuda.Event] = []

    def record(self, dense: bool, ms: float) -> None:
        """Add one measured time (milliseconds) of the dense pass or the selection."""
        self.times[bool(dense)].append(float(ms))

    def faster(self) -> Optional[bool]:
        """The faster form by the recent medians (True: dense); None until both were measured."""
        sel, dense = self.times[False], self.times[True]
        if not sel or not dense:
            return None
        return statistics.median(dense) < statistics.median(sel)

    def choose(self) -> bool:
        """The next step's form: the selection until it has a time, then the
        dense pass until it has one, then the faster, with a probe of the
        other after each wait (see the module docstring)."""
        best = self.faster()
        if best is None:
            return bool(self.times[False])
        self._since_probe += 1
        if self._since_probe >= self._every:
            self._since_probe = 0
            same = best == self._probed
            self._every = min(2 * self._every, self.longest) if same else self.probe_every
            self._probed = best
            return not best
        return best

    # ------------------------------------------------------------ CUDA events
    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def begin(self) -> torch.cuda.Event:
        """Record and return the start event of a step (current stream)."""
        start = self._event()
        start.record()
        return start

    def end(self, start: torch.cuda.Event, dense: bool, keep: bool) -> None:
        """Record the step's end; its time is recorded by a later ``poll``
        when ``keep`` (a replay of a graph captured before: a warm-up, a
        capture and the replay right after it are not timed)."""
        if not keep:
            self._free.append(start)
            return
        stop = self._event()
        stop.record()
        self._pending.append((dense, start, stop))

    def poll(self) -> None:
        """Record the times of the timed steps that have completed, in order
        (no waiting: a step still running is left for a later poll)."""
        while self._pending and self._pending[0][2].query():
            dense, start, stop = self._pending.pop(0)
            self.record(dense, start.elapsed_time(stop))
            self._free += [start, stop]
