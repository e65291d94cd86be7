"""Metrics keyed by global step that stay continuous across restarts.

Each start of the workers is a *segment* with a token that all ranks share. Rank 0 opens the
segment with the step it restored; every point carries its segment's token and global step. When
the job restarts from step ``R``, the points earlier segments logged after ``R`` were computed by
steps that the restart re-runs: :func:`read_metrics` marks them *superseded*, so each step shows
once, with its final value, and the series continues from ``R + 1`` without a jump back to 0.

Several processes may append to the same file (each line is one ``O_APPEND`` write), and the
order of points within the file does not matter, only the order of segments. On an object store
(``s3://``, ``az://``) the file is a folder of parts (:mod:`elastrain.metrics.lines`): the segment
header is put at once, points are buffered and put every ``flush_every_s`` seconds, at
:meth:`MetricsWriter.flush`, and around each checkpoint (:meth:`MetricsWriter.checkpointed`, which
the session calls), so that no point of a step a restart restores is lost with a buffer.
:func:`read_metrics` reads both.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from elastrain.metrics.lines import LineLog, read_json_lines

METRICS_FILENAME = "metrics.jsonl"
# On object stores: how old the oldest buffered point may get before it is put (one object per flush).
DEFAULT_FLUSH_EVERY_S = 30.0
COMPACT_EVERY = 64  # flushes between merges of the parts (object stores)


class MetricsWriter:
    """Appends points of one segment to a metrics file (a local path or a URL)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        segment: str,
        restored_step: int = 0,
        open_segment: bool = True,
        flush_every_s: float = DEFAULT_FLUSH_EVERY_S,
    ) -> None:
        """``open_segment``: write the segment's header (rank 0 does; other ranks only add points)."""
        self.path = os.fspath(path)
        self.segment = segment
        self.restored_step = restored_step
        # The writer that opens the segment (rank 0) keeps the parts few; point-only writers just add theirs.
        self._log = LineLog(self.path, flush_every_s=flush_every_s, compact_every=COMPACT_EVERY if open_segment else 0)
        self._flush_from: int | None = None
        if open_segment:
            self._log.compact_in_background()  # object stores: the earlier starts' parts become one
            self._log.append(
                {"kind": "segment", "segment": segment, "restored_step": restored_step, "time": round(time.time(), 3)},
            )
            self._log.flush()  # the header orders this segment after every earlier one: store it now

    def log(self, step: int, **values: Any) -> None:
        """Record ``values`` (JSON-able) at global ``step``."""
        self._log.append(
            {"kind": "point", "segment": self.segment, "step": step, "time": round(time.time(), 3), "values": values},
        )
        if self._flush_from is not None and step >= self._flush_from:
            self._flush_from = None
            self._log.flush()

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` was taken: store the points up to it now, and its own as they come.

        A restart restores that step and never re-runs it, so its points must not wait in a buffer
        that a kill would lose. The points of ``step`` are usually logged after its save started.
        """
        self._flush_from = step
        self._log.flush()

    def flush(self) -> None:
        """Store every point logged so far (a no-op on local files, which are written at once)."""
        self._log.flush()

    def close(self) -> None:
        """Flush, and let a running merge of parts finish (bounded)."""
        self._log.close()


@dataclass(frozen=True)
class Point:
    segment: str
    step: int
    values: dict[str, Any]
    time: float


@dataclass
class MetricsHistory:
    """What a metrics file says once restarts are accounted for."""

    segments: list[str] = field(default_factory=list)
    restored_steps: dict[str, int] = field(default_factory=dict)
    active: list[Point] = field(default_factory=list)
    superseded: list[Point] = field(default_factory=list)

    def series(self, name: str) -> list[tuple[int, Any]]:
        """``(step, value)`` for ``name`` over the active points, in step order."""
        points = sorted((p for p in self.active if name in p.values), key=lambda p: p.step)
        return [(p.step, p.values[name]) for p in points]


def read_metrics(path: str | os.PathLike[str]) -> MetricsHistory:
    """Read a metrics file (a local path or a URL) and split its points into active and superseded."""
    history = MetricsHistory()
    order: dict[str, int] = {}
    points: list[Point] = []
    for record in read_json_lines(path):
        seg = str(record.get("segment", ""))
        if seg not in order:
            order[seg] = len(order)
            history.segments.append(seg)
        if record.get("kind") == "segment":
            history.restored_steps[seg] = int(record.get("restored_step", 0))
        elif record.get("kind") == "point":
            points.append(Point(seg, int(record["step"]), dict(record.get("values", {})), float(record.get("time", 0))))
    # The lowest step any *later* segment restarted from bounds what a segment's points may keep.
    limit: dict[str, float] = {}
    lowest = float("inf")
    for seg in reversed(history.segments):
        limit[seg] = lowest
        if seg in history.restored_steps:
            lowest = min(lowest, history.restored_steps[seg])
    for p in points:
        (history.active if p.step <= limit[p.segment] else history.superseded).append(p)
    return history
