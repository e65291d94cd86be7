"""The bench's reading of the Trainer scripts' sample ledger (bench/support/trainer_ledger.py): steps, steps
computed twice, the exactly-once check over the stream, the progress reader. Pure: files in a temp folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.support.trainer_ledger import Ledger, LedgerProgress, check_every_sample_once, longest_stalls


def _row(step: int, ids: list[int], rank: int, world: int, rnd: int, t: float, pid: int) -> dict[str, Any]:
    return {"step": step, "ids": ids, "rank": rank, "world": world, "round": rnd, "pid": pid, "t": t}


def _write(folder: Path, rows: list[dict[str, Any]], partial: str = "") -> None:
    by_pid: dict[int, list[str]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(json.dumps(r))
    for pid, lines in by_pid.items():
        (folder / f"ledger-{pid}.jsonl").write_text("\n".join(lines) + "\n" + partial)


def _stream(samples: int, steps: int, batch: int) -> list[list[int]]:
    """Each step's ids of a stream that wraps epochs without a gap (every sample once per epoch)."""
    order = [(7 * i) % samples for i in range(samples)]
    pos = [order[p % samples] for p in range(steps * batch)]
    return [pos[k * batch : (k + 1) * batch] for k in range(steps)]


def test_a_clean_two_rank_run_has_every_sample_once_and_nothing_redone(tmp_path: Path) -> None:
    rows = []
    for k, ids in enumerate(_stream(10, 6, 4), start=1):
        rows += [_row(k, ids[:2], 0, 2, 1, k, 100), _row(k, ids[2:], 1, 2, 1, k + 0.1, 101)]
    _write(tmp_path, rows, partial='{"step": 7, "ids"')  # a line being written is not read
    ledger = Ledger.read(tmp_path)
    assert ledger.last_step() == 6 and ledger.redone() == []
    check = check_every_sample_once(ledger, 6, 4, 10)
    assert check.ok, check.violations
    assert "2.40 epochs" in check.detail


def test_a_step_computed_again_counts_once_and_the_last_computation_is_kept(tmp_path: Path) -> None:
    steps = _stream(10, 4, 4)
    rows = [_row(k, ids, 0, 1, 1, k, 100) for k, ids in enumerate(steps[:3], start=1)]
    rows.append(_row(4, [0, 0, 0, 0], 0, 1, 1, 4.0, 100))  # a first computation, rolled back...
    rows.append(_row(4, steps[3], 0, 1, 1, 5.0, 100))  # ...and the one kept
    # A whole job started again counts rounds from 1 again: same (round, world), another computation.
    rows.append(_row(3, steps[2], 0, 1, 1, 6.0, 200))
    _write(tmp_path, rows)
    ledger = Ledger.read(tmp_path)
    assert ledger.redone() == [3, 4]
    assert ledger.worlds_lost() == 1  # pid 200's world kept none of pid 100's
    assert check_every_sample_once(ledger, 4, 4, 10).ok


def test_the_check_names_a_sample_used_twice_a_missing_step_and_a_short_step(tmp_path: Path) -> None:
    steps = _stream(10, 5, 4)
    steps[1] = [steps[0][0], *steps[1][1:]]  # step 2 uses step 1's first sample again
    rows = [_row(k, ids, 0, 1, 1, k, 100) for k, ids in enumerate(steps, start=1) if k != 4]
    rows[-1] = {**rows[-1], "ids": rows[-1]["ids"][:3]}
    _write(tmp_path, rows)
    violations = check_every_sample_once(Ledger.read(tmp_path), 5, 4, 10).violations
    assert any("1 steps have no ledger row: [4]" in v for v in violations), violations
    assert any(f"samples used more than once: [{steps[0][0]}]" in v for v in violations), violations
    assert any("step 5: 3 sample ids" in v for v in violations), violations
    assert not check_every_sample_once(Ledger.read(tmp_path), 5, 4, None).ok


def test_progress_reads_only_whole_lines_and_stalls_are_the_longest_gaps(tmp_path: Path) -> None:
    progress = LedgerProgress(tmp_path)
    assert progress() == 0
    _write(tmp_path, [_row(1, [0], 0, 1, 1, 1.0, 100), _row(2, [1], 0, 1, 1, 2.0, 100)], partial='{"step": 9')
    assert progress() == 2
    assert longest_stalls([0.0, 0.5, 4.0, 4.2, 6.5]) == [3.5, 2.3]


def test_a_rank_killed_after_its_all_reduce_counts_from_its_begin_row(tmp_path: Path) -> None:
    """Rank 1 was killed inside step 3 after the gradients' all-reduce: rank 0 ended step 3 in the same world, so
    rank 1's samples were trained. A rank that gave a step up and went on, or a begin in another world, is not."""
    steps = _stream(12, 4, 4)
    m, other = "127.0.0.1:1", "127.0.0.1:2"
    rows: list[dict[str, Any]] = []
    for k in (1, 2, 3):
        for rank, pid in ((0, 100), (1, 101)):
            ids = steps[k - 1][2 * rank : 2 * rank + 2]
            rows.append(_row(k, ids, rank, 2, 0, k, pid) | {"master": m, "phase": "begin"})
            if (k, rank) != (3, 1):
                rows.append(_row(k, ids, rank, 2, 0, k + 0.5, pid) | {"master": m})
    rows += [_row(4, steps[3][:2], 0, 2, 1, 9, 100) | {"master": other}, _row(4, steps[3][2:], 1, 2, 1, 9.1, 102)]
    rows[-1] |= {"master": other}
    _write(tmp_path, rows)
    ledger = Ledger.read(tmp_path)
    assert all(ledger.complete().values()) and ledger.redone() == []
    assert ledger.steps()[3] == sorted(steps[2])
    assert check_every_sample_once(ledger, 4, 4, 12).ok
    progress = LedgerProgress(tmp_path)
    assert progress() == 4

    # The same begin row, but its process went on (it gave step 3 up): step 3 lacks a row.
    _write(tmp_path, [*rows, _row(9, [], 1, 2, 1, 20, 101) | {"master": other, "phase": "begin"}])
    assert not Ledger.read(tmp_path).complete()[3]
    # Its peer ended step 3 in another world (another master): not proof of rank 1's samples.
    moved = [r | {"master": other} if r["step"] == 3 and r["rank"] == 0 and "phase" not in r else r for r in rows]
    for f in tmp_path.glob("ledger-*.jsonl"):
        f.unlink()
    _write(tmp_path, moved)
    assert not Ledger.read(tmp_path).complete()[3]
