"""The agent's "I am stopping these workers" mark, so that a worker tells its agent's SIGTERM from anyone else's.

A worker started by ``elastrain-run`` defers its first SIGTERM (:mod:`elastrain.preemption.worker_sigterm`): the
signal may be a whole node's shutdown, of which the agent makes a leave with a checkpoint. The agent stops its
workers with a SIGTERM too (a restart, the end of a leave, the end of the job); it first writes their PIDs here
(:func:`mark_stopping`), and a worker whose PID is marked ends on the signal at once (:func:`is_stopping`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from elastrain.control.files import Fields, MessageReader, write_atomic

_STOPPING = "stopping.json"


def _pids(f: Fields) -> frozenset[int]:
    return frozenset(f.integer_map("pids"))


def mark_stopping(directory: str | Path, pids: Iterable[int]) -> None:
    """Agent side, before it signals its workers: ``pids`` are being stopped by their agent."""
    write_atomic(Path(directory) / _STOPPING, {"pids": {str(pid): 1 for pid in pids}})


def is_stopping(directory: str | Path, pid: int) -> bool:
    """Worker side: whether the agent marked ``pid`` as one it is stopping."""
    marked = MessageReader().read(Path(directory) / _STOPPING, _pids)
    return marked is not None and pid in marked
