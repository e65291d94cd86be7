"""Which process a PID names (elastrain.pids): a start read in clock ticks since boot, which no wall-clock step moves,
unlike psutil's creation time; the one check the control directories and the chaos tool's process trees use."""

from __future__ import annotations

import os

import psutil
import pytest

from elastrain import pids

ME = psutil.Process(os.getpid())
TICKS = pids.start_ticks(ME.pid)
CREATED = ME.create_time()


def test_this_process_has_one_start_in_ticks_however_often_it_is_read() -> None:
    assert isinstance(TICKS, int) and TICKS >= 0
    assert pids.start_ticks(ME.pid) == TICKS


def test_no_such_process_has_no_start() -> None:
    assert pids.start_ticks(2**22 + 12345) is None  # above Linux's largest PID
    with pytest.raises(psutil.NoSuchProcess):
        pids.started_as(2**22 + 12345, None, CREATED)


@pytest.mark.parametrize(
    ("ticks", "created", "same"),
    [
        (0, 0.0, True),
        (-1, 0.0, False),  # a later process with the same PID
        (0, 60.0, True),  # the ticks decide: a clock step moved the creation time read since
        (None, pids.START_TOLERANCE_S / 2, True),  # no ticks recorded: a clock step between the reads
        (None, pids.START_TOLERANCE_S * 2, False),
    ],
)
def test_a_recorded_start_names_this_process_when(ticks: int | None, created: float, same: bool) -> None:
    assert TICKS is not None
    recorded = None if ticks is None else TICKS + ticks
    assert pids.started_as(ME.pid, recorded, CREATED + created) is same
