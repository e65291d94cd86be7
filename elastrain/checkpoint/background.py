"""The save a checkpointer runs in the background: at most one, on its own daemon thread, and giving it up.

Its own thread rather than a pool's: a pool's worker thread is joined when the process exits, so a save given up
(its world broke while it waited in a collective that gloo ends only at the I/O timeout) would hold the exit of
a worker that has long finished; a daemon thread never does. A save not given up still ends before the process
does, as a pool's would: the exit waits for it (bounded by the I/O timeout), before the checkpoint's process
groups are destroyed (:mod:`elastrain.checkpoint.group`'s exit hook).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from elastrain.checkpoint.dcp_write import SaveJob, SaveResult
from elastrain.log import lifecycle

_in_flight: set[BackgroundSave] = set()  # held here too: a checkpointer dropped unclosed is still waited for


class BackgroundSave:
    """The save in flight, if any: its future (the result, or the exception the training thread raises)."""

    def __init__(self, exit_wait_s: float) -> None:
        self.exit_wait_s = exit_wait_s
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
        _in_flight.add(self)
        # Last registered, first run: before the exit hook that destroys the process groups this save uses.
        atexit.unregister(_finish_at_exit)
        atexit.register(_finish_at_exit)
        threading.Thread(target=run, name=f"elastrain-ckpt-step{job.step}", daemon=True).start()

    def finished(self) -> bool:
        return self._future is not None and self._future.done()

    def take(self) -> Future[SaveResult] | None:
        """The save's future, no longer in flight here (None if none was)."""
        future, self._future, self._job = self._future, None, None
        _in_flight.discard(self)
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
            _in_flight.discard(self)
            return job
        return None

    def finish_at_exit(self) -> None:
        """At the process's exit: let the save in flight end (bounded), as a pool's thread would have."""
        future = self._future
        if future is None:
            return
        try:
            future.exception(timeout=self.exit_wait_s)
        except FutureTimeoutError:
            lifecycle(
                "checkpoint_save_cut_off",
                level=logging.WARNING,
                waited_s=self.exit_wait_s,
                why="still running when the process exited: never committed",
            )


def _finish_at_exit() -> None:
    for save in list(_in_flight):
        save.finish_at_exit()
