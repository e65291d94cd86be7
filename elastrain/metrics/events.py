"""The events file: one JSON object per line for each thing that happened to the job.

Starts, world-size changes, rescales, restores, checkpoints and preemptions are appended by whoever
sees them (rank 0 of the workers, or an agent). On a filesystem each is a single ``write`` on a file
opened with ``O_APPEND``, so that processes can share one file and a kill leaves at most one torn
last line, which :func:`read_events` skips. On an object store (``s3://``, ``az://``) each event is
its own part, put at once (see :mod:`elastrain.metrics.lines`). No torch import: agents use this too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from elastrain.metrics.lines import LineLog, append_json_line, read_json_lines

EVENTS_FILENAME = "events.jsonl"

__all__ = ["EVENTS_FILENAME", "EventsFile", "append_json_line", "read_events", "read_json_lines"]


class EventsFile:
    """Appends events to one JSON-lines log (a file or a URL); ``None`` as the path makes every call a no-op."""

    def __init__(self, path: str | os.PathLike[str] | None, **common: Any) -> None:
        self.path = os.fspath(path) if path else None
        self.common = common
        self._log = LineLog(self.path, flush_every_s=0.0) if self.path is not None else None

    def record(self, event: str, **fields: Any) -> None:
        if self._log is None:
            return
        record: dict[str, Any] = {"time": round(time.time(), 3), "event": event, "pid": os.getpid()}
        record.update(self.common)
        record.update({k: v for k, v in fields.items() if v is not None})
        self._log.append(record)


def read_events(path: str | os.PathLike[str], event: str | None = None) -> list[dict[str, Any]]:
    """The events at ``path`` (a file or a URL) in order, optionally only those named ``event``."""
    return [r for r in read_json_lines(path) if "event" in r and (event is None or r["event"] == event)]
