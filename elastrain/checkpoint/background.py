"""The save a checkpointer runs in the background: at most one, on its own daemon thread, and giving it up.

Its own thread rather than a pool's: a pool's worker thread is joined when the process exits, so a save given up
(its world broke while it waited in a collective that gloo ends only at the I/O timeout) would hold the exit of
a worker that has long finished; a daemon thread never does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from elastrain.checkpoint.dcp_write import SaveJob, SaveResult


class BackgroundSave:
    """The save in flight, if any: its future (the result, or the exception the training thread raises)."""

    def __init__(self) -> None:
        self._future: Future[SaveResult] | None = None
        self._job: SaveJob | None = None

    def start(self, write: Callable[[SaveJob], SaveResult], job: SaveJob) -> None:
        """Run ``write(job)`` on its own daemon thread (the caller took the previous save first)."""
        if self._future is not None:
            raise RuntimeError("internal: a save started while another was in flight")
        future: Future[SaveResult] = Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                future.set_result(write(job))
            except BaseException as exc:  # handed to the training thread through the future
                future.set_exception(exc)

        self._future, self._job = future, job
        threading.Thread(target=run, name=f"elastrain-ckpt-step{job.step}", daemon=True).start()

    def finished(self) -> bool:
        return self._future is not None and self._future.done()

    def take(self) -> Future[SaveResult] | None:
        """The save's future, no longer in flight here (None if none was)."""
        future, self._future, self._job = self._future, None, None
        return future

    def give_up_after(self, timeout_s: float) -> SaveJob | None:
        """Wait up to ``timeout_s`` for the save to end; if it has not, give it up (it writes and commits nothing
        more, :attr:`SaveJob.given_up`) and return its job. None when it ended (``take`` it) or none ran."""
        if self._future is None or self._job is None:
            return None
        try:
            self._future.exception(timeout=timeout_s)
        except FutureTimeoutError:
            job = self._job
            job.given_up.set()
            self._future = self._job = None
            return job
        return None
