"""The events file: one JSON object per line for each thing that happened to the job.

Starts, world-size changes, rescales, restores, checkpoints and preemptions are appended by whoever
sees them (rank 0 of the workers, or an agent), each as a single ``write`` on a file opened with
``O_APPEND``, so that processes can share one file and a kill leaves at most one torn last line,
which :func:`read_events` skips. No torch import: agents use this too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS_FILENAME = "events.jsonl"


def append_json_line(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` as one line with a single write (atomic against other appenders)."""
    data = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON object in ``path``; torn or foreign lines are skipped."""
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


class EventsFile:
    """Appends events to one JSON-lines file; ``None`` as the path makes every call a no-op."""

    def __init__(self, path: str | os.PathLike[str] | None, **common: Any) -> None:
        self.path = Path(path) if path else None
        self.common = common
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record: dict[str, Any] = {"time": round(time.time(), 3), "event": event, "pid": os.getpid()}
        record.update(self.common)
        record.update({k: v for k, v in fields.items() if v is not None})
        append_json_line(self.path, record)


def read_events(path: str | os.PathLike[str], event: str | None = None) -> list[dict[str, Any]]:
    """The events in ``path`` in order, optionally only those named ``event``."""
    return [r for r in read_json_lines(path) if "event" in r and (event is None or r["event"] == event)]
