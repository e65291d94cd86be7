"""Without ``--checkpoint-dir`` the workers fence the root they write into: at most one world of a job commits.

The issue's scenario on one machine: world A runs (its c10d store on one port, no ``--checkpoint-dir``, so the
launcher fences nothing: ``event=fencing_off``). World B is the same job founded again at another endpoint, as
newcomers at the original endpoint do after the store's host died and the survivor moved it: it starts at
round 0 and writes into the same folder. B claims the root before it restores (from A's newest checkpoint);
A's next save finds the newer claim, and A stops with one line (``event=world_superseded``): its workers exit
with EX_CONFIG, so its agent ends the node instead of restarting workers that would claim the root back. No
marker of A's is written after B's claim, and B trains to the end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, free_port, reaped, spawn, wait_for, wait_logged

from elastrain import fence
from elastrain.checkpoint import layout
from elastrain.errors import EX_CONFIG
from elastrain.log import parse_event_line

CHECKPOINT_WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
SESSION_WORKER = str(REPO / "tests" / "workers" / "session_worker.py")
pytestmark = pytest.mark.slow


def events(log: Path, name: str) -> list[dict[str, str]]:
    parsed = (parse_event_line(line) for line in log.read_text(errors="replace").splitlines())
    return [e for e in parsed if e is not None and e.get("event") == name]


def world(port: int, worker: str, root: Path, steps: int) -> list[str]:
    """One node of the job ``job`` at ``127.0.0.1:port``, its worker writing checkpoints into ``root``."""
    if worker == "checkpointer":
        script = [CHECKPOINT_WORKER, f"--dir={root}", f"--steps={steps}", "--interval=2", "--sleep=0.1"]
    else:
        script = [SESSION_WORKER, f"--checkpoint-dir={root}", f"--max-steps={steps}", "--save-every=2", "--sleep=0.1"]
    return elastrain_cmd(
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=job",
        "--local-addr=127.0.0.1",
        "--max-restarts=3",
        "--rdzv-conf=last_call_timeout=1",
        *script,
    )


def committed(root: Path) -> list[int]:
    return [d.step for d in layout.list_step_dirs(str(root)) if d.committed]


@pytest.mark.parametrize("worker", ["checkpointer", "session"])
def test_a_job_founded_again_supersedes_the_old_world_which_stops_and_never_commits_again(
    tmp_path: Path, worker: str
) -> None:
    root, log_a, log_b = tmp_path / "checkpoints", tmp_path / "a.log", tmp_path / "b.log"
    a = spawn(world(free_port(), worker, root, 100000), log_a)
    with reaped(a):
        wait_for(lambda: len(committed(root)) >= 2, timeout=120, what=f"world A's first commits: {log_a}")
        assert events(log_a, "fencing_off"), log_a.read_text()
        b = spawn(world(free_port(), worker, root, max(committed(root)) + 300), log_b)
        with reaped(b):
            codes = wait_logged([(a, log_a), (b, log_b)], timeout=150)
    text_a, text_b = log_a.read_text(), log_b.read_text()
    assert codes[1] == 0, text_b
    assert codes[0] != 0, text_a  # A stopped: it did not train on, nor finish

    # A: one line saying why, its workers exited with EX_CONFIG, and its node ended (no restart).
    superseded = events(log_a, "world_superseded")
    assert len(superseded) == 1, text_a
    assert "superseded by generation 1" in superseded[0]["why"] and "round 0" in superseded[0]["why"], superseded
    assert [e["exit_codes"] for e in events(log_a, "worker_config_error")] == [str(EX_CONFIG)], text_a
    assert len(events(log_a, "workers_started")) == 1, text_a

    # The fence: A holds generation 0, B generation 1 (claimed by B's workers, before B restored).
    claims = fence.claim_times(str(root))
    assert sorted(claims) == [0, 1], claims
    b_claimed_at = claims[1]
    assert b_claimed_at is not None
    by_b = [e for e in events(log_b, "generation_claimed") if e.get("by") == "workers"]
    assert [e["generation"] for e in by_b] == ["1"], text_b
    restored = [e for e in events(log_b, "checkpoint_restored") if e.get("step") not in (None, "None")]
    assert restored, text_b
    restored_step = int(restored[0]["step"])

    # No marker of A's was written after B's claim, and every step B saved is B's.
    for d in layout.list_step_dirs(str(root)):
        if not d.committed:
            continue
        marker = layout.read_commit_marker(d.path)
        written_at = (Path(d.path) / layout.MARKER).stat().st_mtime
        if marker.generation == 0:
            assert written_at <= b_claimed_at and d.step <= restored_step, (d, text_a)
        else:
            assert marker.generation == 1 and d.step > restored_step, d
    a_commits = [int(e["step"]) for e in events(log_a, "checkpoint_committed")]
    assert max(a_commits) <= restored_step, (a_commits, restored_step)
    assert re.search(rf"^DONE {max(committed(root))}\b", text_b, re.M), text_b
