"""Process trees of local "nodes": an agent and every worker it started, tracked so none is orphaned.

torch starts workers in their own session (``start_new_session=True``), so signalling the agent's
process group misses them, and once the agent is dead they are re-parented and invisible from it.
A :class:`ProcessTree` therefore remembers every descendant it has ever seen (PID and start, so a reused
PID is never signalled) and kills by that list. The start is in clock ticks since boot where Linux tells it
(:func:`elastrain.pids.started_as`): psutil's creation time moves when the wall clock is stepped, and the
tree then took its live processes for gone (a kill missed them; the soak's orphan check passed over them).
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil

from elastrain import pids
from elastrain.env import CHAOS_TAG


class ProcessTree:
    """One node incarnation: the root process and every descendant seen while it ran."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._seen: dict[int, tuple[int | None, float]] = {}  # pid -> its start: ticks, creation time
        self._remember(root_pid)
        self.refresh()

    def _remember(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            if pid not in self._seen:
                self._seen[pid] = (pids.start_ticks(pid), psutil.Process(pid).create_time())

    def refresh(self) -> None:
        """Record the descendants that exist now (call it often: a dead agent's workers are no longer its children)."""
        for pid in list(self._seen):
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(pid).children(recursive=True):
                    self._remember(child.pid)

    def alive(self) -> list[int]:
        """Remembered processes still running (not zombies), in the order first seen."""
        out = []
        for pid, started in self._seen.items():
            try:
                if pids.started_as(pid, *started) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    def signal(self, sig: int, root_only: bool = False) -> list[int]:
        """Send ``sig`` to the root (``root_only``) or to every live process of the tree; return the PIDs."""
        self.refresh()
        victims = [self.root_pid] if root_only else self.alive()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return victims

    def kill(self) -> list[int]:
        """SIGKILL every live process of the tree."""
        return self.signal(signal.SIGKILL)


TAG_VARIABLE = CHAOS_TAG
"""Set in every node's environment; workers inherit it, so a process that escaped every tree is still found."""


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment has ``ELASTRAIN_CHAOS_TAG=tag``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_VARIABLE) == tag:
                found.append(proc)
    return found
