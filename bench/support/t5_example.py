"""The T5 example as the benches use it: its data built ahead of the timed runs, and what a run left behind.

:func:`prepare_data` runs ``examples/t5/data.py`` as a process (the first run would build the pairs and the
tokenizer otherwise, inside its timings); :func:`load_run` reads a run's ``summary.json`` (written by
``examples/t5/train.py``), its ``metrics.jsonl`` and the chaos harness's ``timeline.json``. Nothing here imports
from examples/ or tests/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos import analysis
from elastrain.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DATA_SCRIPT = REPO / "examples" / "t5" / "data.py"


def prepare_data(data_dir: Path, eval_size: int = 256, timeout_s: float = 600.0) -> None:
    """The pairs and the tokenizer in ``data_dir`` (kept when already there), as train.py's rank 0 would build them."""
    if (data_dir / "tokenizer.json").exists():
        return
    cmd = [sys.executable, str(DATA_SCRIPT), str(data_dir), "--eval-size", str(eval_size)]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=timeout_s)


@dataclass
class T5Run:
    """One run of train.py: its summary, its loss points and the trace events the harness fired."""

    summary: dict[str, Any]
    points: list[tuple[float, int]]  # (time, step) of every loss point, a restart's superseded ones included
    timeline: dict[str, Any] = field(default_factory=dict)

    def fired(self) -> list[dict[str, Any]]:
        return analysis.fired(self.timeline)

    def node_seconds(self) -> float:
        """Each node's time from its start to its exit (a SIGKILL ends it at once), from the chaos timeline."""
        up: dict[int, float] = {}
        spans: list[float] = []
        end = 0.0
        for e in self.timeline.get("events", []):
            end = max(end, float(e["t"]))
            node = e.get("node")
            if e["action"] == "start" and node is not None:
                up[node] = float(e["t"])
            elif e["action"] in ("exit", "kill", "notice_expired") and node in up:
                spans.append(float(e["t"]) - up.pop(node))
        spans.extend(end - started for started in up.values())
        if spans:
            return sum(spans)
        return float(self.summary.get("elapsed_s", 0.0)) * max(self.summary.get("world_sizes") or [1])


def load_run(directory: Path) -> T5Run:
    summary = json.loads((directory / "summary.json").read_text())
    history = read_metrics(directory / "metrics.jsonl")
    points = sorted((p.time, p.step) for p in history.active + history.superseded if "loss" in p.values)
    timeline_path = directory / "chaos" / "timeline.json"
    timeline = json.loads(timeline_path.read_text()) if timeline_path.exists() else {}
    return T5Run(summary, points, timeline)
