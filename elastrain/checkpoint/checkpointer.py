"""The Checkpointer: sharded, asynchronous, atomic DCP checkpoints that reshard on load.

Inside a training script::

    ckpt = Checkpointer()                      # directory from --checkpoint-dir
    ckpt.register(model=model, optimizer=opt, scheduler=sched, train_state=state)
    info = ckpt.restore()                      # newest complete checkpoint, any world size
    for step in range(info.step + 1 if info else 0, total):
        train_step()
        ckpt.maybe_save(step)                  # on interval, or when the launcher asks
    ckpt.close()

A save copies the state that training could change (see :mod:`elastrain.checkpoint.staging`: only
buffers and small objects on the training thread; parameters and optimizer state on the writer
thread, before the next ``optimizer.step()``), then the writer thread saves it with DCP, CRC-32s
computed as the bytes are written (:mod:`elastrain.checkpoint.dcp_io`), and commits it through
:mod:`elastrain.checkpoint.commit`. ``wait()`` blocks until that commit. When to save is
:mod:`elastrain.checkpoint.schedule`'s.

A save that failed, in the background or not, raises :class:`CheckpointSaveError` (naming the path
and the cause) from the next ``save()``, ``maybe_save()``, ``wait()`` or ``close()``, unless the
checkpointer was built with ``on_save_error="warn"``; either way a ``checkpoint_save_failed`` event
is logged. A :class:`StaleGenerationError` (a newer world took over the checkpoint root) is raised
whatever ``on_save_error`` says.

The background writer is elastrain's own thread, not ``dcp.async_save``: it stalls training less (it
copies on the training thread only what the next step could change), starts no second process, and
keeps the CRC-32s it computes while writing where the commit needs them (``bench/checkpoint.py``
measures both; the figures are in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastrain.checkpoint.background import BackgroundSave
from elastrain.checkpoint.dcp_io import (
    root_cause,
)
from elastrain.checkpoint.dcp_load import DcpLoader, RestoreInfo
from elastrain.checkpoint.dcp_write import DcpWriter, SaveResult
from elastrain.checkpoint.parts import CheckpointParts
from elastrain.checkpoint.schedule import DEFAULT_INTERVAL_SECONDS, SaveReason, SaveSchedule
from elastrain.checkpoint.staging import Stager
from elastrain.checkpoint.state import Registry
from elastrain.control import SaveRequest
from elastrain.env import WorkerEnv
from elastrain.errors import (
    CheckpointError,
    CheckpointSaveError,
    StaleGenerationError,
)
from elastrain.step_flags import StepFlags
from elastrain.storage import storage_for

__all__ = ["DEFAULT_INTERVAL_SECONDS", "Checkpointer", "RestoreInfo", "SaveResult"]

KIND = "dcp"
# DCP warns on every single-process save/load; a one-process checkpointer is intended here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

OnSaveError = Literal["raise", "warn"]


class Checkpointer:
    """Saves and restores registered state.

    Construct it on every rank after ``torch.distributed.init_process_group`` (it creates two gloo
    groups of its own: one with ``ELASTRAIN_COLLECTIVE_TIMEOUT`` to agree when to save, one with
    ``ELASTRAIN_IO_TIMEOUT`` for everything that waits on storage); without an initialized process
    group it works as a single process. ``save``, ``maybe_save`` and ``restore`` are collective:
    every rank calls them with the same step. With neither interval given it saves every
    :data:`DEFAULT_INTERVAL_SECONDS`; pass ``interval_seconds=math.inf`` to save only on request.

    A save that answers the launcher's request (an announced membership change is coming) is
    synchronous, and afterwards the training thread holds for up to ``hold_after_request_s`` for the
    restart the launcher is about to do, so that no step runs past the checkpoint only to be redone.

    ``on_save_error="raise"`` (the default) makes a failed save raise :class:`CheckpointSaveError` from
    the next call; ``"warn"`` logs ``checkpoint_save_failed`` and lets training go on.

    ``env``: the worker's environment (default: read from the process's); a live regroup passes the new world's.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        keep_last: int = 3,
        interval_steps: int | None = None,
        interval_seconds: float | None = None,
        async_save: bool = True,
        process_group: dist.ProcessGroup | None = None,
        *,
        verify_checksums: bool = True,
        thread_count: int = 1,
        sync_every_steps: int = 1,
        overlap_staging: bool = True,
        hold_after_request_s: float = 5.0,
        on_save_error: OnSaveError = "raise",
        env: WorkerEnv | None = None,
    ) -> None:
        parts = CheckpointParts(
            "Checkpointer",
            directory,
            env if env is not None else WorkerEnv.from_environ(),
            kind=KIND,
            keep_last=keep_last,
            on_save_error=on_save_error,
            schedule=lambda: SaveSchedule.default(
                interval_steps,
                interval_seconds,
                hold_after_request_s=hold_after_request_s,
                agree_every_steps=sync_every_steps,
            ),
            storage=storage_for,
            process_group=process_group,
        )
        self.root = parts.root
        self.keep_last = keep_last
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.thread_count = thread_count
        self.on_save_error: OnSaveError = on_save_error
        self.storage = parts.storage
        self.registry = Registry()
        # Agreeing when to save (training thread); and every collective that waits on storage: saving
        # (writer thread), restoring and preparing a step directory (training thread, with no save in flight).
        self._sync, self._io = parts.sync, parts.io
        self.rank, self.world_size = parts.rank, parts.world_size
        self._log = parts.log
        self._trigger = parts.trigger
        self._commit = parts.commit
        self._stager = Stager(self.registry, overlap=overlap_staging)
        self._writer = DcpWriter(
            self._stager, self.storage, self._io, self._commit, self._trigger, lambda: self.thread_count, self._log
        )
        self._inflight = BackgroundSave(exit_wait_s=parts.env.io_timeout_s)
        self._loader = DcpLoader(
            self.root, self.storage, self.registry, self._commit, self._io, lambda: self.verify_checksums
        )
        self.last_result: SaveResult | None = None
        self.last_error: BaseException | None = None
        self._closed = False
        self._hold_after: int | None = None  # a requested save whose hold the caller deferred
        self.last_request: SaveRequest | None = None  # the launcher's request the last save answers, if any
        self._before_save: Callable[[], object] | None = None

    def agree_through(self, flags: StepFlags) -> None:
        """Agree when to save through ``flags``, raised in each step's gradient all-reduce (the Session's DDP
        comm hook), instead of an all-reduce of our own per step; steps without a sync still use ours."""
        self._trigger.use_flags(flags)

    def before_save(self, ready: Callable[[], object]) -> None:
        """Call ``ready`` on every rank before a save reads the registered state (once the save's step directory is
        prepared): the caller makes that state whole (a live catch-up's transfer still arriving in phases)."""
        self._before_save = ready

    def continue_as(self, generation: int | None) -> None:
        """This world goes on as the newer ``generation``: every one of its members is a member of that world (nodes
        only joined it, under the claim its leader just made), so this world's next commit is that generation's.
        For a live regroup whose new world starts from this world's checkpoint (a sharded model)."""
        current = self._commit.generation
        if generation is None or (current is not None and generation < current):
            raise CheckpointError(f"continue_as({generation}): a world goes on only as a generation after {current}")
        self._commit.generation = generation

    @property
    def schedule(self) -> SaveSchedule:
        """When this checkpointer saves; assign a new one to change it from the next step on."""
        return self._trigger.schedule

    @schedule.setter
    def schedule(self, schedule: SaveSchedule) -> None:
        self._trigger.schedule = schedule

    # -- registration ----------------------------------------------------------------------------
    def register(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **more: Any
    ) -> None:
        """What to save: the model, its optimizer and any ``Stateful`` (scheduler, train state, sampler)."""
        self.registry.register(model=model, optimizer=optimizer, **more)

    # -- saving ----------------------------------------------------------------------------------
    def maybe_save(self, step: int, hold: bool = True) -> bool:
        """Call at every step boundary: save on the interval or on a pending launcher request.

        After a requested save the training thread holds (bounded) for the restart the launcher is about to
        do. ``hold=False`` defers that hold to :meth:`hold_if_requested`, so the caller can first record the
        step (its metrics point) that the restart would otherwise cut off."""
        self._reap()
        reason = self._trigger.check(step)
        if reason is None:
            return False
        if reason is SaveReason.INTERVAL:
            return self.save(step, blocking=not self.async_save, reason=reason.value)
        # hold=False: the caller's step goes on (its metrics' collective) before the launcher hears of the save.
        saved = self._save(step, blocking=True, reason=reason.value, defer_answer=not hold)
        if saved and hold:
            self._trigger.hold(step)
        elif saved:
            self._hold_after = step
        return saved

    def hold_if_requested(self) -> None:
        """The hold that ``maybe_save(step, hold=False)`` deferred, if a requested save is waiting for it."""
        step, self._hold_after = self._hold_after, None
        if step is not None and not self._closed:
            self._trigger.hold(step)

    def save(self, step: int, blocking: bool = False, reason: str = "explicit") -> bool:
        """Save ``step`` on every rank (collective). False if that step is already saved, or (with
        ``on_save_error="warn"``) if the save failed."""
        return self._save(step, blocking, reason)

    def _save(self, step: int, blocking: bool, reason: str, defer_answer: bool = False) -> bool:
        """``save``; ``defer_answer``: the launcher's request this save answers is told at the hold (or close)."""
        if self._closed:
            raise CheckpointError("save() after close(): create a new Checkpointer")
        self.last_request = None
        self.wait()
        try:
            path = self._commit.prepare(step)
        except CheckpointSaveError as e:
            self._failed(e)
            return False
        if path is None:
            self._trigger.started(step)
            return False
        if self._before_save is not None:
            self._before_save()
        request = self.last_request = self._trigger.claim(reason)
        bound = self._trigger.bound(reason)  # a save training goes on from answers only the requests agreed on
        t0 = time.perf_counter()
        self._log(
            "checkpoint_save_started",
            step=step,
            path=path,
            reason=reason,
            request=request.request_id if request else None,
        )
        sync = blocking or not self.async_save
        defer = defer_answer and request is not None
        job = self._writer.job(self.registry, step, path, request, t0, sync, defer, bound)
        self._trigger.started(step)
        if sync:
            try:
                result = self._writer.write_and_commit(job)
            except (Exception, CheckpointException) as e:
                self._failed(e)
                return False
            self.last_result = result
        else:
            self._inflight.start(self._writer.write_and_commit, job)
        return True

    def _failed(self, e: BaseException) -> None:
        """A save failed: raise it as a CheckpointSaveError (or, with on_save_error="warn", log and go on)."""
        if isinstance(e, StaleGenerationError):
            raise e
        error = e if isinstance(e, CheckpointSaveError) else CheckpointSaveError(f"{self.root}: {root_cause(e)}")
        self.last_error = error
        self._log("checkpoint_save_failed", logging.ERROR, error=str(error), on_save_error=self.on_save_error)
        if self.on_save_error == "raise":
            raise error from (None if error is e else e)

    def _finish(self, fut: Future[SaveResult]) -> None:
        try:
            self.last_result = fut.result()
        except (Exception, CheckpointException) as e:
            self._failed(e)

    def _reap(self) -> None:
        if self._inflight.finished() and (fut := self._inflight.take()) is not None:
            self._finish(fut)

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed; its result. Raises if it failed (see ``on_save_error``)."""
        if (fut := self._inflight.take()) is not None:
            self._finish(fut)
            return self.last_result
        return None

    def close(self, give_up_after_s: float | None = None, *, ended: bool = True) -> None:
        """Finish the in-flight save (raising if it failed) and release threads and process groups; a save still
        running after ``give_up_after_s`` (the caller's world broke: it may wait on a member that is gone, which
        gloo ends only at the I/O timeout) is given up: it writes and commits nothing more, and keeps its group.
        ``ended``: training ended (else it goes on in another world, a regroup): a request still pending is answered
        by the last commit if it holds the last step :meth:`maybe_save` saw (:meth:`SaveTrigger.answer_at_end`)."""
        if self._closed:
            return
        self._closed = True
        given_up = None
        try:
            self._trigger.answer()  # a requested save whose hold never came (the loop ended at that step)
            if give_up_after_s is not None and (given_up := self._inflight.give_up_after(give_up_after_s)):
                self._log(
                    "checkpoint_save_given_up",
                    logging.WARNING,
                    step=given_up.step,
                    path=given_up.path,
                    waited_s=give_up_after_s,
                    why="its world broke while it waited on a member that is gone",
                )
            self.wait()
            if ended and given_up is None:
                self._trigger.answer_at_end()
        finally:
            self._stager.close()
            if given_up is not None:
                self._io.abandon()
            else:
                self._io.destroy()
            self._sync.destroy()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring -------------------------------------------------------------------------------
    def restore(self) -> RestoreInfo | None:
        """Load the newest complete checkpoint every rank agrees on, at any world size; ``None`` if there is none."""
        self.wait()
        t0 = time.perf_counter()
        info = self._loader.load_newest()
        if info is None:
            self._log("checkpoint_restored", step=None, path=self.root, why="no complete checkpoint; starting fresh")
            return None
        self._trigger.started(info.step)
        self._log(
            "checkpoint_restored",
            step=info.step,
            path=info.path,
            world_size=f"{info.world_size}->{self.world_size}",
            seconds=time.perf_counter() - t0,
        )
        self._io.barrier()
        return info
