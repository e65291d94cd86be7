"""A worker's first SIGTERM waits for its agent's leave (elastrain.control.worker_sigterm), on a real process.

The process below installs the deferral as a worker started by elastrain-run does, with this test standing in for
its agent (``ELASTRAIN_AGENT_PID``, ``ELASTRAIN_CONTROL_DIR``). The whole-node case, through elastrain-run, is in
tests/e2e/test_live_ledger.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.processes import events_in, worker_env

from elastrain import env as env_vars
from elastrain.control import ControlChannel, SaveCause
from elastrain.control.stopping import mark_stopping
from elastrain.control.worker_sigterm import GRACE_S

WORKER = """
import os, sys, time
from elastrain.control.worker_sigterm import install
from elastrain.log import configure
configure()
install(os.environ)
print("READY", flush=True)
while True:
    time.sleep(0.02)
"""


@contextmanager
def worker(tmp_path: Path, agent_pid: int) -> Iterator[subprocess.Popen[str]]:
    (tmp_path / "control").mkdir(exist_ok=True)  # the agent's control directory
    env = worker_env({env_vars.AGENT_PID: str(agent_pid), env_vars.CONTROL_DIR: str(tmp_path / "control")})
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def output(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read()


def test_a_sigterm_with_no_leave_from_the_agent_ends_the_worker_as_the_signal_would(tmp_path: Path) -> None:
    with worker(tmp_path, os.getpid()) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        text = output(proc)
    assert events_in(text, "worker_sigterm_deferred") and events_in(text, "worker_sigterm"), text


def test_a_sigterm_the_agent_makes_a_leave_of_waits_for_the_agent(tmp_path: Path) -> None:
    with worker(tmp_path, os.getpid()) as proc:
        ControlChannel(tmp_path / "control").request_save(SaveCause.LEAVE, "SIGTERM")  # the agent's own handler
        proc.send_signal(signal.SIGTERM)
        time.sleep(GRACE_S + 1.0)
        assert proc.poll() is None  # it trains on to the checkpoint the agent asked for
        proc.send_signal(signal.SIGTERM)  # a second one ends it
        assert proc.wait(timeout=30) == -signal.SIGTERM
        text = output(proc)
    assert events_in(text, "worker_sigterm_deferred") and not events_in(text, "worker_sigterm"), text


@pytest.mark.parametrize("why", ["marked-by-its-agent", "agent-gone"])
def test_a_sigterm_from_its_agent_or_with_its_agent_gone_ends_the_worker_at_once(tmp_path: Path, why: str) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    with worker(tmp_path, os.getpid() if why == "marked-by-its-agent" else gone.pid) as proc:
        if why == "marked-by-its-agent":
            mark_stopping(tmp_path / "control", [proc.pid])  # the agent's _shutdown, before torch's SIGTERM
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        text = output(proc)
    assert not events_in(text, "worker_sigterm_deferred"), text
