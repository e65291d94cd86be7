"""How far a job has got, read from its elastrain metrics file, for trace events that wait on a step."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsProgress:
    """The highest global step in an elastrain ``metrics.jsonl``, read incrementally (cheap to poll)."""

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
            if isinstance(record, dict) and record.get("kind") == "point" and isinstance(record.get("step"), int):
                self.step = max(self.step, record["step"])
        return self.step
