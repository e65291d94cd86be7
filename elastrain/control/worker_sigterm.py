"""A worker's SIGTERM when its whole node gets one: the agent's leave, not the worker's death.

A VM's shutdown (systemd signals every process of the unit), Slurm's ``scancel`` or preemption, and a
``kill -TERM`` of the node's whole tree send SIGTERM to every process of the node at once. The agent takes it as a
leave: it asks its workers for a checkpoint at their next step boundary, announces the leave, then stops them. A
worker that died of the same signal saves nothing: its step in flight is lost, and its peers meet a broken collective
instead of a notice.

So a worker started by ``elastrain-run`` (:func:`install`, run by the worker bootstrap and the zygote's forked
worker) defers its first SIGTERM while its agent lives (``event=worker_sigterm_deferred``):

- The agent's leave comes as a checkpoint request (:mod:`elastrain.control.save`) within :data:`GRACE_S`. The
  worker trains on to the step boundary, saves, holds, and its agent stops it.
- A SIGTERM from its agent ends it at once: the agent marks the workers it stops (:mod:`elastrain.control.stopping`).
  So does a second SIGTERM, and one that comes when the agent is gone.
- With no request within :data:`GRACE_S`, the signal was this worker's alone (``event=worker_sigterm``): it ends as
  the signal ends a process, :data:`GRACE_S` late.

A process the worker forked (a DataLoader's worker) inherits the handler and ignores a SIGTERM its worker's agent
did not send: its worker ends it, as torch's DataLoader does when its worker exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from elastrain.control.save import ControlChannel, SaveCause
from elastrain.control.stopping import is_stopping
from elastrain.env import AGENT_PID, CONTROL_DIR
from elastrain.log import lifecycle

GRACE_S = 2.0
"""How long a worker waits for its agent's leave after a SIGTERM before it takes the signal as its own."""


def install(environ: Mapping[str, str]) -> None:
    """Defer this worker's first SIGTERM as the module says (main thread; nothing outside ``elastrain-run``)."""
    agent, control = environ.get(AGENT_PID), environ.get(CONTROL_DIR)
    if not agent or not control or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _Deferral(int(agent), Path(control), os.getpid()).on_sigterm)


def _end() -> None:
    """End this process as an unhandled SIGTERM ends it (main thread)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Deferral:
    def __init__(self, agent_pid: int, control: Path, owner: int) -> None:
        self.agent_pid, self.control, self.owner = agent_pid, control, owner
        self.deferred = False
        self.expired = False

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if is_stopping(self.control, self.owner):
            _end()  # the agent stops this worker (a restart, the end of a leave or of the job)
        if os.getpid() != self.owner:
            return  # forked by the worker (a DataLoader's): its worker ends it
        if self.deferred or self.expired or not _alive(self.agent_pid):
            _end()
        self.deferred = True
        lifecycle("worker_sigterm_deferred", agent_pid=self.agent_pid, grace_s=GRACE_S)
        threading.Thread(target=self._end_unless_asked, name="elastrain-sigterm-grace", daemon=True).start()

    def _end_unless_asked(self) -> None:
        channel = ControlChannel(self.control)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            request = channel.current_request()
            if request is not None and request.cause is SaveCause.LEAVE:
                return  # the agent leaves: it asks for the checkpoint, then stops this worker
            time.sleep(0.05)
        lifecycle("worker_sigterm", level=logging.WARNING, why="no leave from the agent: the signal was this worker's")
        self.expired = True
        os.kill(self.owner, signal.SIGTERM)  # handled on the main thread: it ends there
