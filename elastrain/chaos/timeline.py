"""The record of a chaos run: each thing the harness does, stamped with its time, logged as a ``chaos_*`` lifecycle
line and kept in ``OUTPUT_DIR/timeline.json`` (rewritten after every entry, with the run's result at the end)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos.trace import Trace
from elastrain.log import lifecycle

TIMELINE_FILE = "timeline.json"


@dataclass
class ChaosResult:
    succeeded: bool
    timed_out: bool
    elapsed_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    leftover_pids: list[int] = field(default_factory=list)
    """Processes still running when the harness ended and that it had to kill (orphans, hung nodes)."""
    escaped: list[dict[str, Any]] = field(default_factory=list)
    """Processes of this run (by their environment tag) alive after every tree was killed: ``pid``, ``cmdline``."""


class Timeline:
    """The run's clock (seconds since :meth:`start`) and its entries, each written out as it is recorded."""

    def __init__(
        self,
        trace: Trace,
        node_command: Callable[[int], Sequence[str]],
        output_dir: Path,
        progress: Callable[[], int] | None,
    ) -> None:
        self.trace = trace
        self.node_command = node_command
        self.output_dir = output_dir
        self.progress = progress
        self.events: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._wall0 = 0.0

    def start(self) -> None:
        """Set the clock's zero: the run starts now."""
        self._t0, self._wall0 = time.monotonic(), time.time()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def record(self, action: str, node: int | None = None, **fields: Any) -> None:
        entry: dict[str, Any] = {"t": round(self.now(), 3), "wall": round(time.time(), 3), "action": action}
        if node is not None:
            entry["node"] = node
        entry.update(fields)
        self.events.append(entry)
        if self.progress is not None:
            entry["step"] = self.progress()
        lifecycle(
            "chaos_" + action, node=node, **{k: v for k, v in entry.items() if k not in ("pids", "action", "node")}
        )
        self.write(result=None)

    def write(self, result: ChaosResult | None) -> None:
        data: dict[str, Any] = {
            "started_at": self._wall0,
            "nodes": self.trace.nodes,
            "trace": self.trace.to_dict(),
            "commands": [list(self.node_command(i)) for i in range(self.trace.nodes)],
            "events": self.events,
        }
        if result is not None:
            data["result"] = {
                "succeeded": result.succeeded,
                "timed_out": result.timed_out,
                "elapsed_s": round(result.elapsed_s, 3),
                "leftover_pids": result.leftover_pids,
                "escaped": result.escaped,
            }
        tmp = self.output_dir / f".{TIMELINE_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.output_dir / TIMELINE_FILE)
