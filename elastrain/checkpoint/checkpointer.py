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

The background writer is elastrain's own thread, not ``dcp.async_save``. ``bench/checkpoint.py``
measures both on the same FSDP2 state (2 ranks, 403 MB with AdamW, CPU, this 2-core machine):
torch's process-based checkpointer (``AsyncCheckpointerType.PROCESS``) with its default stager (on a
CPU-only host: pinned memory and non-blocking copies off) stalled training 0.36 s on its first
save, which starts a writer process with its own gloo group (peak memory +691 MB, paid again after
every restart), and 0.44 s on later ones, where it stages a full copy before training may go on;
the writer thread stalled 0.006-0.03 s (it copies on the training thread only what the next step
could change, and overlaps the rest with forward and backward; peak +65-286 MB) with no second
process. Step times while either write ran were within this machine's noise of each other. And
the CRC-32s that :mod:`elastrain.checkpoint.dcp_io` computes while writing stay in this process,
where the commit needs them; from a writer process they would have to be read back. So the thread
stays the default.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import entry_of, save_error
from elastrain.checkpoint.dcp_io import (
    METADATA,
    check_crc,
    check_fits,
    is_tampering,
    load_planner,
    metadata_problems,
    read_metadata,
    reader_for,
    root_cause,
    writer_for,
    written_files,
)
from elastrain.checkpoint.parts import CheckpointParts
from elastrain.checkpoint.rng import capture_rng, restore_rng
from elastrain.checkpoint.schedule import DEFAULT_INTERVAL_SECONDS, SaveReason, SaveSchedule
from elastrain.checkpoint.staging import Stager
from elastrain.checkpoint.state import Registry
from elastrain.checkpoint.storage import storage_for
from elastrain.control import SaveRequest
from elastrain.env import WorkerEnv
from elastrain.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointTamperedError,
    StaleGenerationError,
)
from elastrain.step_flags import StepFlags

__all__ = ["DEFAULT_INTERVAL_SECONDS", "Checkpointer", "RestoreInfo", "SaveResult"]

SIDECAR = "elastrain-rank-{rank:05d}.json"
KIND = "dcp"
# DCP warns on every single-process save/load; a one-process checkpointer is intended here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

OnSaveError = Literal["raise", "warn"]


@dataclass(frozen=True)
class RestoreInfo:
    """The checkpoint that :meth:`Checkpointer.restore` loaded."""

    step: int
    path: str
    world_size: int  # the world size it was saved at


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    stall_s: float
    total_s: float
    step_wait_s: float = 0.0  # optimizer.step() waiting for the overlapped staging copy


@dataclass
class _SaveJob:
    """One save handed from the training thread to the writer thread."""

    staged: dict[str, torch.Tensor]
    deferred: dict[str, torch.Tensor]
    sidecar: dict[str, Any]
    step: int
    path: str
    request: SaveRequest | None
    t0: float
    synchronous: bool
    captured_at: float  # wall clock: the training state the save holds
    defer_answer: bool = False  # the request it answers is told later (SaveTrigger.answer)
    stall_s: float = 0.0
    waited_at_start: float = 0.0


def _sidecar(rank: int) -> str:
    return SIDECAR.format(rank=rank)


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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastrain-ckpt")
        self._inflight: Future[SaveResult] | None = None
        self._dirty = False  # a failed load may have overwritten part of the registered state
        self.last_result: SaveResult | None = None
        self.last_error: BaseException | None = None
        self._closed = False
        self._hold_after: int | None = None  # a requested save whose hold the caller deferred

    def agree_through(self, flags: StepFlags) -> None:
        """Agree when to save through ``flags``, raised in each step's gradient all-reduce (the Session's DDP
        comm hook), instead of an all-reduce of our own per step; steps without a sync still use ours."""
        self._trigger.use_flags(flags)

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

    @property
    def interval_steps(self) -> int | None:
        return self._trigger.schedule.interval_steps

    @property
    def interval_seconds(self) -> float | None:
        return self._trigger.schedule.interval_seconds

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
        self.wait()
        try:
            path = self._commit.prepare(step)
        except CheckpointSaveError as e:
            self._failed(e)
            return False
        if path is None:
            self._trigger.started(step)
            return False
        request = self._trigger.claim()
        t0 = time.perf_counter()
        self._log(
            "checkpoint_save_started",
            step=step,
            path=path,
            reason=reason,
            request=request.request_id if request else None,
        )
        tensors, plain = self.registry.collect()
        sync = blocking or not self.async_save
        # A blocking save writes the live tensors; an async one a staged copy that training cannot touch.
        staged, deferred = (tensors, {}) if sync else self._stager.stage(tensors)
        sidecar: dict[str, Any] = {"format": 1, "step": step, "rank": self.rank, "world_size": self.world_size}
        sidecar.update(state=plain, rng=capture_rng())
        job = _SaveJob(
            staged,
            deferred,
            sidecar=sidecar,
            step=step,
            path=path,
            request=request,
            t0=t0,
            synchronous=sync,
            captured_at=time.time(),
            defer_answer=defer_answer and request is not None,
        )
        job.stall_s = time.perf_counter() - t0
        job.waited_at_start = self._stager.waited_s
        self._trigger.started(step)
        if sync:
            try:
                result = self._write_and_commit(job)
            except (Exception, CheckpointException) as e:
                self._failed(e)
                return False
            self.last_result = result
        else:
            self._inflight = self._executor.submit(self._write_and_commit, job)
        return True

    def _write_and_commit(self, job: _SaveJob) -> SaveResult:
        """Writer thread (or the training thread, for a blocking save): write, report, commit."""
        step, path = job.step, job.path
        try:
            job.staged = self._stager.finish(job.staged, job.deferred)  # releases optimizer.step()
            writer = writer_for(path, self.thread_count)
            md = dcp_save(
                job.staged,
                storage_writer=writer,
                process_group=self._io.pg,
                no_dist=not self._io.distributed,
            )
        except (Exception, CheckpointException) as e:
            # DCP gathers every rank's failure and raises on all of them: no rank waits in a collective.
            raise save_error(path, step, root_cause(e)) from None
        finally:
            self._stager.release()
        error: str | None = None
        report: dict[str, layout.FileEntry] | None = None
        try:
            data = json.dumps(job.sidecar).encode()
            self.storage.write_atomic(self.storage.join(path, _sidecar(self.rank)), data)
            report = written_files(writer, md)
            report[_sidecar(self.rank)] = entry_of(data)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        expected = {str(info.relative_path) for info in (md.storage_data or {}).values()}
        expected |= {METADATA} | {_sidecar(r) for r in range(self.world_size)}
        self._commit.commit(step, path, report, error, expected=expected)
        total = time.perf_counter() - job.t0
        # stall: the training thread inside save(); step_wait: optimizer.step() waiting for the staging copy.
        step_wait = self._stager.waited_s - job.waited_at_start
        self._log(
            "checkpoint_committed", step=step, path=path, stall_s=job.stall_s, step_wait_s=step_wait, total_s=total
        )
        # A blocking save held training until now; an async one holds the state of when it was staged.
        current_at = time.time() if job.synchronous else job.captured_at
        self._trigger.committed(step, path, current_at, defer_answer=job.defer_answer)
        return SaveResult(step=step, path=path, stall_s=job.stall_s, total_s=total, step_wait_s=step_wait)

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
        if self._inflight is not None and self._inflight.done():
            fut, self._inflight = self._inflight, None
            self._finish(fut)

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed; its result. Raises if it failed (see ``on_save_error``)."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            self._finish(fut)
            return self.last_result
        return None

    def close(self) -> None:
        """Finish the in-flight save (raising if it failed) and release threads and process groups."""
        if self._closed:
            return
        self._closed = True
        try:
            self._trigger.answer()  # a requested save whose hold never came (the loop ended at that step)
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()
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
        info = self._commit.restore(self._load, read_crc=self._read_crc)
        if info is None:
            if self._dirty:
                raise CheckpointCorruptError(
                    f"{self.root}: a checkpoint failed while loading and no older one loads, so the model holds "
                    "part of a damaged checkpoint: move the step directories named in the checkpoint_fallback "
                    "events away and start again"
                )
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

    def _read_crc(self, name: str, entry: layout.FileEntry) -> bool:
        """Which files verification reads for their CRC-32: those DCP cannot check as it loads them."""
        if not self.verify_checksums:
            return False
        if name == METADATA or name.startswith("elastrain-rank-"):
            return False  # read once, and checked, by _load
        return not entry.chunks

    def _load(self, d: layout.StepDir, marker: layout.CommitMarker) -> RestoreInfo | None:
        entries = marker.files if self.verify_checksums else None
        problem: list[Any] | None = None  # [why, tampered]
        try:
            md = read_metadata(d.path, self.storage, entries.get(METADATA) if entries else None)
            pickled = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
            if pickled:  # elastrain gives DCP tensors only: bytes (unpickled by DCP) were put there by hand
                raise CheckpointTamperedError(
                    f"{d.path}/{METADATA} stores {', '.join(sorted(pickled)[:3])} as pickled bytes, which elastrain "
                    "never writes"
                )
            if self.rank == 0:
                issues = metadata_problems(d.path, md, self.storage)
                if issues:
                    problem = [f"{d.path}: " + "; ".join(issues), False]
        except (CheckpointCorruptError, OSError) as e:
            problem = [str(e), isinstance(e, CheckpointTamperedError)]
        agreed = self._commit.agree(problem)
        if agreed is not None:
            self._commit.reject(d, str(agreed[0]), tampered=bool(agreed[1]))
            return None
        tensors, _ = self.registry.collect()
        names = set(self.registry.names)
        saved_keys = {k for k in md.state_dict_metadata if k.split("/", 1)[0] in names}
        md.state_dict_metadata = {k: md.state_dict_metadata[k] for k in saved_keys}
        check_fits(md, tensors, d.path)  # raises CheckpointMismatchError on every rank alike
        error: list[Any] | None = None  # [why, tampered]
        saved_plain: dict[str, Any] = {}
        rng: dict[str, Any] | None = None
        try:
            self._dirty = True
            dcp_load(
                tensors,
                storage_reader=reader_for(d.path, entries),
                planner=load_planner(),
                process_group=self._io.pg,
                no_dist=not self._io.distributed,
            )
            saved_plain = self._read_sidecar(d, 0, entries)["state"]
            if self.rank < marker.world_size:
                rng = self._read_sidecar(d, self.rank, entries)["rng"]
        except (Exception, CheckpointException) as e:
            error = [f"{d.path}: load failed: {root_cause(e)}", is_tampering(e)]
        agreed = self._commit.agree(error)
        if agreed is not None:
            self._commit.reject(d, str(agreed[0]), tampered=bool(agreed[1]))
            return None
        try:
            self.registry.apply(saved_plain, tensors, d.path)
        except CheckpointMismatchError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatchError(f"{d.path}: saved state does not fit the registered objects: {e}") from e
        self._dirty = False
        if rng is not None:
            restore_rng(rng)
        return RestoreInfo(step=marker.step, path=d.path, world_size=marker.world_size)

    def _read_sidecar(self, d: layout.StepDir, rank: int, entries: Any) -> dict[str, Any]:
        name = _sidecar(rank)
        data = self.storage.read_bytes(self.storage.join(d.path, name))
        check_crc(data, entries.get(name) if entries else None, f"{d.path}/{name}")
        sidecar: dict[str, Any] = json.loads(data)
        return sidecar
