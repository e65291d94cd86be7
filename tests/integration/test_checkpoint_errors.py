"""A checkpoint root that becomes unwritable mid-run stops a multi-process run with a message naming the path.

The root is replaced by a file while training saves every step in the background: the next save (or
the one in flight) fails, and the run ends with a CheckpointSaveError, not with a log line nobody
reads. With ``on_save_error="warn"`` the Session run goes on and logs every failure.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, reaped, spawn, wait_for

from elastrain.log import parse_event_line

CHECKPOINT_WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
SESSION_WORKER = str(REPO / "tests" / "workers" / "session_worker.py")
pytestmark = pytest.mark.slow

SAVE_ERROR = re.compile(r"CheckpointSaveError: checkpoint of step (\d+) in (\S+) failed: (.+)")


def steps(text: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^STEP (\d+)\b", text, re.M)]


def events(text: str, name: str) -> list[dict[str, str]]:
    parsed = (parse_event_line(line) for line in text.splitlines())
    return [e for e in parsed if e is not None and e.get("event") == name]


def break_root_mid_run(ckpt: Path, log: Path, *worker_args: str) -> str:
    """Start a 2-process run, let it commit a few saves, replace its checkpoint root with a file; its output."""
    agent = spawn(elastrain_cmd("--nproc-per-node=2", f"--checkpoint-dir={ckpt}", *worker_args), log)
    with reaped(agent):
        wait_for(lambda: len(events(log.read_text(), "checkpoint_committed")) >= 3, timeout=180, what="3 commits")
        os.rename(ckpt, ckpt.with_name("moved-away"))  # in-flight writes go on in the moved directory
        ckpt.write_text("not a directory any more\n")
        agent.wait(timeout=180)
    out = log.read_text()
    assert agent.returncode != 0, out
    return out


@pytest.mark.parametrize("worker", ["checkpointer", "session"])
def test_an_unwritable_root_stops_the_run_naming_the_path_and_cause(tmp_path: Path, worker: str) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    if worker == "checkpointer":
        out = break_root_mid_run(ckpt, log, CHECKPOINT_WORKER, "--steps=100000", "--interval=1", "--sleep=0.05")
    else:
        out = break_root_mid_run(ckpt, log, SESSION_WORKER, "--save-every=1")
    found = SAVE_ERROR.search(out)
    assert found is not None, out
    assert found.group(2).startswith(f"{ckpt}/step-"), found.group(0)
    assert re.search(r"NotADirectory|FileExists|No such file|Not a directory", found.group(3)), found.group(0)
    assert events(out, "checkpoint_save_failed"), out  # the event line stays
    assert "DONE" not in out
    # Every rank agreed the save failed: no live worker waited for a regroup that never comes.
    assert not events(out, "regroup_notice_missing"), out


def test_with_on_save_error_warn_the_session_goes_on_and_logs_every_failure(tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    cmd = elastrain_cmd("--nproc-per-node=2", f"--checkpoint-dir={ckpt}", SESSION_WORKER, "--on-save-error=warn")
    # Metrics and events live elsewhere here: only the checkpoints break.
    agent = spawn([*cmd, "--max-steps=80", "--save-every=2", f"--metrics-dir={tmp_path / 'metrics'}"], log)
    with reaped(agent):
        wait_for(lambda: len(events(log.read_text(), "checkpoint_committed")) >= 2, timeout=180, what="2 commits")
        broken_at = max(steps(log.read_text()), default=0)
        os.rename(ckpt, ckpt.with_name("moved-away"))
        ckpt.write_text("not a directory any more\n")
        agent.wait(timeout=180)
    out = log.read_text()
    assert agent.returncode == 0, out
    assert "DONE 80" in out and max(steps(out)) == 80 > broken_at
    failed = events(out, "checkpoint_save_failed")
    assert len(failed) >= 2 and all(f["on_save_error"] == "warn" for f in failed), out
    assert str(ckpt) in failed[-1]["error"]
