"""SIGKILL at several instants of a save never yields a loadable half-checkpoint; resume uses the previous one."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.processes import PYTHON, REPO, run

from elastrain.checkpoint import layout
from elastrain.log import parse_event_line

WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
pytestmark = pytest.mark.slow


def restored_step(out: str) -> int | None:
    line = next(line for line in out.splitlines() if line.startswith("RESTORED "))
    info = json.loads(line.split(" ", 1)[1])
    return None if info is None else int(info["step"])


def fallbacks(out: str) -> list[str]:
    parsed = (parse_event_line(line) for line in out.splitlines())
    return [e["bad"] for e in parsed if e is not None and e.get("event") == "checkpoint_fallback"]


def test_sigkill_at_each_instant_of_a_save_resumes_from_the_previous_complete_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    base = [PYTHON, WORKER, f"--dir={ckpt}", "--interval=2", "--keep-last=3", "--steps=10"]
    # (instant, step killed in its save, step restored at the start of that run, complete steps after the kill)
    # A rank killed while writing part of its shard: test_checkpoint_request.py. Killed before
    # writing anything: the same as killed mid-write, minus the partial file.
    chain = [
        ("before_marker", 4, None, [2]),  # all data and .metadata written, no marker
        ("marker_tmp", 6, 2, [2, 4]),  # marker written to its temporary name, not renamed
    ]
    for instant, step, resumed_from, complete in chain:
        proc = run([*base, f"--kill={instant}", f"--kill-step={step}"], timeout=90)
        out = proc.stdout + proc.stderr
        assert proc.returncode == -signal.SIGKILL, out
        assert restored_step(out) == resumed_from, out
        killed = ckpt / layout.step_dir_name(step)
        assert killed.is_dir() and not (killed / layout.MARKER).exists(), instant
        assert [d.step for d in layout.list_step_dirs(str(ckpt)) if d.committed] == complete, out
        found = layout.newest_complete(str(ckpt))
        assert found is not None and found[0].step == complete[-1]

    proc = run(base, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert restored_step(out) == 4
    assert fallbacks(out) == [str(ckpt / layout.step_dir_name(6))]
    assert "DONE 10" in out
    # Retention: the newest three complete checkpoints, and no leftovers of killed saves.
    assert [(d.step, d.committed) for d in layout.list_step_dirs(str(ckpt))] == [(6, True), (8, True), (10, True)]
    for d in layout.list_step_dirs(str(ckpt)):
        layout.verify_step(d.path)
