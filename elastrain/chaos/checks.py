"""Checks of a finished chaos run, Jepsen-style: read what the run left behind, report every violation.

Pure functions over files (no processes, no torch except to read a checkpoint's DCP metadata):

- :func:`check_final_state`: the job ended at ``max_steps`` with the exact ``samples_seen``, once.
- :func:`check_exactly_once`: the sample ledger uses every sample id exactly once per epoch.
- :func:`check_one_world`: training segments in the events, metrics and ledger files never overlap in time.
- :func:`check_checkpoints`: every committed checkpoint verifies and holds the step its folder names.
- :func:`check_processes`: no process outlived its node (from the harness's ``timeline.json``).
- :func:`check_trace_ran`: the job finished, every trace event fired, no node failed on its own.
- :func:`check_bounded_rounds`: at most one rendezvous round per membership event (no restart storm).

A *segment* is one start of the workers: the records that carry one ``segment`` token (rank 0's
``start`` event, its metrics points, every rank's ledger rows). Its span runs from its ``start``
event (or its first record) to its last record of any kind. Only one world may train at a time, so
two spans may touch but never overlap: a world that starts while another still writes is a second
job. The ledger is read like the metrics: when a later segment restored step ``R``, an earlier
segment's rows after ``R`` were re-run and are superseded; every step must then be kept from exactly
one segment. Reading the run's files into segments, ledger rows and figures is :mod:`elastrain.chaos.analysis`'s.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos.analysis import LedgerRow, Segment, fired_events, kept_rows
from elastrain.metrics.events import read_events

MAX_LISTED = 20
"""Violations listed per check; the rest are counted."""


@dataclass(frozen=True)
class Expectation:
    """What an uninterrupted run ends with: the soak's job settings."""

    max_steps: int
    samples: int
    """Dataset size (samples per epoch)."""
    global_batch: int

    def step_sizes(self) -> list[tuple[int, int]]:
        """``(epoch, samples)`` of steps 1..max_steps: each epoch is full global batches and, with
        ``epoch_end='partial'``, a short step for its tail. (The session skips a tail smaller than
        the world size: give the soak a tail of 0 or at least MAX samples.)"""
        epoch_steps = [self.global_batch] * (self.samples // self.global_batch)
        if self.samples % self.global_batch:
            epoch_steps.append(self.samples % self.global_batch)
        return [(i // len(epoch_steps), epoch_steps[i % len(epoch_steps)]) for i in range(self.max_steps)]

    def samples_after(self, step: int) -> int:
        return sum(n for _, n in self.step_sizes()[:step])


@dataclass
class Check:
    name: str
    violations: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations


# -- checks ----------------------------------------------------------------------------------------
def _listed(violations: list[str]) -> list[str]:
    if len(violations) <= MAX_LISTED:
        return violations
    return [*violations[:MAX_LISTED], f"... and {len(violations) - MAX_LISTED} more"]


def check_final_state(events_file: str | os.PathLike[str], expect: Expectation) -> Check:
    """Every ``finish`` record at ``max_steps`` with the samples an uninterrupted run sees (a job started
    again after its end finishes again at once; :func:`check_one_world` catches two finishing together)."""
    check = Check("final step and samples_seen")
    want = expect.samples_after(expect.max_steps)
    finishes = read_events(events_file, "finish")
    if not finishes:
        check.violations.append("no 'finish' record: the job never ended its training loop")
        return check
    for f in finishes:
        step, seen = f.get("step"), f.get("samples_seen")
        if step != expect.max_steps or seen != want:
            check.violations.append(
                f"finish by segment {f.get('segment')} (pid {f.get('pid')}): step {step} (want {expect.max_steps}), "
                f"samples_seen {seen} (want {want})"
            )
    last = finishes[-1]
    check.detail = f"step {last.get('step')}/{expect.max_steps}, samples_seen {last.get('samples_seen')}/{want}"
    if len(finishes) > 1:
        # A whole-job restart after the end restores the final step and finishes again; two at once overlap.
        check.detail += f" ({len(finishes)} finish records)"
    return check


def check_exactly_once(
    rows: Sequence[LedgerRow], order: Sequence[str], restored: Mapping[str, int], expect: Expectation
) -> Check:
    """Every step 1..max_steps kept from one segment with the full step's ids; per epoch, each sample
    id once, and every id of each finished epoch."""
    check = Check("every sample once per epoch")
    v = check.violations
    known = set(order)
    unknown = sorted({r.segment for r in rows} - known)
    if unknown:
        v.append(f"ledger rows of segments no metrics header opened: {', '.join(unknown)}")
    kept = kept_rows([r for r in rows if r.segment in known], order, restored)
    by_step: dict[int, list[LedgerRow]] = defaultdict(list)
    for r in kept:
        by_step[r.step].append(r)
    sizes = expect.step_sizes()
    by_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    where: dict[tuple[int, int], list[int]] = defaultdict(list)
    lost: list[int] = []
    for step in range(1, expect.max_steps + 1):
        epoch, size = sizes[step - 1]
        got = by_step.pop(step, [])
        if not got:
            lost.append(step)
            continue
        segs = sorted({r.segment for r in got}, key=order.index)
        if len(segs) > 1:
            v.append(f"step {step}: kept from {len(segs)} segments ({', '.join(segs)}): two worlds ran it")
        ids = [i for r in got for i in r.ids]
        if len(ids) != size:
            v.append(f"step {step}: {len(ids)} sample ids in the ledger, the step has {size}")
        if {r.epoch for r in got} != {epoch}:
            v.append(f"step {step}: epoch {sorted({r.epoch for r in got})}, want {epoch}")
        for r in got:
            by_epoch[r.epoch].update(r.ids)
            for i in r.ids:
                where[(r.epoch, i)].append(step)
    v.extend(f"{_steps(r)}: no ledger row kept (never trained, or no segment's record survived)" for r in _runs(lost))
    for step in sorted(by_step):
        v.append(f"step {step}: trained past max_steps={expect.max_steps}")
    # Every epoch before the last one trained must be whole (lost steps of a cut-short run are listed above).
    last_epoch = max(by_epoch, default=0)
    for epoch in sorted(by_epoch):
        counts = by_epoch[epoch]
        for i in sorted(i for i, c in counts.items() if c > 1):
            v.append(f"epoch {epoch}: sample {i} used {counts[i]} times (steps {where[(epoch, i)]})")
        if epoch < last_epoch:
            missing = sorted(set(range(expect.samples)) - set(counts))
            if missing:
                v.append(f"epoch {epoch}: {len(missing)} samples never used: {missing[:10]}")
    check.violations = _listed(v)
    superseded = len({(r.segment, r.step) for r in rows}) - len({(r.segment, r.step) for r in kept})
    check.detail = (
        f"{sum(sum(c.values()) for c in by_epoch.values())} ids in {len(by_epoch)} epochs; "
        f"{superseded} re-run steps superseded"
    )
    return check


def _runs(steps: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted steps as ``(first, last)`` runs of consecutive numbers."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _steps(run: tuple[int, int]) -> str:
    return f"step {run[0]}" if run[0] == run[1] else f"steps {run[0]}-{run[1]}"


def check_one_world(spans: Sequence[Segment], t0: float | None = None) -> Check:
    """No two segments' spans overlap (they may touch), and where ``start`` records carry a fencing
    ``generation``, each world's is above the one before. Times print in seconds after ``t0`` (default:
    the first segment's start)."""
    check = Check("one world at a time")
    base = t0 if t0 is not None else (spans[0].start if spans else 0.0)
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if b.start >= a.end:
                break  # sorted by start: no later segment overlaps a either
            if _written_late(a, b):
                continue
            overlap = min(a.end, b.end) - b.start
            check.violations.append(
                f"segments overlap for {overlap:.3f}s: {a.describe()} spans {a.start - base:.3f}-{a.end - base:.3f}, "
                f"{b.describe()} spans {b.start - base:.3f}-{b.end - base:.3f}"
            )
    fenced = [seg for seg in spans if seg.generation is not None]
    for a, b in itertools.pairwise(fenced):
        if b.generation is not None and a.generation is not None and b.generation <= a.generation:
            check.violations.append(
                f"generation did not grow: {b.describe()} started after {a.describe()} (stale or split world)"
            )
    check.violations = _listed(check.violations)
    check.detail = f"{len(spans)} segments"
    return check


def _written_late(a: Segment, b: Segment) -> bool:
    """Whether what ``a`` recorded after ``b`` began is no training: ``b`` started from a step at or after ``a``'s last,
    so ``a`` had trained that step before (a member frozen between the step's all-reduce and its record writes it
    when it thaws, after the survivors regrouped without it). A step of ``a`` beyond it would be a second world."""
    return b.restored_step is not None and a.last_step is not None and a.last_step <= b.restored_step


def refounded(spans: Sequence[Segment], timeline: Mapping[str, Any]) -> list[str]:
    """Worlds that founded the job anew (``start_reason=first_start``) other than the first and the
    first after each whole-job kill: a node that did not find the running job (at the original
    endpoint, after the store host died) started its own. Not a violation by itself: when every
    member of the job had died, the waiting node restarting it from its checkpoint is what a whole-job
    restart does; two worlds of one run id training at once are :func:`check_one_world`'s violation."""
    t0 = float(timeline.get("started_at", 0.0))
    kills = [t0 + float(e["t"]) for e in timeline.get("events", []) if e.get("what") == "kill_all"]
    ordered = sorted(spans, key=lambda s: s.first_record if s.first_record is not None else s.start)
    out = []
    for i, seg in enumerate(ordered):
        if seg.start_reason != "first_start":
            continue
        since = max((k for k in kills if k <= seg.start), default=float("-inf"))
        earlier = [o for o in ordered[:i] if o.start >= since]
        if earlier:
            out.append(
                f"{seg.describe()} founded the job again at t={seg.start - t0:.1f}s; the last world before it, "
                f"{earlier[-1].describe()}, ran at t={earlier[-1].start - t0:.1f}-{earlier[-1].end - t0:.1f}s"
            )
    return out


def _marker_generation(marker: Any) -> int | None:
    """The fencing generation a commit marker carries (its own field; ``extra`` in older drafts)."""
    g = getattr(marker, "generation", None)
    if g is None:
        g = getattr(marker, "extra", {}).get("generation")
    return g if isinstance(g, int) else None


def check_checkpoints(root: str, expect: Expectation | None = None) -> Check:
    """Every committed step directory verifies against its marker (lengths, CRC-32), its DCP metadata
    names only files that exist, every rank's sidecar is there, and the train state inside is the
    step the folder names (with that step's ``samples_seen``). Where markers carry a fencing
    ``generation``, a later step never has an older one."""
    from elastrain.checkpoint import layout
    from elastrain.checkpoint.dcp_io import metadata_problems, read_metadata
    from elastrain.errors import CheckpointCorruptError
    from elastrain.storage import storage_for

    check = Check("committed checkpoints load")
    st = storage_for(root)
    dirs = layout.list_step_dirs(root, st) if os.path.isdir(root) else []
    committed = [d for d in dirs if d.committed]
    markers = []
    for d in committed:
        try:
            marker = layout.verify_step(d.path, checksum=True, storage=st)
            problems = metadata_problems(d.path, read_metadata(d.path, st), st)
            if problems:
                check.violations.append(f"{d.path}: " + "; ".join(problems))
                continue
            sidecars = [
                json.loads(Path(d.path, f"elastrain-rank-{r:05d}.json").read_text()) for r in range(marker.world_size)
            ]
        except (CheckpointCorruptError, OSError, ValueError) as e:
            check.violations.append(f"{d.path}: {type(e).__name__}: {e}")
            continue
        markers.append(marker)
        state = sidecars[0].get("state", {}).get("train_state", {})
        if marker.step != d.step or state.get("step") != d.step:
            check.violations.append(f"{d.path}: marker step {marker.step}, train state step {state.get('step')}")
        if expect is not None and state.get("samples_seen") != expect.samples_after(d.step):
            check.violations.append(
                f"{d.path}: samples_seen {state.get('samples_seen')}, want {expect.samples_after(d.step)}"
            )
    fenced = [(m.step, g) for m in markers if isinstance(g := _marker_generation(m), int)]
    for (s0, g0), (s1, g1) in itertools.pairwise(fenced):
        if g1 < g0:
            check.violations.append(f"step {s1} was committed by generation {g1}, after step {s0} by generation {g0}")
    check.detail = f"{len(committed)} committed, {len(dirs) - len(committed)} uncommitted (in flight when killed)"
    if not committed:
        check.violations.append(f"no committed checkpoint in {root}")
    return check


_SIGKILLS = ("kill", "notice_expired", "drain_timeout")


def check_processes(timeline: Mapping[str, Any]) -> Check:
    """No worker outlived its agent, nothing ran on after a finished run, nothing escaped the process trees."""
    check = Check("no orphan processes")
    # A run cut short (timeout, stall, Ctrl-C) kills nodes that were still working: not orphans.
    cut_short = (timeline.get("result") or {}).get("timed_out", False)
    last: dict[Any, str] = {}
    for e in timeline.get("events", []):
        if e["action"] in ("start", "term", *_SIGKILLS):
            last[e.get("node")] = e["action"]
        elif e["action"] == "exit" and last.get(e.get("node")) not in _SIGKILLS:
            last[e.get("node")] = f"exit {e.get('returncode')}"
        if e["action"] == "reap_workers" and last.get(e.get("node")) not in _SIGKILLS:
            # After a SIGKILL of the whole tree a worker may take a moment to die; otherwise the agent left it.
            how = last.get(e.get("node"), "?")
            check.violations.append(
                f"node {e.get('node')}: its agent exited ({how}), leaving PIDs {e.get('pids')} alive"
            )
        elif e["action"] == "cleanup" and not cut_short:
            check.violations.append(f"node {e.get('node')}: PIDs {e.get('pids')} still running at the end")
    for p in (timeline.get("result") or {}).get("escaped", []):
        check.violations.append(f"PID {p['pid']} escaped every node's process tree: {p['cmdline']}")
    starts = sum(1 for e in timeline.get("events", []) if e["action"] == "start")
    check.detail = f"{starts} node starts tracked"
    return check


def check_trace_ran(timeline: Mapping[str, Any], planned: int) -> Check:
    """The job finished in time, after every planned event fired, and no node exited badly unasked."""
    check = Check("job finished, trace ran")
    result = timeline.get("result") or {}
    events = timeline.get("events", [])
    for e in events:
        if e["action"] == "stalled":
            check.violations.append(
                f"stalled: no step past {e.get('at_step')} for {e.get('stalled_s')}s (ended at t={e['t']}s)"
            )
        elif e["action"] == "timeout":
            check.violations.append(f"timed out after {e.get('timeout_s')}s at step {e.get('step')}")
        elif e["action"] == "interrupted":
            check.violations.append(f"interrupted at t={e['t']}s")
    if not any(e["action"] == "exit" and e.get("returncode") == 0 and not e.get("expected") for e in events):
        check.violations.append("no node finished the job (exit 0 without being signalled)")
    fired = fired_events(timeline)
    if fired < planned:
        check.violations.append(f"only {fired} of {planned} trace events fired before the end")
    for e in events:
        if e["action"] == "exit" and e.get("returncode") != 0 and not e.get("expected"):
            check.violations.append(f"node {e.get('node')} exited {e.get('returncode')} at t={e['t']}s unasked")
        if e["action"] == "drain_timeout":
            check.violations.append(f"node {e.get('node')} still running long after the job finished (killed)")
        if e["action"] == "skip":
            check.violations.append(f"node {e.get('node')}: {e.get('reason')} (event at t={e['t']}s skipped)")
    check.detail = f"{fired}/{planned} events fired in {result.get('elapsed_s')}s"
    return check


def check_bounded_rounds(timeline: Mapping[str, Any], rounds: Sequence[tuple[float, str]]) -> Check:
    """At most one rendezvous round per membership event: at every round, the rounds so far are at most
    the nodes started at the beginning, plus one per trace event fired so far (``len(nodes)`` for a
    ``restart_all``, whose nodes may arrive apart). Cumulative, so a round that completes after the next
    event fired is not blamed on it; only surplus rounds (a restart storm) are."""
    check = Check("bounded rounds")
    t0 = float(timeline.get("started_at", 0.0))
    events = timeline.get("events", [])
    allowance: list[tuple[float, int, str]] = []
    initial = 0
    for e in events:
        if e["action"] == "fired":
            break
        initial += e["action"] == "start"
    total = initial
    for e in events:
        if e["action"] == "fired":
            total += 1
        elif e["action"] == "restart_all":
            total += max(0, len(e.get("nodes", [])) - 1)
        else:
            continue
        allowance.append((t0 + float(e["t"]), total, f"{e.get('what', e['action'])} at t={e['t']}s"))
    worst = None
    for k, (t, name) in enumerate(rounds, start=1):
        allowed, last_event = initial, "the first start"
        for at, n, what in allowance:
            if at > t:
                break
            allowed, last_event = n, what
        if k > allowed and (worst is None or k - allowed > worst[0]):
            worst = (k - allowed, k, allowed, t - t0, name, last_event)
    if worst is not None:
        surplus, k, allowed, t, name, last_event = worst
        check.violations.append(
            f"{k} rounds by t={t:.1f}s ({name}), at most {allowed} for the events so far: {surplus} surplus "
            f"(restart storm) since the last event, {last_event}"
        )
    fired = sum(1 for e in events if e["action"] == "fired")
    check.detail = f"{len(rounds)} rounds for {fired} events and {initial} starting nodes"
    return check


def format_table(checks: Sequence[Check]) -> str:
    """``check  PASS|FAIL  detail`` lines, each violation indented under its check."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.name:<{width}}  {'PASS' if c.ok else 'FAIL'}  {c.detail}")
        lines.extend(f"{'':<{width}}    - {v}" for v in c.violations)
    return "\n".join(lines)
