"""Which process a PID names (elastrain.pids.start_ticks) and the chaos tool's use of it: a start read in clock ticks
since boot, which no wall-clock step moves, unlike psutil's creation time."""

from __future__ import annotations

import os

import pytest

from elastrain import pids
from elastrain.chaos.procs import START_TOLERANCE_S, _Start


def test_this_process_has_one_start_in_ticks_however_often_it_is_read() -> None:
    first = pids.start_ticks(os.getpid())
    assert isinstance(first, int) and first >= 0
    assert pids.start_ticks(os.getpid()) == first


def test_no_such_process_has_no_start() -> None:
    assert pids.start_ticks(2**22 + 12345) is None  # above Linux's largest PID


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (_Start(True, 1234.0), _Start(True, 1234.0), True),
        (_Start(True, 1234.0), _Start(True, 1235.0), False),  # a later process with the same PID
        (_Start(False, 100.0), _Start(False, 100.0 + START_TOLERANCE_S / 2), True),  # a clock step between reads
        (_Start(False, 100.0), _Start(False, 100.0 + START_TOLERANCE_S * 2), False),
        (_Start(True, 100.0), _Start(False, 100.0), False),  # never compared across kinds
    ],
)
def test_two_reads_of_a_start_name_one_process_when(a: _Start, b: _Start, same: bool) -> None:
    assert a.same(b) is same
