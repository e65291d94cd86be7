"""A worker's SIGTERM when its whole node gets one: its agent's leave, not the worker's death.

A VM's shutdown (systemd signals every process of the unit), Slurm's preemption or ``scancel`` (every process of
the step), and a ``kill -TERM`` of the node's whole tree send SIGTERM to every process of the node at once. The
agent takes it as a leave: it asks its workers for a checkpoint at their next step boundary, announces the leave,
then stops them. A worker that died of the same signal saved nothing: its step in flight was lost, and its peers
met a broken collective instead of a notice.

So a worker started by ``elastrain-run`` (:func:`install`, from the worker bootstrap and the zygote's forked
worker) takes SIGTERM on a thread of its own, which learns who sent it (``sigwaitinfo``), however busy the main
thread is (a step, a collective blocked on a lost peer):

- from its agent, its parent or its worker (torch's ``terminate()`` of a DataLoader worker): it ends at once, as
  the signal ends a process. The agent's SIGTERM stops a worker (a restart, the end of a leave or of the job).
- from anyone else (the node's shutdown) while its agent lives: the worker defers it
  (``event=worker_sigterm_deferred``). The agent's leave comes as a checkpoint request
  (:mod:`elastrain.control.save`) within :data:`GRACE_S`: the worker trains on to the step boundary, saves, holds,
  and its agent stops it. With no request within :data:`GRACE_S` the signal was this worker's alone
  (``event=worker_sigterm``): it ends as the signal ends a process, :data:`GRACE_S` late. A second SIGTERM ends it.

"Ends as the signal ends a process": the signal is handed to the process's own disposition, the default (the
process dies of SIGTERM) or a handler the script or a library set (it runs as it would have).

SIGTERM stays blocked in every thread of the worker, so that only that thread takes it. A process the worker forks
(a DataLoader's worker: torch's SIGTERM handler in it would end it on any SIGTERM and fail the step) keeps the mask
and gets a thread of its own with the same rules; a Python program it starts with its environment does too, through
the bootstrap. A program of another kind it starts inherits the blocked mask (POSIX keeps it across ``exec``), so
a SIGTERM does not end it until it exits, or is ended with another signal (SIGKILL).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path

from elastrain import pids
from elastrain.control.save import ControlChannel, SaveCause
from elastrain.env import AGENT_PID, CONTROL_DIR, SIGTERM_WORKER_PID
from elastrain.log import lifecycle

GRACE_S = 2.0
"""How long a worker waits for its agent's leave after a SIGTERM before it takes the signal as its own."""

_POLL_S = 0.05
_SIGTERM = {signal.SIGTERM}


class Verdict(enum.Enum):
    END = "end"  # hand the signal to the process's disposition now
    DEFER = "defer"  # wait for the agent's leave


class _Grace(enum.Enum):
    LEAVE = "leave"
    SIGNALLED = "signalled"
    EXPIRED = "expired"


def verdict(sender: int, own: Collection[int], deferred: bool, agent_alive: bool) -> Verdict:
    """What a SIGTERM from ``sender`` does to a process whose own processes (its agent, its parent, its worker) are
    ``own``, after a SIGTERM it deferred already or not, with its agent alive or not (pure)."""
    if sender in own or deferred or not agent_alive:
        return Verdict.END
    return Verdict.DEFER


_taken_in: int | None = None
"""The process whose SIGTERM a thread of this module takes (a forked child's own, once its fork hook ran)."""


def install(environ: Mapping[str, str]) -> bool:
    """Take SIGTERM as the module says in this process; ``False`` (nothing changed) outside ``elastrain-run`` or
    when the process already runs other threads (they would take the signal with the disposition they have)."""
    global _taken_in
    if _taken_in == os.getpid():
        return True  # already (the bootstrap, then the script)
    agent, control = environ.get(AGENT_PID), environ.get(CONTROL_DIR)
    if not agent or not control or not agent.isdigit() or not _one_thread():
        return False
    owner = environ.get(SIGTERM_WORKER_PID, "")
    if not owner.isdigit():  # the worker itself; the programs it starts inherit its pid, and log nothing of their own
        owner = os.environ[SIGTERM_WORKER_PID] = str(os.getpid())
    deferral = _Deferral(int(agent), Path(control), int(owner))
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGTERM)
    deferral.start()
    os.register_at_fork(after_in_child=deferral.in_forked_child)
    return True


def _one_thread() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return threading.active_count() == 1


class _Deferral:
    def __init__(self, agent_pid: int, control: Path, worker_pid: int) -> None:
        self.agent_pid, self.control, self.worker_pid = agent_pid, control, worker_pid

    def start(self) -> None:
        global _taken_in
        threading.Thread(target=self._take, name="elastrain-sigterm", daemon=True).start()
        _taken_in = os.getpid()

    def in_forked_child(self) -> None:
        """After ``os.fork`` (a DataLoader's worker): the mask is inherited, the thread is not."""
        if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
            self.start()

    def _take(self) -> None:
        deferred = False
        while True:
            info = signal.sigwaitinfo(_SIGTERM)
            sender = info.si_pid
            own = (self.agent_pid, os.getppid(), self.worker_pid)
            if verdict(sender, own, deferred, pids.alive(self.agent_pid)) is Verdict.END:
                return self._hand_over()
            deferred = True
            if self._is_worker():  # one line per worker, not one per DataLoader worker
                lifecycle("worker_sigterm_deferred", sender=sender, agent_pid=self.agent_pid, grace_s=GRACE_S)
            try:
                outcome = self._leave_within(GRACE_S)
            except OSError as exc:  # the control directory is gone: no leave can be read, the signal is ours
                lifecycle("worker_sigterm_unread", level=logging.WARNING, error=repr(exc)[:200])
                return self._hand_over()
            if outcome is _Grace.LEAVE:
                continue  # the agent asked for the checkpoint: its SIGTERM, or a second one, ends this process
            if outcome is _Grace.EXPIRED and self._is_worker():
                lifecycle("worker_sigterm", level=logging.WARNING, why="no leave from the agent: its own signal")
            return self._hand_over()

    def _is_worker(self) -> bool:
        return os.getpid() == self.worker_pid

    def _leave_within(self, seconds: float) -> _Grace:
        """Wait up to ``seconds`` for the agent's leave (its checkpoint request), or another SIGTERM."""
        channel = ControlChannel(self.control)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            request = channel.current_request()
            if request is not None and request.cause is SaveCause.LEAVE:
                return _Grace.LEAVE
            if signal.sigtimedwait(_SIGTERM, _POLL_S) is not None:
                return _Grace.SIGNALLED
        return _Grace.EXPIRED

    def _hand_over(self) -> None:
        """Give SIGTERM to the process's disposition (the default ends it) on this thread, which then only waits:
        a handler the script set takes any later SIGTERM on it too."""
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGTERM)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        threading.Event().wait()
