"""What a finished run left behind, read back: the figures its checks and reports are made of.

Pure functions over the run's files (no processes, no torch), used by :mod:`elastrain.chaos.checks`,
``bench/soak.py``, ``bench/goodput.py`` and the T5 example's report:

- segments (one start of the workers, or one live world) and their spans, from the events, metrics and
  ledger files (:func:`segments`, :func:`segment_order`, :func:`workers_started`); the workers an agent started
  last (:func:`last_workers_started`);
- the sample ledger and the rows each step keeps once re-run steps are superseded (:func:`read_ledger`,
  :func:`kept_rows`);
- the trace events the harness fired, the rendezvous rounds, the stalls between steps and the completed
  steps computed twice (:func:`fired`, :func:`round_times`, :func:`max_stall`, :func:`stalls`, :func:`redone`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrain.metrics.events import read_events, read_json_lines


@dataclass
class Segment:
    token: str
    start: float
    end: float
    world_size: int | None = None
    pid: int | None = None
    restart_count: int | None = None
    round: int | None = None
    restored_step: int | None = None
    last_step: int | None = None
    start_reason: str | None = None
    generation: int | None = None
    """The fencing generation the world claimed, where its ``start`` record carries one."""
    first_record: float | None = None
    """The time of its first own record; ``start`` may be earlier: when its agent started the workers."""

    def describe(self) -> str:
        tags = [f"ws={self.world_size}", f"pid={self.pid}", f"{self.start_reason}", f"restart={self.restart_count}"]
        if self.round is not None:
            tags.append(f"round={self.round}")
        if self.generation is not None:
            tags.append(f"generation={self.generation}")
        tags.append(f"restored={self.restored_step}")
        return f"{self.token} ({', '.join(tags)}, steps to {self.last_step})"


@dataclass(frozen=True)
class LedgerRow:
    segment: str
    step: int
    epoch: int
    ids: tuple[int, ...]
    time: float | None = None


# -- reading ---------------------------------------------------------------------------------------
def read_ledger(paths: Iterable[str | os.PathLike[str]]) -> list[LedgerRow]:
    """Ledger rows from either format: a metrics-style file of ``point`` records whose values hold
    ``epoch`` and ``ids`` (tests/workers/ledger_job.py), or plain rows ``{segment, step, epoch, ids}``
    (the T5 example's ``--ledger``)."""
    rows = []
    for path in paths:
        for r in read_json_lines(path):
            v = r.get("values") if r.get("kind") == "point" else r
            if not isinstance(v, dict) or "ids" not in v or "segment" not in r or "step" not in r:
                continue
            t = r.get("time")
            rows.append(
                LedgerRow(
                    str(r["segment"]),
                    int(r["step"]),
                    int(v["epoch"]),
                    tuple(int(i) for i in v["ids"]),
                    None if t is None else float(t),
                )
            )
    return rows


def segment_order(metrics_file: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
    """Segments in the order rank 0 opened them, and the step each restored (from the metrics file's headers)."""
    order: list[str] = []
    restored: dict[str, int] = {}
    for r in read_json_lines(metrics_file):
        if r.get("kind") != "segment":
            continue
        seg = str(r.get("segment", ""))
        if seg not in restored:
            order.append(seg)
        restored[seg] = int(r.get("restored_step", 0))
    return order, restored


def workers_started(logs: Iterable[str | os.PathLike[str]]) -> dict[int, float]:
    """Worker PID -> when it entered a world: when its agent started it (the nodes' ``event=workers_started
    pids=A,B t=T`` lines), or, for a worker started warm (``--live``: built before its node joined a round, it
    trains nothing until then), when it was given its first round (its own ``event=worker_warm_joined`` line)."""
    started: dict[int, float] = {}
    joined: dict[int, float] = {}
    for path in logs:
        for line in Path(path).read_text(errors="replace").splitlines():
            warm = "event=worker_warm_joined" in line
            replaced = "event=workers_replaced" in line  # new workers beside running ones: ``new=C``
            if not warm and not replaced and "event=workers_started" not in line:
                continue
            fields = _event_fields(line)
            try:
                t = float(fields["t"])
                if warm:
                    joined[int(fields["pid"])] = t
                    continue
                for pid in fields.get("new" if replaced else "pids", "").split(","):
                    started[int(pid)] = t
            except (KeyError, ValueError):
                continue
    return {pid: max(t, joined.get(pid, t)) for pid, t in started.items()}


def last_workers_started(log: str) -> list[int]:
    """The worker PIDs, by local rank, of the last ``event=workers_started pids=A,B`` line of a node's log text, or
    of its last ``event=workers_replaced`` line (some workers replaced beside the others: all of them); none yet:
    empty."""
    pids: list[int] = []
    for line in log.splitlines():
        started = "event=workers_started" in line or "event=workers_replaced" in line
        if started and (listed := _event_fields(line).get("pids")):
            pids = [int(p) for p in listed.split(",")]
    return pids


def segments(
    events_file: str | os.PathLike[str],
    metrics_file: str | os.PathLike[str] | None = None,
    ledger: Sequence[LedgerRow] = (),
    started: Mapping[int, float] | None = None,
) -> list[Segment]:
    """Every segment with its span, from the start of its first record (or, with ``started`` from
    :func:`workers_started`, from when its agent started its rank-0 worker: the world exists from
    then on) to its last record, sorted by start."""
    spans: dict[str, Segment] = {}
    opened: set[str] = set()  # segments whose start event says what they restored

    def touch(token: str, t: float | None, step: int | None = None) -> None:
        if t is None:
            return
        seg = spans.get(token)
        if seg is None:
            spans[token] = seg = Segment(token, t, t)
        seg.start, seg.end = min(seg.start, t), max(seg.end, t)
        if step is not None:
            seg.last_step = max(seg.last_step or 0, step)

    for e in read_events(events_file):
        if "segment" not in e or "time" not in e:
            continue  # an agent's event, not a world's
        token = str(e["segment"])
        if e["event"] == "stop" and token in spans:
            continue  # a worker that ends without a save does no work then: a frozen member of a world that was
            # superseded meanwhile logs it long after its world's last step (T5 soak, seed 91127)
        touch(token, float(e["time"]), e.get("step") if isinstance(e.get("step"), int) else None)
        if e["event"] == "start":
            opened.add(token)
            seg = spans[token]
            seg.world_size, seg.pid = e.get("world_size"), e.get("pid")
            seg.restart_count, seg.round = e.get("restart_count"), e.get("round")
            seg.restored_step, seg.start_reason = e.get("restored_step"), e.get("start_reason")
            seg.generation = e.get("generation")
    if metrics_file is not None:
        for r in read_json_lines(metrics_file):
            if "segment" in r and "time" in r:
                token = str(r["segment"])
                touch(token, float(r["time"]), r.get("step") if r.get("kind") == "point" else None)
                if r.get("kind") == "segment" and token not in opened:  # a live regroup's world: no start event
                    spans[token].restored_step = r.get("restored_step")
    for row in ledger:
        touch(row.segment, row.time, row.step)
    for seg in spans.values():
        seg.first_record = seg.start
        if started and seg.pid is not None and seg.pid in started:
            seg.start = min(seg.start, started[seg.pid])
    return sorted(spans.values(), key=lambda s: (s.start, s.end))


def kept_rows(rows: Sequence[LedgerRow], order: Sequence[str], restored: Mapping[str, int]) -> list[LedgerRow]:
    """The rows no later segment re-ran: those at or below every later segment's restored step."""
    limit: dict[str, float] = {}
    lowest = float("inf")
    for seg in reversed(order):
        limit[seg] = lowest
        lowest = min(lowest, restored.get(seg, 0))
    return [r for r in rows if r.step <= limit.get(r.segment, float("inf"))]


# -- figures ---------------------------------------------------------------------------------------
def fired(timeline: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trace events the harness fired, in order: ``index``, ``what`` (kill, term, start...), ``node``,
    ``t`` (seconds since the start) and ``wall`` (epoch seconds)."""
    return sorted((e for e in timeline.get("events", []) if e["action"] == "fired"), key=lambda e: int(e["index"]))


def fired_events(timeline: Mapping[str, Any]) -> int:
    """Trace events the harness fired (its ``fired`` records; a kill_all or restart_all counts once)."""
    return sum(1 for e in timeline.get("events", []) if e["action"] == "fired")


def max_stall(
    metrics_file: str | os.PathLike[str], until: float | None = None, more: Iterable[tuple[float, int]] = ()
) -> tuple[float, int | None]:
    """The longest time between two consecutive step records (metrics points of any segment, and
    ``more`` ``(time, step)`` records such as ledger rows), and the step after it (``None``: the stall
    lasted until ``until``, the end of a run that never finished)."""
    points = sorted(
        [(float(r["time"]), int(r["step"])) for r in read_json_lines(metrics_file) if r.get("kind") == "point"]
        + list(more)
    )
    worst, at = 0.0, None
    for (t0, _), (t1, step) in itertools.pairwise(points):
        if t1 - t0 > worst:
            worst, at = t1 - t0, step
    if until is not None and points and until - points[-1][0] > worst:
        worst, at = until - points[-1][0], None
    return worst, at


def round_times(logs: Iterable[str | os.PathLike[str]]) -> list[tuple[float, str]]:
    """Each rendezvous round that completed, as ``(wall time, "round N at MASTER")`` sorted by time,
    from the nodes' ``event=rendezvous_done round=N ... master=ADDR t=T`` lines: every node of a round
    logs the same round and master (the earliest line counts), and a restarted job counts from 0 again."""
    first: dict[tuple[str, str], float] = {}
    for path in logs:
        for line in Path(path).read_text(errors="replace").splitlines():
            if "event=rendezvous_done" not in line:
                continue
            fields = _event_fields(line)
            key = (fields.get("round", "?"), fields.get("master", "?"))
            try:
                t = float(fields["t"])
            except (KeyError, ValueError):
                continue
            first[key] = min(t, first.get(key, t))
    return sorted((t, f"round {r} at {m}") for (r, m), t in first.items())


def rendezvous_rounds(logs: Iterable[str | os.PathLike[str]]) -> int:
    return len(round_times(logs))


def stalls(times: Sequence[float], events: Sequence[float]) -> list[float | None]:
    """Per event: the longest gap between consecutive step times that belongs to it. A gap belongs
    to the first event fired inside it, or else to the last event fired before it began (a stall
    that starts later, such as a joiner's regroup); ``None``: no step after the event."""
    out: list[float | None] = [None] * len(events)
    for a, b in itertools.pairwise(sorted(times)):
        inside = [i for i, at in enumerate(events) if a < at < b]
        before = [i for i, at in enumerate(events) if at <= a]
        owner = inside[0] if inside else (before[-1] if before else None)
        if owner is not None:
            out[owner] = max(out[owner] or 0.0, b - a)
    return out


def redone(points: Sequence[tuple[float, int]], events: Sequence[float]) -> list[int]:
    """Completed steps logged again: ``[total, for event 1, for event 2, ...]``. A repeat counts for
    the first event after the step's first computation: the change that threw it away."""
    counts = [0] * (1 + len(events))
    first: dict[int, float] = {}
    for t, step in sorted(points):
        if step not in first:
            first[step] = t
            continue
        counts[0] += 1
        cause = next((i for i, at in enumerate(events) if at > first[step]), None)
        if cause is not None:
            counts[1 + cause] += 1
    return counts


def _event_fields(line: str) -> dict[str, str]:
    """The ``key=value`` fields of a log line from its ``event=`` on."""
    return dict(p.split("=", 1) for p in line[line.index("event=") :].split() if "=" in p)
