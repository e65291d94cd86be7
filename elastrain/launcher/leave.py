"""This node's one leave: who asked first, by when it must be over, and how the agent runs it.

A leave (SIGTERM, a preemption notice) checkpoints and announces itself on whichever thread asked: a
preemption watcher's thread, or the main thread in the SIGTERM handler (:class:`NodeLeave`). The agent's
main loop then waits for it before it stops the workers, so that the checkpoint is not cut short. That
wait is bounded: the leave's own deadline plus :data:`LEAVE_WAIT_MARGIN_S`, after which the loop stops the
workers anyway and says so (``leave_wait_gave_up``): a leave whose steps failed or hang must still end the
agent.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from elastrain.control import SaveCause
from elastrain.errors import NodeLeftError
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership

LEAVE_WAIT_MARGIN_S = 10.0
"""How long past the leave's deadline the main loop still waits for its checkpoint and announcement."""

SIGTERM_LEAVE_DEADLINE_S = 25.0
"""A SIGTERM (pod deletion, spot notice by signal) leaves within this many seconds at most."""


class Leave:
    """Claimed once (:meth:`claim`); :meth:`over` when its steps ended, however they ended; :meth:`wait`, bounded."""

    def __init__(self, margin_s: float = LEAVE_WAIT_MARGIN_S) -> None:
        # Reentrant: the SIGTERM handler runs on the main thread, which may hold it already (in wait()).
        self._lock = threading.RLock()
        self._reason: str | None = None
        self._deadline: float | None = None
        self._over = threading.Event()
        self._margin_s = margin_s

    @property
    def reason(self) -> str | None:
        """Why this node leaves; ``None`` while no leave was asked for."""
        return self._reason

    def claim(self, reason: str, deadline_s: float) -> bool:
        """Whether this call is the node's leave (the first one); it must be over within ``deadline_s``."""
        with self._lock:
            if self._reason is not None:
                return False
            self._deadline = time.monotonic() + max(0.0, deadline_s)
            self._reason = reason
            return True

    def over(self) -> None:
        """The leave's steps ended (done, failed or given up): the main loop may stop the workers."""
        self._over.set()

    def wait(self) -> bool:
        """Wait until the leave is over, at most until its deadline plus the margin; ``False`` if it gave up."""
        with self._lock:
            deadline = self._deadline
        if deadline is None:
            return True
        bound = max(0.0, deadline - time.monotonic()) + self._margin_s
        if self._over.wait(bound):
            return True
        lifecycle(
            "leave_wait_gave_up",
            level=logging.WARNING,
            reason=self._reason,
            waited_s=round(bound, 3),
            why="the leave's checkpoint or announcement is not over past its deadline: stopping the workers now",
        )
        return False


class NodeLeave:
    """The agent's leave: checkpoint (if the workers run), announce through membership, end the agent."""

    def __init__(
        self,
        membership: Membership,
        checkpoint: Callable[[SaveCause, str, float], None],
        workers_running: Callable[[], bool],
        save_timeout_s: float,
    ) -> None:
        """``checkpoint(cause, detail, timeout_s)`` asks the workers for a checkpoint (bounded);
        ``workers_running()`` says whether there are workers to ask."""
        self._membership = membership
        self._checkpoint = checkpoint
        self._workers_running = workers_running
        self._save_timeout_s = save_timeout_s
        self._leave = Leave()

    @property
    def reason(self) -> str | None:
        """Why this node leaves; ``None`` while no leave was asked for."""
        return self._leave.reason

    def leaving(self) -> bool:
        """Whether a leave was asked for."""
        return self._leave.reason is not None

    def request(self, reason: str, deadline_s: float) -> None:
        """Leave the job within ``deadline_s``: checkpoint (if enabled), announce, stop the workers, end.

        Thread-safe and idempotent. Called from a watcher thread it does the checkpoint and the
        announcement there and the main loop ends the agent at its next tick; called on the main thread
        (the SIGTERM handler) it does everything inline.
        """
        if not self._leave.claim(reason, deadline_s):
            return
        started = time.monotonic()
        try:  # however it ends, the main loop must learn that the leave is over (see raise_if_left)
            lifecycle("leave_requested", level=logging.WARNING, reason=reason, deadline_s=deadline_s)
            if self._workers_running():
                self._checkpoint(SaveCause.LEAVE, reason, max(0.0, deadline_s - 1.0))
            self._membership.leave(reason)  # bounded, and logs its own failure
        finally:
            self._leave.over()
        lifecycle("leave_announced", reason=reason, took_s=round(time.monotonic() - started, 3))

    def install_sigterm(self) -> None:
        """Take SIGTERM as a leave (on the main thread only, where python delivers signals)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def raise_if_left(self) -> None:
        """End the agent's loop if this node leaves, once the leave's steps are over (bounded)."""
        reason = self._leave.reason
        if reason is not None:
            # A watcher thread may still be checkpointing: wait for it, until its deadline at most.
            self._leave.wait()
            raise NodeLeftError(f"left the job: {reason}")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.request(name, min(self._save_timeout_s + 1.0, SIGTERM_LEAVE_DEADLINE_S))
        self._leave.wait()  # a watcher's leave may be checkpointing still (bounded)
        raise NodeLeftError(f"left the job on {name}")
