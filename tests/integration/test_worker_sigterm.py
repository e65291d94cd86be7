"""A worker's SIGTERM (elastrain.control.worker_sigterm), on real processes and real signals.

The process below takes SIGTERM as a worker started by elastrain-run does, with this test standing in for its agent
(``ELASTRAIN_AGENT_PID``, ``ELASTRAIN_CONTROL_DIR``). A signal "from the node" is sent by another process (``kill``),
as a VM's or Slurm's shutdown sends it; one from the agent, by this process. The whole-node case, through
elastrain-run, is in tests/e2e/test_live_ledger.py.
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
from support.processes import alive, events_in, wait_for, worker_env

from elastrain import env as env_vars
from elastrain.control import ControlChannel, SaveCause
from elastrain.control.worker_sigterm import GRACE_S

# The main thread stays in C (libc's sleep, the GIL released), as one blocked in a collective with a lost peer
# does: nothing of Python's runs on it.
WORKER = """
import ctypes, os, signal, sys, threading, time
from elastrain.control.worker_sigterm import install
from elastrain.log import configure
configure()
if sys.argv[1] == "own-handler":
    def on_term(signum, frame):
        print("HANDLED", flush=True)
        os._exit(3)
    signal.signal(signal.SIGTERM, on_term)
assert install(os.environ) and install(os.environ)  # the bootstrap's, then the script's: one thread
assert [t.name for t in threading.enumerate()].count("elastrain-sigterm") == 1
if sys.argv[1] == "forks":
    child = os.fork()
    if child == 0:
        ctypes.CDLL(None).sleep(3600)
        os._exit(0)
    print("CHILD", child, flush=True)
print("READY", flush=True)
while True:
    if sys.argv[1] == "own-handler":
        time.sleep(0.05)  # Python runs a handler on the main thread, between two of its instructions
    else:
        ctypes.CDLL(None).sleep(3600)
"""


@contextmanager
def worker(tmp_path: Path, agent_pid: int, kind: str = "plain") -> Iterator[subprocess.Popen[str]]:
    (tmp_path / "control").mkdir(exist_ok=True)  # the agent's control directory
    env = worker_env({env_vars.AGENT_PID: str(agent_pid), env_vars.CONTROL_DIR: str(tmp_path / "control")})
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, kind], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def ready(proc: subprocess.Popen[str]) -> list[str]:
    """The lines the worker printed up to READY."""
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline().strip()) != "READY":
        assert line or proc.poll() is None, "the worker ended before it was ready"
        lines.append(line)
    return lines


def from_the_node(pid: int) -> None:
    """SIGTERM from a process that is neither the agent nor the parent."""
    subprocess.run(["kill", "-TERM", str(pid)], check=True, timeout=30)


def output(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read()


def test_a_sigterm_from_the_node_with_no_leave_from_the_agent_ends_the_worker_as_the_signal_would(
    tmp_path: Path,
) -> None:
    with worker(tmp_path, os.getpid()) as proc:
        ready(proc)
        sent = time.monotonic()
        from_the_node(proc.pid)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - sent >= GRACE_S  # it waited for a leave that did not come
        text = output(proc)
    assert events_in(text, "worker_sigterm_deferred") and events_in(text, "worker_sigterm"), text


def test_a_sigterm_from_the_node_that_the_agent_makes_a_leave_of_waits_for_the_agent_to_stop_the_worker(
    tmp_path: Path,
) -> None:
    with worker(tmp_path, os.getpid()) as proc:
        ready(proc)
        ControlChannel(tmp_path / "control").request_save(SaveCause.LEAVE, "SIGTERM")  # the agent's own handler
        from_the_node(proc.pid)
        time.sleep(GRACE_S + 1.0)
        assert proc.poll() is None  # it trains on to the checkpoint the agent asked for
        proc.send_signal(signal.SIGTERM)  # the agent stops it
        assert proc.wait(timeout=30) == -signal.SIGTERM
        text = output(proc)
    assert events_in(text, "worker_sigterm_deferred") and not events_in(text, "worker_sigterm"), text


def test_a_second_sigterm_from_the_node_ends_a_deferring_worker(tmp_path: Path) -> None:
    with worker(tmp_path, os.getpid()) as proc:
        ready(proc)
        ControlChannel(tmp_path / "control").request_save(SaveCause.LEAVE, "SIGTERM")
        from_the_node(proc.pid)
        time.sleep(0.5)
        from_the_node(proc.pid)
        assert proc.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.parametrize("why", ["sent-by-its-agent", "agent-gone"])
def test_a_sigterm_from_its_agent_or_with_its_agent_gone_ends_the_blocked_worker_at_once(
    tmp_path: Path, why: str
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    with worker(tmp_path, os.getpid() if why == "sent-by-its-agent" else gone.pid) as proc:
        ready(proc)
        if why == "sent-by-its-agent":
            proc.send_signal(signal.SIGTERM)
        else:
            from_the_node(proc.pid)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        text = output(proc)
    assert not events_in(text, "worker_sigterm_deferred"), text


def test_a_handler_the_script_set_takes_the_agents_sigterm(tmp_path: Path) -> None:
    with worker(tmp_path, os.getpid(), "own-handler") as proc:
        ready(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 3
        assert "HANDLED" in output(proc)


def test_a_process_the_worker_forks_defers_the_nodes_sigterm_and_ends_on_its_parents(tmp_path: Path) -> None:
    with worker(tmp_path, os.getpid(), "forks") as proc:
        (line,) = ready(proc)
        child = int(line.split()[1])
        ControlChannel(tmp_path / "control").request_save(SaveCause.LEAVE, "SIGTERM")
        from_the_node(child)
        time.sleep(GRACE_S + 1.0)
        assert alive([child])  # a DataLoader's worker goes on loading for the step the agent asked to save
        os.kill(proc.pid, signal.SIGKILL)  # the worker dies alone: its child is reparented, still deferring
        proc.wait(timeout=30)
        os.kill(child, signal.SIGTERM)  # not from its parent now, but a second SIGTERM: it ends
        wait_for(lambda: not alive([child]), timeout=30, what="the forked child's end")
