"""How far a job has got, read from its elastrain metrics file, for trace events that wait on a step."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsProgress:
    """The highest global step in an elastrain ``metrics.jsonl`` or ``events.jsonl``, read incrementally
    (cheap to poll): metrics points, ``checkpoint`` events and the step a ``start`` restored. (A step
    whose requested save was followed at once by a restart is in a checkpoint but may have no point.)"""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self.step = 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return self.step
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("kind") == "point" or record.get("event") == "checkpoint":
                step = record.get("step")
            elif record.get("event") == "start":
                step = record.get("restored_step")
            else:
                continue
            if isinstance(step, int):
                self.step = max(self.step, step)
        return self.step
