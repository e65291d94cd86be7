"""This node's one leave: who asked first, by when it must be over, and whether it is.

A leave (SIGTERM, a preemption notice) checkpoints and announces itself on whichever thread asked: a
preemption watcher's thread, or the main thread in the SIGTERM handler. The agent's main loop then waits
for it before it stops the workers, so that the checkpoint is not cut short. That wait is bounded: the
leave's own deadline plus :data:`LEAVE_WAIT_MARGIN_S`, after which the loop stops the workers anyway and
says so (``leave_wait_gave_up``): a leave whose steps failed or hang must still end the agent.
"""

from __future__ import annotations

import logging
import threading
import time

from elastrain.log import lifecycle

LEAVE_WAIT_MARGIN_S = 10.0
"""How long past the leave's deadline the main loop still waits for its checkpoint and announcement."""


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
