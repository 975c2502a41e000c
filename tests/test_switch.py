"""The certified step's timed choice between its selection and its dense
pass (entmaxkv.model.switch.TimedSwitch): the selection first, then the
dense pass once, then the faster by the recent medians, the other form
every probe_every-th step; errors name the argument. (The CUDA event
plumbing runs in tests/gpu/test_model_step.py.)"""
from __future__ import annotations

import pytest

from entmaxkv.model.switch import TimedSwitch


def choices(sw, n):
    return [sw.choose() for _ in range(n)]


def test_measures_both_forms_then_runs_the_faster():
    sw = TimedSwitch(probe_every=4)
    assert choices(sw, 3) == [False] * 3  # the selection has no time yet
    sw.record(False, 2.0)
    assert choices(sw, 2) == [True] * 2  # nor the dense pass
    sw.record(True, 1.5)
    assert sw.faster() is True
    # dense is faster: three dense steps, then one probe of the selection
    assert choices(sw, 8) == [True, True, True, False] * 2
    for _ in range(3):  # the selection got faster (a median over the last 3)
        sw.record(False, 1.0)
    assert sw.faster() is False
    assert choices(sw, 8) == [False, False, False, True] * 2


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
def test_keep_is_checked(bad):
    with pytest.raises(ValueError, match="keep"):
        TimedSwitch(4, keep=bad)
