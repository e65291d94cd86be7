"""Through the real elastrain-run: however a leave's steps fail, the agent leaves (exit 0, the leave's code)
within a bound instead of hanging; and an agent removes its own control directory, and only its own, however
it ends (its workers' success or failure, a leave on SIGTERM); one a SIGKILLed agent left, the next agent removes.

The leave comes from SIGTERM (its steps run on the main thread, in the signal handler) or from a preemption
notice (on the watcher's thread, while the main loop waits for it: the path that hung for good on main).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support.fake_metadata import azure_preempt_event, fake_metadata_server
from support.processes import elastrain_cmd, reaped, spawn, wait_for, wait_logged

from elastrain.log import parse_event_line

pytestmark = pytest.mark.slow

# A worker that does not use elastrain's checkpoints: it never answers a save request. It says READY and its
# control directory, optionally removes that directory first (the leave's save request then fails with an
# OSError), and then runs until it is stopped (bounded) or ends as told.
WORKER = r"""
import os, shutil, sys, time

how = sys.argv[1]
control = os.environ["ELASTRAIN_CONTROL_DIR"]
if how == "remove_control_dir":
    shutil.rmtree(control)
print(f"READY control={control}", flush=True)
if how == "exit0":
    sys.exit(0)
if how == "exit1":
    sys.exit(1)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(2)
"""

LEAVE_BOUND_S = 90.0  # the leave's deadline (30 s notice, 3 s save timeout) plus a start-up, generously


def _events(log: Path, name: str) -> list[dict[str, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        ev = parse_event_line(line)
        if ev is not None and ev.get("event") == name:
            out.append(ev)
    return out


def _ready(log: Path) -> bool:
    """The worker runs, and the agent took SIGTERM back from torch (it logs workers_started after that)."""
    return "READY control=" in log.read_text(errors="replace") and bool(_events(log, "workers_started"))


def _agent(tmp_path: Path, how: str, *flags: str) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = tmp_path / "agent.log"
    cmd = elastrain_cmd("--standalone", "--nproc-per-node", "1", *flags, str(script), how)
    return spawn(cmd, log, env={"TMPDIR": str(tmp_path / "tmp")}, cwd=tmp_path), log


def _leave(proc: subprocess.Popen[bytes], log: Path, trigger: str, endpoint_state: object | None) -> None:
    wait_for(lambda: _ready(log), 120, what="the worker to start")
    if trigger == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        endpoint_state.azure_events = [azure_preempt_event(time.time() + 30)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("trigger", ["notice", "sigterm"])
@pytest.mark.parametrize("failure", ["save_request_fails", "save_never_answers"])
def test_a_leave_whose_checkpoint_fails_still_leaves_within_its_bound(
    tmp_path: Path, trigger: str, failure: str
) -> None:
    (tmp_path / "tmp").mkdir()
    how = "remove_control_dir" if failure == "save_request_fails" else "run"
    with fake_metadata_server() as meta:
        flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-timeout", "3"]
        if trigger == "notice":
            flags += ["--preemption-watchers", "azure", "--metadata-endpoint", meta.endpoint]
        proc, log = _agent(tmp_path, how, *flags)
        with reaped(proc):
            _leave(proc, log, trigger, meta.state)
            left_at = time.monotonic()
            assert wait_logged([(proc, log)], LEAVE_BOUND_S) == [0]  # a leave's exit code, not a hang or an error
            took = time.monotonic() - left_at
    text = log.read_text(errors="replace")
    assert _events(log, "leave_requested") and _events(log, "agent_left"), text
    if failure == "save_request_fails":
        (failed,) = _events(log, "checkpoint_request_failed")
        assert "FileNotFoundError" in failed["error"], text
        assert not _events(log, "checkpoint_requested"), text
    else:
        (timeout,) = _events(log, "checkpoint_timeout")
        assert float(timeout["waited_s"]) == 3.0, text
    assert "Traceback" not in text, text
    print(f"\n{trigger}/{failure}: the agent exited {took:.1f} s after the leave began")


@pytest.mark.parametrize("how", ["exit0", "exit1", "sigterm"])
def test_the_agent_removes_its_own_control_directory_and_no_other(tmp_path: Path, how: str) -> None:
    tmp = tmp_path / "tmp"
    foreign = tmp / "elastrain-control-of-another-agent"
    foreign.mkdir(parents=True)
    (foreign / "save-request.json").write_text("{}")
    proc, log = _agent(tmp_path, "run" if how == "sigterm" else how, "--max-restarts", "0")
    with reaped(proc):
        wait_for(lambda: _ready(log), 120, what="the worker to start")
        own = Path(log.read_text(errors="replace").split("READY control=", 1)[1].split()[0])
        assert own.parent == tmp, own
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        (code,) = wait_logged([(proc, log)], 120)
    assert code == (1 if how == "exit1" else 0), log.read_text(errors="replace")
    assert not own.exists(), log.read_text(errors="replace")
    assert sorted(p.name for p in tmp.glob("elastrain-control-*")) == [foreign.name]
    assert (foreign / "save-request.json").read_text() == "{}"


def test_a_control_directory_a_killed_agent_left_is_swept_by_the_next_agent(tmp_path: Path) -> None:
    """SIGKILL runs no code: the agent's directory stays behind, naming its owner. The next agent on the machine
    removes it as it starts, and leaves alone a live agent's (this test process stands for one), one whose owner
    is not recorded (an older elastrain) and one recorded in another PID namespace (a container sharing /tmp)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    me, ns = psutil.Process(), os.stat("/proc/self/ns/pid").st_ino
    kept = {
        "live": {"pid": me.pid, "started": me.create_time(), "pid_namespace": ns},
        "unowned": None,
        "elsewhere": {"pid": 4_194_321, "started": 1.0, "pid_namespace": ns + 1},
    }
    for name, owner in kept.items():
        (tmp / f"elastrain-control-{name}").mkdir()
        if owner is not None:
            (tmp / f"elastrain-control-{name}" / "agent.json").write_text(json.dumps(owner))
    proc, log = _agent(tmp_path, "run")
    with reaped(proc):
        wait_for(lambda: _ready(log), 120, what="the worker to start")
        left = Path(log.read_text(errors="replace").split("READY control=", 1)[1].split()[0])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert (left / "agent.json").exists(), log.read_text(errors="replace")  # SIGKILL: nothing removed it
    log.rename(tmp_path / "killed.log")
    proc, log = _agent(tmp_path, "exit0", "--max-restarts", "0")
    with reaped(proc):
        (code,) = wait_logged([(proc, log)], 120)
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert not left.exists(), text
    assert sorted(p.name for p in tmp.glob("elastrain-control-*")) == sorted(f"elastrain-control-{n}" for n in kept)
    (swept,) = _events(log, "control_dirs_swept")
    assert swept["count"] == "1", text
