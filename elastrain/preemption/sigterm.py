"""SIGTERM as a preemption notice: Kubernetes (pod deletion, node drain, spot node reclaim) and most
schedulers send it first and kill the process when the grace period ends (30 s by default in
Kubernetes, ``terminationGracePeriodSeconds``).

A signal handler may only be installed from the main thread, and torch's agent installs its own
SIGTERM handler whenever it starts workers, so :meth:`SigtermWatcher.install` chains to the handler it
replaces and the agent may instead call :meth:`SigtermWatcher.notify` from its own handler.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from elastrain.preemption.notice import Notice, Watcher, notice_with_deadline

KUBERNETES_DEFAULT_GRACE_S = 30.0


class SigtermWatcher(Watcher):
    name = "sigterm"

    def __init__(self, grace_s: float = KUBERNETES_DEFAULT_GRACE_S, clock: Callable[[], float] = time.time) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self._notice: Notice | None = None

    def notify(self, signum: int = signal.SIGTERM) -> Notice:
        """Record that the signal arrived (idempotent: the first arrival sets the deadline)."""
        # No lock: this runs inside a signal handler, and one attribute store is atomic.
        notice = self._notice
        if notice is None:
            now = self.clock()
            notice = notice_with_deadline(
                source="sigterm", kind=signal.Signals(signum).name, noticed_at=now, deadline=now + self.grace_s
            )
            self._notice = notice
        return notice

    def poll(self) -> Notice | None:
        return self._notice

    def probe(self) -> bool:
        return True

    def install(self, signum: int = signal.SIGTERM) -> Any:
        """Handle ``signum`` (main thread only): record the notice, then run the handler it replaced."""
        previous = signal.getsignal(signum)

        def _handler(sig: int, frame: FrameType | None) -> None:
            self.notify(sig)
            if callable(previous):
                previous(sig, frame)

        signal.signal(signum, _handler)
        return previous
