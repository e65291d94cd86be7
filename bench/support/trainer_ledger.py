"""Read the sample ledger that Trainer scripts write under ``LEDGER_DIR`` (bench/support/hf/ledger.py).

The writer is imported by the scripts themselves (examples/hf/*.py import ``ledger`` when ``LEDGER_DIR`` is set;
put ``bench/support/hf`` on their ``PYTHONPATH``); it writes one row per rank per optimizer step: the step, the
ids of the step's micro-batches, the rank, the world size and the round, and a begin row at each step's start (the
rows of a rank killed inside a step its world ended are taken from those). :class:`Ledger` reads those rows from
outside the script; :func:`check_every_sample_once` is the soak's exactly-once check over them, and
:class:`LedgerProgress` the harness's progress reader. Pure reading of files: no torch, no transformers.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrain.chaos.checks import Check

WRITER_DIR = Path(__file__).resolve().parent / "hf"
"""The folder to put on a script's ``PYTHONPATH`` so that its ``import ledger`` finds the writer."""
PACE_FILE = "pace"
"""``LEDGER_DIR/pace`` holds the seconds each step sleeps after its row (absent: none)."""


def ledger_env(folder: Path, pythonpath: str = "") -> dict[str, str]:
    """The environment variables that make a Trainer script write its ledger to ``folder``."""
    parts = [str(WRITER_DIR), *([pythonpath] if pythonpath else [])]
    return {"LEDGER_DIR": str(folder), "PYTHONPATH": os.pathsep.join(parts)}


@dataclass
class Ledger:
    """Every rank's row per step: which samples, in which world."""

    rows: list[dict[str, Any]]

    @classmethod
    def read(cls, folder: Path) -> Ledger:
        rows = []
        for path in sorted(folder.glob("ledger-*.jsonl")):
            text = path.read_text()
            complete = text[: text.rfind("\n") + 1]  # a line being written now is read next time
            rows.extend(json.loads(line) for line in complete.splitlines() if line.strip())
        ended = [r for r in rows if r.get("phase") != "begin"]
        return cls(ended + _killed_after_their_all_reduce(ended, [r for r in rows if r.get("phase") == "begin"]))

    def _worlds(self) -> dict[int, list[list[dict[str, Any]]]]:
        """Per step, its computations, oldest first: the rows of one world (round, world size), split again where
        a rank wrote the step twice in it (a whole job started again can count its rounds from the start)."""
        by_step: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for row in self.rows:
            by_step[row["step"]][(row["round"], row["world"])].append(row)
        out: dict[int, list[list[dict[str, Any]]]] = {}
        for step, groups in by_step.items():
            runs: list[list[dict[str, Any]]] = []
            for rows in groups.values():
                per_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
                for r in sorted(rows, key=lambda r: r["t"]):
                    per_rank[r["rank"]].append(r)
                for k in range(max(len(v) for v in per_rank.values())):
                    runs.append([v[k] for v in per_rank.values() if len(v) > k])
            out[step] = sorted(runs, key=lambda g: max(r["t"] for r in g))
        return out

    def last_step(self) -> int:
        return max((r["step"] for r in self.rows), default=0)

    def world_now(self) -> int:
        return max(self.rows, key=lambda r: r["t"])["world"] if self.rows else 0

    def round_now(self) -> int:
        """The round (``ELASTRAIN_ROUND``) of the newest step: a restart or a regroup starts another."""
        return max(self.rows, key=lambda r: r["t"])["round"] if self.rows else -1

    def steps(self) -> dict[int, list[int]]:
        """Each step's samples, as trained by the last world that computed it (all its ranks)."""
        return {s: sorted(i for r in w[-1] for i in r["ids"]) for s, w in self._worlds().items()}

    def ordered_steps(self) -> dict[int, list[int]]:
        """Each step's samples in stream order (rank by rank), as trained by the last world that computed it."""
        return {
            s: [i for r in sorted(w[-1], key=lambda r: r["rank"]) for i in r["ids"]] for s, w in self._worlds().items()
        }

    def complete(self) -> dict[int, bool]:
        """Whether every rank of the step's last world wrote its row."""
        return {s: len({r["rank"] for r in w[-1]}) == w[-1][0]["world"] for s, w in self._worlds().items()}

    def redone(self) -> list[int]:
        """Steps that more than one world completed (computed again after a rollback or a restart)."""
        return sorted(s for s, worlds in self._worlds().items() if len(worlds) > 1)

    def world_change_steps(self) -> list[int]:
        """The first step of every world after the first (where the world, its round or size, changed)."""
        last = [(w[-1][0]["round"], w[-1][0]["world"]) for _, w in sorted(self._worlds().items())]
        return [i + 1 for i in range(1, len(last)) if last[i] != last[i - 1]]

    def world_sizes(self) -> list[int]:
        """The world size of each step's last world, in step order."""
        return [w[-1][0]["world"] for _, w in sorted(self._worlds().items())]

    def step_ends(self) -> list[tuple[float, int]]:
        """``(time, step)`` of each computation of a step (its last rank's row), by time: the job's training clock."""
        return sorted((max(r["t"] for r in g), s) for s, worlds in self._worlds().items() for g in worlds)

    def worlds_lost(self) -> int:
        """How many times a world took over with none of the previous world's processes: everything in memory was
        lost (every member killed, a whole-job kill), and the job went on from its newest committed checkpoint."""
        pids = [{r["pid"] for r in g} for worlds in self._worlds().values() for g in worlds]
        ends = [max(r["t"] for r in g) for worlds in self._worlds().values() for g in worlds]
        ordered = [p for _, p in sorted(zip(ends, pids, strict=True), key=lambda x: x[0])]
        return sum(1 for a, b in itertools.pairwise(ordered) if not a & b)

    def step_times(self) -> list[float]:
        return [t for t, _ in self.step_ends()]


def _killed_after_their_all_reduce(ended: list[dict[str, Any]], begun: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The end rows of ranks killed inside a step that their world ended: a begin row that is its process's last
    row, of a step that another rank of the same world (round, size, master) ended after it. A DDP step ends only
    once its gradients' all-reduce is done, and every rank of the world feeds that: the killed rank's samples were
    trained. (A rank that gave the step up and went on wrote later rows: not counted.)"""
    last_t: dict[int, float] = {}
    for r in ended + begun:
        last_t[r["pid"]] = max(last_t.get(r["pid"], r["t"]), r["t"])
    done = {(r["pid"], r["step"]) for r in ended}
    ends: dict[tuple[int, int, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in ended:
        ends[(r["step"], r["round"], r["world"], r.get("master", ""))].append(r)
    out = []
    for b in begun:
        peers = ends.get((b["step"], b["round"], b["world"], b.get("master", "")), [])
        if (b["pid"], b["step"]) in done or b["t"] < last_t[b["pid"]]:
            continue
        if any(p["t"] >= b["t"] and p["rank"] != b["rank"] for p in peers):
            out.append({k: v for k, v in b.items() if k != "phase"} | {"inferred": True})
    return out


def longest_stalls(times: list[float], count: int = 3, least_s: float = 1.0) -> list[float]:
    """The ``count`` longest gaps between consecutive step completions, those of at least ``least_s`` seconds."""
    gaps = sorted((b - a for a, b in itertools.pairwise(sorted(times))), reverse=True)
    return [round(g, 1) for g in gaps[:count] if g >= least_s]


def check_every_sample_once(ledger: Ledger, max_steps: int, global_batch: int, samples: int | None) -> Check:
    """Steps 1..max_steps each kept from a complete world with one full global batch, and the stream they make
    (epochs follow each other without a gap: elastrain/integrations/trainer/stream.py) holds every sample once per
    epoch of ``samples`` positions."""
    check = Check("every sample once per epoch")
    v = check.violations
    if samples is None or samples < 1:
        v.append("the dataset size is unknown: the script wrote no train_samples (train_results.json)")
        return check
    steps, complete = ledger.ordered_steps(), ledger.complete()
    missing = [s for s in range(1, max_steps + 1) if s not in steps]
    if missing:
        v.append(f"{len(missing)} steps have no ledger row: {missing[:10]}")
    v.extend(f"step {s}: trained past max_steps={max_steps}" for s in sorted(steps) if s > max_steps)
    stream: list[int] = []
    for s in range(1, max_steps + 1):
        ids = steps.get(s, [])
        if s in steps and not complete[s]:
            v.append(f"step {s}: a rank of its last world wrote no row")
        if s in steps and len(ids) != global_batch:
            v.append(f"step {s}: {len(ids)} sample ids, the global batch is {global_batch}")
        stream.extend(ids if len(ids) == global_batch else [-1] * global_batch)
    for epoch, start in enumerate(range(0, len(stream), samples)):
        seen = [i for i in stream[start : start + samples] if i >= 0]
        twice = sorted(i for i, n in Counter(seen).items() if n > 1)
        if twice:
            v.append(f"epoch {epoch}: samples used more than once: {twice[:10]}")
        if start + samples <= len(stream) and len(set(seen)) != samples:
            v.append(f"epoch {epoch}: {samples - len(set(seen))} samples never used")
    check.violations = v[:20] + ([f"... and {len(v) - 20} more"] if len(v) > 20 else [])
    check.detail = f"{len(stream)} positions over {samples} samples ({len(stream) / samples:.2f} epochs)"
    return check


class LedgerProgress:
    """The highest step any rank wrote to the ledger in ``folder``: the chaos harness's progress reader."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self.step = 0

    def __call__(self) -> int:
        for path in self.folder.glob("ledger-*.jsonl"):
            with open(path, "rb") as fh:
                fh.seek(self._offsets.get(path, 0))
                chunk = fh.read()
            end = chunk.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in chunk[:end].splitlines():
                try:
                    row = json.loads(line)
                    if row.get("phase") != "begin":
                        self.step = max(self.step, int(row["step"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
        return self.step
