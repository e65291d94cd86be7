"""Whether a process lives, by its PID (a worker asks after its agent)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """``True`` while ``pid`` names a process, ours to signal or not (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
