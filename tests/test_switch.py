"""The certified step's timed choice between its selection and its dense
pass (entmaxkv.model.switch.TimedSwitch): the selection first, then the
dense pass once, then the faster by the recent medians, the other form
after a wait of probe_every steps that doubles while probes confirm the
choice; errors name the argument. (The CUDA event
plumbing runs in tests/gpu/test_model_step.py.)"""
from __future__ import annotations

import pytest

from entmaxkv.model.switch import TimedSwitch


def choices(sw, n):
    return [sw.choose() for _ in range(n)]


def test_measures_both_forms_then_runs_the_faster():
    sw = TimedSwitch(probe_every=4, backoff=4)
    assert choices(sw, 3) == [False] * 3  # the selection has no time yet
    sw.record(False, 2.0)
    assert choices(sw, 2) == [True] * 2  # nor the dense pass
    sw.record(True, 1.5)
    assert sw.faster() is True
    # dense is faster: three dense steps, then a probe of the selection;
    # each probe that confirms the choice doubles the wait, up to 4 x 4
    assert choices(sw, 4) == [True] * 3 + [False]
    assert choices(sw, 4) == [True] * 3 + [False]
    assert choices(sw, 8) == [True] * 7 + [False]
    for _ in range(3):
        assert choices(sw, 16) == [True] * 15 + [False]
    for _ in range(3):  # the selection got faster (a median over the last 3)
        sw.record(False, 1.0)
    assert sw.faster() is False
    # it runs at once; the next probe comes after the wait reached, and the
    # change of form brings the wait back to probe_every
    assert choices(sw, 16) == [False] * 15 + [True]
    assert choices(sw, 4) == [False] * 3 + [True]
    assert choices(sw, 8) == [False] * 7 + [True]


def test_no_backoff_probes_every_probe_every_steps():
    sw = TimedSwitch(probe_every=3, backoff=1)
    sw.record(False, 1.0)
    sw.record(True, 2.0)
    assert choices(sw, 12) == [False, False, True] * 4


def test_the_median_of_recent_times_decides():
    sw = TimedSwitch(probe_every=8, keep=3)
    for ms in (5.0, 1.0, 1.1):
        sw.record(False, ms)
    sw.record(True, 1.2)
    assert sw.faster() is False  # median 1.1 < 1.2, though one selection took 5.0
    sw.record(False, 9.0)
    sw.record(False, 9.0)  # the last three: 1.1, 9.0, 9.0
    assert sw.faster() is True


@pytest.mark.parametrize("bad", [1, 0, 2.5, "4", None])
def test_probe_every_is_checked(bad):
    with pytest.raises(ValueError, match="probe_every"):
        TimedSwitch(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_keep_and_backoff_are_checked(bad):
    with pytest.raises(ValueError, match="keep"):
        TimedSwitch(4, keep=bad)
    with pytest.raises(ValueError, match="backoff"):
        TimedSwitch(4, backoff=bad)
