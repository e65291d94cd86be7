"""Whether a process lives, by its PID (a worker asks after its agent), and which process a PID names now."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

START_TOLERANCE_S = 2.0
"""Without ticks: how far two reads of one process's creation time may differ (a stepped clock moves them)."""


def alive(pid: int) -> bool:
    """``True`` while ``pid`` names a process, ours to signal or not (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_ticks(pid: int) -> int | None:
    """The process's start in clock ticks since boot (``/proc/<pid>/stat``, field 22); None off Linux or unreadable.

    What tells a process from a later one that reuses its PID. Not psutil's ``create_time``: that adds the boot
    time, which each process reads off the wall clock, so two reads of one process differ after a clock step."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started_as(pid: int, ticks: int | None, created: float) -> bool:
    """Whether ``pid`` names the process recorded as started at ``ticks`` (:func:`start_ticks`) and ``created``
    (psutil's creation time): by ticks where both sides have them, else by creation time within
    :data:`START_TOLERANCE_S`. Raises ``psutil.NoSuchProcess`` when there is no such process (and the other
    ``psutil.Error`` when it is not ours to look at) on that fallback."""
    if ticks is not None and (now := start_ticks(pid)) is not None:
        return now == ticks
    return bool(abs(psutil.Process(pid).create_time() - created) <= START_TOLERANCE_S)
