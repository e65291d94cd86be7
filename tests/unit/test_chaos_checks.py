"""The soak's checks on synthetic run output: each violation is found and named, a clean run passes."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from elastrain.chaos.analysis import (
    LedgerRow,
    Segment,
    last_workers_started,
    max_stall,
    read_ledger,
    rendezvous_rounds,
    round_times,
    segment_order,
    segments,
    workers_started,
)
from elastrain.chaos.checks import (
    Check,
    Expectation,
    check_bounded_rounds,
    check_checkpoints,
    check_exactly_once,
    check_final_state,
    check_one_world,
    check_processes,
    check_trace_ran,
    format_table,
    refounded,
)
from elastrain.checkpoint import layout
from elastrain.metrics.events import append_json_line

# 10 samples, batch 4: each epoch is steps of 4, 4 and a tail of 2.
EXPECT = Expectation(max_steps=6, samples=10, global_batch=4)


def ids_of(step: int) -> list[int]:
    k = (step - 1) % 3
    return list(range(4 * k, min(4 * k + 4, 10)))


def test_expected_step_sizes_follow_the_epochs():
    assert EXPECT.step_sizes() == [(0, 4), (0, 4), (0, 2), (1, 4), (1, 4), (1, 2)]
    assert [EXPECT.samples_after(s) for s in range(7)] == [0, 4, 8, 10, 14, 18, 20]


@dataclass
class Seg:
    token: str
    restored: int
    steps: range
    t0: float
    world_size: int = 2
    finish: bool = False
    ids: dict[int, list[int]] | None = None


def write_run(d: Path, segs: list[Seg], ledger_format: str = "points") -> tuple[Path, Path, list[Path]]:
    """events.jsonl, metrics.jsonl and ledger files as the session and the ledger jobs write them."""
    events, metrics = d / "events.jsonl", d / "metrics.jsonl"
    ledgers = [d / "ledger.jsonl"] if ledger_format == "points" else [d / f"ledger-rank{r}.jsonl" for r in range(2)]
    for s in segs:
        t = s.t0
        append_json_line(events, {"time": t, "event": "start", "pid": 100, "segment": s.token,
                                  "world_size": s.world_size, "restart_count": 0, "start_reason": "first_start",
                                  "restored_step": s.restored or None})  # fmt: skip
        append_json_line(metrics, {"kind": "segment", "segment": s.token, "restored_step": s.restored, "time": t})
        for step in s.steps:
            t += 1.0
            ids = (s.ids or {}).get(step, ids_of(step))
            epoch = (step - 1) // 3
            halves = [ids[: len(ids) // 2], ids[len(ids) // 2 :]]
            for rank, part in enumerate(halves):
                if ledger_format == "points":
                    row = {"kind": "point", "segment": s.token, "step": step, "time": t,
                           "values": {"rank": rank, "epoch": epoch, "ids": part}}  # fmt: skip
                    append_json_line(ledgers[0], row)
                else:
                    append_json_line(ledgers[rank], {"segment": s.token, "step": step, "epoch": epoch, "ids": part})
            append_json_line(metrics, {"kind": "point", "segment": s.token, "step": step, "time": t, "values": {}})
        if s.finish:
            last = s.steps[-1] if s.steps else s.restored
            append_json_line(events, {"time": t + 0.5, "event": "finish", "pid": 100, "segment": s.token,
                                      "step": last, "samples_seen": EXPECT.samples_after(last)})  # fmt: skip
    return events, metrics, ledgers


def run_checks(d: Path, segs: list[Seg], ledger_format: str = "points") -> dict[str, Check]:
    events, metrics, ledgers = write_run(d, segs, ledger_format)
    order, restored = segment_order(metrics)
    rows = read_ledger(ledgers)
    return {
        "final": check_final_state(events, EXPECT),
        "once": check_exactly_once(rows, order, restored, EXPECT),
        "world": check_one_world(segments(events, metrics, rows)),
    }


CLEAN = [Seg("a", 0, range(1, 5), 0.0), Seg("b", 2, range(3, 7), 10.0, finish=True)]


@pytest.mark.parametrize("ledger_format", ["points", "rows"])
def test_a_clean_restarted_run_passes(tmp_path, ledger_format):
    checks = run_checks(tmp_path, CLEAN, ledger_format)
    assert all(c.ok for c in checks.values()), {k: c.violations for k, c in checks.items()}
    assert checks["final"].detail == "step 6/6, samples_seen 20/20"
    assert "2 re-run steps superseded" in checks["once"].detail  # a's steps 3 and 4


@pytest.mark.parametrize(
    ("segs", "check", "violation"),
    [
        # b restored step 2 but ran step 3 on step 2's samples: samples 4..7 twice, 8..9 never.
        (
            [CLEAN[0], Seg("b", 2, range(3, 7), 10.0, finish=True, ids={3: ids_of(2)})],
            "once",
            "epoch 0: sample 4 used 2 times (steps [2, 3])",
        ),
        ([CLEAN[0], Seg("b", 2, range(3, 7), 10.0, finish=True, ids={3: ids_of(2)})], "once", "2 samples never used"),
        ([CLEAN[0], Seg("b", 2, range(3, 7), 10.0, finish=True, ids={4: [0, 1]})], "once", "step 4: 2 sample ids"),
        # b restored step 5, which a never reached: step 5 is lost.
        ([Seg("a", 0, range(1, 5), 0.0), Seg("b", 5, range(6, 7), 10.0, finish=True)], "once", "step 5: no ledger row"),
        ([Seg("a", 0, range(1, 3), 0.0)], "once", "steps 3-6: no ledger row kept"),
        ([Seg("a", 0, range(1, 8), 0.0, finish=True)], "once", "step 7: trained past max_steps=6"),
        ([Seg("a", 0, range(1, 6), 0.0, finish=True)], "final", "step 5 (want 6), samples_seen 18 (want 20)"),
        ([Seg("a", 0, range(1, 6), 0.0)], "final", "no 'finish' record"),
        # Two worlds: b starts while a still trains, both finish.
        (
            [Seg("a", 0, range(1, 7), 0.0, finish=True), Seg("b", 2, range(3, 7), 3.0, finish=True)],
            "world",
            "segments overlap for 3.500s: a (ws=2, pid=100, first_start, restart=0, restored=None, steps to 6) "
            "spans 0.000-6.500",
        ),
        (
            [Seg("a", 0, range(1, 7), 0.0, finish=True), Seg("b", 2, range(3, 6), 3.0, finish=True)],
            "final",
            "finish by segment b (pid 100): step 5 (want 6)",
        ),
    ],
)
def test_violations_are_found_and_named(tmp_path, segs, check, violation):
    checks = run_checks(tmp_path, segs)
    assert not checks[check].ok
    assert any(violation in v for v in checks[check].violations), checks[check].violations


def test_a_job_started_again_after_its_end_finishes_again(tmp_path):
    segs = [Seg("a", 0, range(1, 7), 0.0, finish=True), Seg("b", 6, range(7, 7), 10.0, finish=True)]
    checks = run_checks(tmp_path, segs)
    assert all(c.ok for c in checks.values()), {k: c.violations for k, c in checks.items()}
    assert checks["final"].detail == "step 6/6, samples_seen 20/20 (2 finish records)"


def test_step_kept_from_two_segments_and_unknown_segments(tmp_path):
    rows = [LedgerRow("a", 1, 0, (0, 1, 2, 3)), LedgerRow("b", 1, 0, (0, 1, 2, 3)), LedgerRow("x", 2, 0, (4,))]
    expect = Expectation(max_steps=1, samples=10, global_batch=4)
    # b restored step 1 (so a's step 1 stays kept) yet ran step 1 again.
    check = check_exactly_once(rows, ["a", "b"], {"a": 0, "b": 1}, expect)
    assert any("step 1: kept from 2 segments (a, b)" in v for v in check.violations), check.violations
    assert any("segments no metrics header opened: x" in v for v in check.violations)


def test_segments_that_touch_do_not_overlap():
    a, b = Segment("a", 0.0, 5.0), Segment("b", 5.0, 9.0)
    assert check_one_world([a, b]).ok
    assert not check_one_world([a, Segment("b", 4.999, 9.0)]).ok


def test_agent_events_without_a_segment_are_not_worlds(tmp_path):
    events = tmp_path / "events.jsonl"
    append_json_line(events, {"time": 1.0, "event": "membership_change", "pid": 5})
    append_json_line(events, {"time": 2.0, "event": "start", "pid": 6, "segment": "s", "world_size": 1, "round": 4})
    (seg,) = segments(events)
    assert (seg.token, seg.start, seg.end, seg.round) == ("s", 2.0, 2.0, 4)


def test_a_stop_logged_late_by_a_superseded_worker_is_not_training(tmp_path):
    """A member frozen right after its world's last step thaws after the survivor trained on in a world of its own,
    waits for a notice that never comes, and logs ``stop`` (an exit without a save) long after: its world's span
    ends at its last step; a step it made then would still be an overlap."""
    events, metrics = tmp_path / "events.jsonl", tmp_path / "metrics.jsonl"
    append_json_line(events, {"time": 0.0, "event": "start", "pid": 1, "segment": "old", "world_size": 2})
    append_json_line(metrics, {"kind": "point", "segment": "old", "step": 68, "time": 1.0, "values": {}})
    append_json_line(metrics, {"kind": "point", "segment": "new", "step": 69, "time": 2.0, "values": {}})
    append_json_line(events, {"time": 70.0, "event": "stop", "pid": 1, "segment": "old", "step": 68})
    spans = segments(events, metrics)
    assert check_one_world(spans).ok and [s.end for s in spans] == [1.0, 2.0]
    append_json_line(metrics, {"kind": "point", "segment": "old", "step": 69, "time": 3.0, "values": {}})
    assert not check_one_world(segments(events, metrics)).ok


def test_a_step_recorded_late_by_a_member_frozen_after_its_all_reduce_is_not_training(tmp_path):
    """Rank 0 of the old world is frozen after step 268's all-reduce and before its metrics point; the survivor
    regroups alone and starts from step 268 (T5 soak, seed 63719). The thawed member writes step 268's point after
    the new world began: no second world, since the new one started from that step. Its step 269 would be one."""
    events, metrics = tmp_path / "events.jsonl", tmp_path / "metrics.jsonl"
    append_json_line(events, {"time": 0.0, "event": "start", "pid": 1, "segment": "old", "world_size": 2})
    append_json_line(metrics, {"kind": "point", "segment": "old", "step": 267, "time": 1.0, "values": {}})
    append_json_line(metrics, {"kind": "segment", "segment": "new", "restored_step": 268, "time": 2.0})
    append_json_line(metrics, {"kind": "point", "segment": "old", "step": 268, "time": 2.3, "values": {}})
    append_json_line(metrics, {"kind": "point", "segment": "new", "step": 269, "time": 2.4, "values": {}})
    spans = segments(events, metrics)
    assert [s.restored_step for s in spans] == [None, 268]
    assert check_one_world(spans).ok, check_one_world(spans).violations
    append_json_line(metrics, {"kind": "point", "segment": "old", "step": 269, "time": 2.5, "values": {}})
    assert not check_one_world(segments(events, metrics)).ok


# -- checkpoints -------------------------------------------------------------------------------------
def make_step(
    root: Path, step: int, world_size: int = 2, state_step: int | None = None, commit: bool = True, generation=None
) -> Path:
    path = root / layout.step_dir_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={})))
    (path / "__0_0.distcp").write_bytes(b"x" * 64)
    for r in range(world_size):
        train_state = {"step": step if state_step is None else state_step, "samples_seen": EXPECT.samples_after(step)}
        (path / f"elastrain-rank-{r:05d}.json").write_text(
            json.dumps({"step": step, "state": {"train_state": train_state}})
        )
    if commit:
        files = layout.manifest(str(path))
        extra = {} if generation is None else {"generation": generation}
        marker = layout.CommitMarker(step=step, world_size=world_size, files=files, extra=extra)
        layout.write_commit_marker(str(path), marker)
    return path


def test_committed_checkpoints_verify(tmp_path):
    make_step(tmp_path, 2)
    make_step(tmp_path, 4)
    make_step(tmp_path, 6, commit=False)  # in flight when the job was killed: not a violation
    check = check_checkpoints(str(tmp_path), EXPECT)
    assert check.ok, check.violations
    assert check.detail == "2 committed, 1 uncommitted (in flight when killed)"


@pytest.mark.parametrize(
    ("damage", "violation"),
    [
        (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * 10), "has 10 bytes, the marker says 64"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"y" * 64), "fails its CRC-32"),
        (lambda p: (p / "elastrain-rank-00001.json").unlink(), "elastrain-rank-00001.json is missing"),
    ],
)
def test_damaged_checkpoints_are_named(tmp_path, damage, violation):
    damage(make_step(tmp_path, 4))
    check = check_checkpoints(str(tmp_path), EXPECT)
    assert any(violation in v for v in check.violations), check.violations


def test_checkpoint_with_the_wrong_train_state(tmp_path):
    make_step(tmp_path, 4, state_step=3)
    check = check_checkpoints(str(tmp_path), EXPECT)
    assert any("marker step 4, train state step 3" in v for v in check.violations), check.violations
    assert not check_checkpoints(str(tmp_path / "none"), EXPECT).ok


def test_a_checkpoint_committed_by_an_older_generation(tmp_path):
    make_step(tmp_path, 2, generation=3)
    make_step(tmp_path, 4, generation=2)  # a stale world committed after a newer one
    make_step(tmp_path, 6, generation=4)
    check = check_checkpoints(str(tmp_path), EXPECT)
    assert check.violations == ["step 4 was committed by generation 2, after step 2 by generation 3"]


def test_world_generations_must_grow():
    a, b = Segment("a", 0.0, 5.0, generation=2), Segment("b", 6.0, 9.0, generation=2)
    (v,) = check_one_world([a, b]).violations
    assert v.startswith("generation did not grow: b (") and "generation=2" in v
    assert check_one_world([a, Segment("b", 6.0, 9.0, generation=3)]).ok


# -- processes, trace, figures -------------------------------------------------------------------------
def test_processes_and_trace_from_the_timeline():
    timeline = {
        "events": [
            {"t": 0.0, "action": "start", "node": 0},
            {"t": 1.0, "action": "fired", "index": 0},
            {"t": 1.0, "action": "kill", "node": 1},
            {"t": 2.0, "action": "exit", "node": 2, "returncode": 1, "expected": False},
            {"t": 3.0, "action": "reap_workers", "node": 2, "pids": [77]},
            {"t": 4.0, "action": "exit", "node": 0, "returncode": 0, "expected": False},
            {"t": 9.0, "action": "cleanup", "node": 1, "pids": [88]},
            {"t": 9.5, "action": "drain_timeout", "node": 3, "pids": [89]},
        ],
        "result": {"timed_out": False, "elapsed_s": 9.0, "escaped": [{"pid": 99, "cmdline": "python train.py"}]},
    }
    procs = check_processes(timeline)
    assert procs.violations == [
        "node 2: its agent exited (exit 1), leaving PIDs [77] alive",
        "node 1: PIDs [88] still running at the end",
        "PID 99 escaped every node's process tree: python train.py",
    ]
    timeline["result"]["timed_out"] = True  # a run cut short: nodes killed at the end were working, not orphans
    assert "node 1: PIDs [88] still running at the end" not in check_processes(timeline).violations
    ran = check_trace_ran(timeline, planned=2)
    assert ran.violations == [
        "only 1 of 2 trace events fired before the end",
        "node 2 exited 1 at t=2.0s unasked",
        "node 3 still running long after the job finished (killed)",
    ]
    timeline["events"] = [e for e in timeline["events"] if e["action"] != "exit" or e["node"] != 0]
    assert "no node finished the job" in check_trace_ran(timeline, planned=1).violations[0]


def test_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    for t, step in [(1.0, 1), (2.0, 2), (9.5, 2), (10.0, 3)]:
        append_json_line(metrics, {"kind": "point", "segment": "s", "step": step, "time": t, "values": {}})
    assert max_stall(metrics) == (7.5, 2)
    assert max_stall(metrics, until=30.0) == (20.0, None)
    log = tmp_path / "node-0.log"
    log.write_text(
        "x elastrain event=rendezvous_done round=1 nodes=2 master=h:1 t=1.0\nnoise\n"
        "y elastrain event=rendezvous_done round=1 nodes=2 master=h:1 t=1.1\n"
        "z elastrain event=rendezvous_done round=2 nodes=1 master=h:2 t=5.0\n"
        "w elastrain event=rendezvous_done round=1 nodes=1 master=h:3 t=9.0\n"  # the job started again
    )
    assert rendezvous_rounds([log]) == 3
    table = format_table([Check("alpha", [], "ok"), Check("b", ["bad thing"], "1 problem")])
    assert table.splitlines() == ["alpha  PASS  ok", "b      FAIL  1 problem", "         - bad thing"]


def test_workers_dying_after_the_harness_sigkill_are_not_orphans():
    timeline = {
        "events": [
            {"t": 1.0, "action": "kill", "node": 0, "pids": [10, 11]},
            {"t": 1.2, "action": "exit", "node": 0, "returncode": -9, "expected": True},
            {"t": 1.2, "action": "reap_workers", "node": 0, "pids": [11]},
            {"t": 2.0, "action": "start", "node": 0},
            {"t": 3.0, "action": "term", "node": 0},
            {"t": 4.0, "action": "exit", "node": 0, "returncode": 0, "expected": True},
            {"t": 4.0, "action": "reap_workers", "node": 0, "pids": [12]},
        ]
    }
    assert check_processes(timeline).violations == ["node 0: its agent exited (exit 0), leaving PIDs [12] alive"]


def test_a_world_exists_from_when_its_agent_started_its_workers(tmp_path):
    """A second world whose workers are still importing when the first one trains is caught too."""
    log = tmp_path / "node-2.log"
    log.write_text("x elastrain event=workers_started round=0 reason=first_start pids=300,301 t=5.5 pid=299\n")
    events = tmp_path / "events.jsonl"
    append_json_line(events, {"time": 1.0, "event": "start", "pid": 200, "segment": "a", "world_size": 1})
    append_json_line(events, {"time": 7.0, "event": "finish", "pid": 200, "segment": "a", "step": 9})
    append_json_line(events, {"time": 9.0, "event": "start", "pid": 300, "segment": "b", "world_size": 1})
    started = workers_started([log])
    assert started == {300: 5.5, 301: 5.5}
    assert check_one_world(segments(events)).ok
    spans = segments(events, started=started)
    assert (spans[1].start, spans[1].first_record) == (5.5, 9.0)
    assert "segments overlap for 1.500s" in check_one_world(spans).violations[0]


@pytest.mark.parametrize(
    ("log", "pids"),
    [
        ("", []),
        ("x elastrain event=workers_warming workers=2 t=5.5 pid=399\n", []),
        ("x elastrain event=workers_started round=0 pids=400,401 t=5.5 pid=399\n", [400, 401]),
        (
            "elastrain event=workers_started pids=400,401 t=5.5 pid=399\n"
            "elastrain event=workers_restarting cause=worker_failure t=6.0 pid=399\n"
            "elastrain event=workers_started round=1 reason=failure pids=402,403 t=6.5 pid=399\n",
            [402, 403],
        ),
        (
            "elastrain event=workers_started pids=400,401 t=5.5 pid=399\n"
            "elastrain event=workers_replaced round=1 local_ranks=0 new=402 pids=402,401 t=6.5 pid=399\n",
            [402, 401],
        ),
    ],
)
def test_the_workers_an_agent_started_last(log, pids):
    assert last_workers_started(log) == pids


def test_a_replaced_worker_enters_its_world_when_it_is_started_and_the_others_keep_theirs(tmp_path):
    """A worker that failed alone is replaced beside the others (``workers_replaced``): only the new one starts."""
    log = tmp_path / "node-0.log"
    log.write_text(
        "x elastrain event=workers_started round=0 pids=400,401 t=5.5 pid=399\n"
        "x elastrain event=workers_replaced round=1 local_ranks=1 new=402 pids=400,402 t=9.0 pid=399\n"
    )
    assert workers_started([log]) == {400: 5.5, 401: 5.5, 402: 9.0}


def test_a_warm_worker_enters_its_world_when_it_is_given_a_round(tmp_path):
    """--live: a node's workers start before it joins a round; they train nothing until their first round."""
    log = tmp_path / "node-3.log"
    log.write_text(
        "x elastrain event=workers_started pids=400 t=5.5 pid=399\n"
        "x elastrain event=workers_warming workers=1 up_to_s=600.000 t=5.5 pid=399\n"
        "x elastrain event=worker_warm_joined round=1 waited_s=3.4 t=8.9 pid=400\n"
        "x elastrain event=workers_started pids=401 t=6.0 pid=398\n"
    )
    assert workers_started([log]) == {400: 8.9, 401: 6.0}
    events = tmp_path / "events.jsonl"
    append_json_line(events, {"time": 1.0, "event": "start", "pid": 200, "segment": "a", "world_size": 1})
    append_json_line(events, {"time": 7.0, "event": "preemption", "pid": 200, "segment": "a", "step": 9})
    append_json_line(events, {"time": 9.0, "event": "start", "pid": 400, "segment": "b", "world_size": 1})
    assert check_one_world(segments(events, started=workers_started([log]))).ok


def test_only_the_first_world_and_those_after_a_whole_job_kill_found_the_job():
    def seg(token, start, reason):
        return Segment(token, start, start + 5.0, start_reason=reason, first_record=start + 1.0)

    timeline = {"started_at": 100.0, "events": [{"t": 30.0, "action": "fired", "what": "kill_all"}]}
    spans = [seg("a", 101.0, "first_start"), seg("b", 110.0, "scale_down"), seg("c", 135.0, "first_start")]
    assert refounded(spans, timeline) == []
    spans.append(seg("d", 150.0, "first_start"))  # a node back at the original endpoint founded it again
    (v,) = refounded(spans, timeline)
    assert v.startswith("d (") and "founded the job again at t=50.0s; the last world before it, c (" in v
    assert "ran at t=35.0-40.0s" in v


def test_stalled_timed_out_and_interrupted_runs_are_violations():
    timeline = {
        "events": [
            {"t": 0.0, "action": "fired", "index": 0},
            {"t": 5.0, "action": "exit", "node": 0, "returncode": 0, "expected": False},
            {"t": 200.0, "action": "stalled", "stalled_s": 180.0, "at_step": 21},
            {"t": 300.0, "action": "timeout", "timeout_s": 300, "step": 21},
            {"t": 301.0, "action": "interrupted"},
        ],
        "result": {"timed_out": True, "elapsed_s": 301.0},
    }
    assert check_trace_ran(timeline, planned=1).violations == [
        "stalled: no step past 21 for 180.0s (ended at t=200.0s)",
        "timed out after 300s at step 21",
        "interrupted at t=301.0s",
    ]


def test_progress_counts_checkpoints_and_restores_as_well_as_points(tmp_path):
    from elastrain.chaos.progress import MetricsProgress

    events = tmp_path / "events.jsonl"
    progress = MetricsProgress(events)
    assert progress() == 0
    append_json_line(events, {"event": "start", "segment": "a", "restored_step": 7})
    assert progress() == 7
    append_json_line(events, {"event": "checkpoint", "segment": "a", "step": 9})
    append_json_line(events, {"kind": "point", "segment": "a", "step": 8})
    append_json_line(events, {"event": "finish", "segment": "a", "step": 99})  # not a step's own record
    assert progress() == 9


def _round_log(path: Path, rounds: list[tuple[int, str, float]]) -> None:
    path.write_text(
        "".join(f"x elastrain event=rendezvous_done round={r} master={m} t={t} pid=1\n" for r, m, t in rounds)
    )


STORM_TIMELINE = {
    "started_at": 100.0,
    "events": [
        {"t": 0.0, "action": "start", "node": 0},
        {"t": 1.0, "action": "start", "node": 1},
        {"t": 10.0, "action": "fired", "what": "start", "node": 2},  # a spare
        {"t": 10.0, "action": "start", "node": 2},
        {"t": 30.0, "action": "fired", "what": "kill_all"},
        {"t": 32.0, "action": "fired", "what": "restart_all"},
        {"t": 32.0, "action": "restart_all", "nodes": [0, 1]},
    ],
}


def test_rounds_within_one_per_event_pass(tmp_path):
    log = tmp_path / "node-0.log"
    # Both first nodes in one round, the spare joins nobody, the restarted job's two nodes arrive apart.
    _round_log(log, [(0, "h:1", 102.0), (0, "h:1", 102.1), (0, "h:9", 133.0), (1, "h:10", 135.0)])
    rounds = round_times([log])
    assert [name for _, name in rounds] == ["round 0 at h:1", "round 0 at h:9", "round 1 at h:10"]
    check = check_bounded_rounds(STORM_TIMELINE, rounds)
    assert check.ok, check.violations
    assert check.detail == "3 rounds for 3 events and 2 starting nodes"


def test_a_restart_storm_is_a_violation(tmp_path):
    log = tmp_path / "node-0.log"
    _round_log(log, [(0, "h:1", 102.0), *[(k, f"h:{k + 1}", 111.0 + k) for k in range(1, 6)]])
    check = check_bounded_rounds(STORM_TIMELINE, round_times([log]))
    assert check.violations == [
        "6 rounds by t=16.0s (round 5 at h:6), at most 3 for the events so far: 3 surplus (restart storm) "
        "since the last event, start at t=10.0s"
    ]
