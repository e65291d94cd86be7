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
thread, before the next ``optimizer.step()``), then the writer thread saves it with DCP, checksums
the files, gathers every rank's confirmation and lets rank 0 write the commit marker (see
:mod:`elastrain.checkpoint.layout`). ``wait()`` blocks until that commit.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrain.checkpoint import layout
from elastrain.checkpoint.dcp_io import METADATA, check_fits, metadata_problems, read_metadata, reader_for, writer_for
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.rng import capture_rng, restore_rng
from elastrain.checkpoint.settings import check_schedule, resolve_root
from elastrain.checkpoint.staging import Stager
from elastrain.checkpoint.state import Registry
from elastrain.checkpoint.storage import storage_for
from elastrain.control import ControlChannel, SaveRequest, hold_for_restart
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from elastrain.log import lifecycle

SIDECAR = "elastrain-rank-{rank:05d}.json"
# DCP warns on every single-process save/load; a one-process checkpointer is intended here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

# Saved this often when neither interval is given (pass interval_seconds=math.inf for "on request only").
DEFAULT_INTERVAL_SECONDS = 300.0


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
    stall_s: float = 0.0
    waited_at_start: float = 0.0


def _sidecar(rank: int) -> str:
    return SIDECAR.format(rank=rank)


class Checkpointer:
    """Saves and restores registered state.

    Construct it on every rank after ``torch.distributed.init_process_group`` (it creates two gloo
    groups of its own, with ``ELASTRAIN_COLLECTIVE_TIMEOUT``); without an initialized process
    group it works as a single process. ``save``, ``maybe_save`` and ``restore`` are collective:
    every rank calls them with the same step. With neither interval given it saves every
    :data:`DEFAULT_INTERVAL_SECONDS`; pass ``interval_seconds=math.inf`` to save only on request.

    A save that answers the launcher's request (an announced membership change is coming) is
    synchronous, and afterwards the training thread holds for up to ``hold_after_request_s`` for the
    restart the launcher is about to do, so that no step runs past the checkpoint only to be redone.
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
    ) -> None:
        env = WorkerEnv.from_environ()
        root = resolve_root(directory, env.checkpoint_dir, "Checkpointer")
        check_schedule(keep_last, interval_steps, interval_seconds)
        if sync_every_steps < 1:
            raise CheckpointError(f"sync_every_steps must be >= 1, got {sync_every_steps}")
        self.root = root
        self.keep_last = keep_last
        self.interval_steps = interval_steps
        if interval_steps is None and interval_seconds is None:
            interval_seconds = DEFAULT_INTERVAL_SECONDS
        self.interval_seconds = interval_seconds
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.thread_count = thread_count
        self.sync_every_steps = sync_every_steps
        self.storage = storage_for(self.root)
        self.storage.makedirs(self.root)
        self.registry = Registry()
        # One group for the training thread, one for the background writer.
        self._sync = Group(process_group, env.collective_timeout_s)
        self._save_group = Group(process_group, env.collective_timeout_s)
        self.rank, self.world_size = self._sync.rank, self._sync.world_size
        self._is_local_leader = env.local_rank == 0
        self._channel = ControlChannel(env.control_dir) if env.control_dir else None
        self._stager = Stager(self.registry, overlap=overlap_staging)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastrain-ckpt")
        self._inflight: Future[SaveResult] | None = None
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._bad_steps: set[int] = set()
        self.last_result: SaveResult | None = None
        self.last_error: BaseException | None = None
        self._closed = False
        self.hold_after_request_s = hold_after_request_s

    # -- registration ----------------------------------------------------------------------------
    def register(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **more: Any
    ) -> None:
        """What to save: the model, its optimizer and any ``Stateful`` (scheduler, train state, sampler)."""
        self.registry.register(model=model, optimizer=optimizer, **more)

    def _log(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        if self.rank == 0 or level >= logging.WARNING:
            lifecycle(event, level=level, rank=self.rank, **fields)

    # -- saving ----------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> bool:
        """Call at every step boundary: save on the interval or on a pending launcher request."""
        self._reap()
        due = self.interval_steps is not None and step % self.interval_steps == 0
        timed = self.interval_seconds is not None and time.monotonic() - self._last_save_time >= self.interval_seconds
        requested = self._channel is not None and self._channel.pending() is not None
        if self._sync.distributed and (self.interval_seconds is not None or self._channel is not None):
            if step % self.sync_every_steps == 0:
                timed_all, requested_all = self._sync.all_max([int(timed), int(requested)])
                timed, requested = bool(timed_all), bool(requested_all)
            else:
                timed = requested = False
        if not (due or timed or requested) or step == self._last_saved_step:
            return False
        if not requested:
            return self.save(step, blocking=not self.async_save, reason="interval")
        saved = self.save(step, blocking=True, reason="request")
        hold_for_restart(self.hold_after_request_s, step, self._log)
        return saved

    def _claim_request(self) -> SaveRequest | None:
        """The launcher's request this save answers (any request made before now), marked handled."""
        if self._channel is None:
            return None
        req = self._channel.pending()
        if req is None:
            return None
        self._channel.mark_handled(req.request_id)
        return req

    def save(self, step: int, blocking: bool = False, reason: str = "explicit") -> bool:
        """Save ``step`` on every rank (collective). Returns False if that step is already saved."""
        if self._closed:
            raise CheckpointError("save() after close(): create a new Checkpointer")
        self.wait()
        path = self.storage.join(self.root, layout.step_dir_name(step))
        go = self._sync.broadcast(self._prepare_step_dir(step, path) if self.rank == 0 else None)
        if not go:
            self._last_saved_step = step
            return False
        request = self._claim_request()
        t0 = time.perf_counter()
        request_id = request.request_id if request else None
        self._log("checkpoint_save_started", step=step, path=path, reason=reason, request=request_id)
        tensors, plain = self.registry.collect()
        sync = blocking or not self.async_save
        # A blocking save writes the live tensors; an async one a staged copy that training cannot touch.
        staged, deferred = (tensors, {}) if sync else self._stager.stage(tensors)
        sidecar: dict[str, Any] = {"format": 1, "step": step, "rank": self.rank, "world_size": self.world_size}
        sidecar.update(state=plain, rng=capture_rng())
        job = _SaveJob(staged, deferred, sidecar=sidecar, step=step, path=path, request=request, t0=t0)
        job.stall_s = time.perf_counter() - t0
        job.waited_at_start = self._stager.waited_s
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        if sync:
            self._finish(self._write_and_commit(job))
        else:
            self._inflight = self._executor.submit(self._write_and_commit, job)
        return True

    def _prepare_step_dir(self, step: int, path: str) -> bool:
        """Rank 0: whether to save into ``path``; a leftover of a killed save there is removed first."""
        if not self.storage.exists(path):
            return True
        if step in self._bad_steps:
            self._log("checkpoint_purged", removed=path, why="failed verification at restore; replaced")
            layout.remove_step_dir(path, self.storage)
            self._bad_steps.discard(step)
            return True
        if self.storage.exists(self.storage.join(path, layout.MARKER)):
            self._log("checkpoint_save_skipped", step_dir=path, why="already committed; never overwritten")
            return False
        self._log("checkpoint_purged", removed=path, why="incomplete leftover of an interrupted save")
        layout.remove_step_dir(path, self.storage)
        return True

    def _write_and_commit(self, job: _SaveJob) -> SaveResult:
        job.staged = self._stager.finish(job.staged, job.deferred)  # releases optimizer.step()
        step, path, request = job.step, job.path, job.request
        self.storage.makedirs(path)
        self.storage.write_atomic(self.storage.join(path, _sidecar(self.rank)), json.dumps(job.sidecar).encode())
        md = dcp_save(
            job.staged,
            storage_writer=writer_for(path, self.thread_count),
            process_group=self._save_group.pg,
            no_dist=not self._save_group.distributed,
        )
        files = {str(info.relative_path) for info in (md.storage_data or {}).values()}
        files |= {METADATA} | {_sidecar(r) for r in range(self.world_size)}
        mine = layout.manifest(
            path, layout.share(sorted(files), self.rank, self.world_size), self.verify_checksums, self.storage
        )
        gathered = self._save_group.all_gather(mine)
        committed = True
        if self.rank == 0:
            entries: dict[str, layout.FileEntry] = {}
            for part in gathered:
                entries.update(part)
            marker = layout.CommitMarker(step=step, world_size=self.world_size, files=entries)
            try:
                layout.write_commit_marker(path, marker, self.storage)
            except OSError as e:
                self._log("checkpoint_save_failed", logging.ERROR, step=step, error=str(e))
                committed = False
        if not self._save_group.broadcast(committed):
            raise CheckpointError(f"{path}: rank 0 could not write the commit marker")
        total = time.perf_counter() - job.t0
        # stall: the training thread inside save(); step_wait: optimizer.step() waiting for the staging copy.
        step_wait = self._stager.waited_s - job.waited_at_start
        self._log(
            "checkpoint_committed", step=step, path=path, stall_s=job.stall_s, step_wait_s=step_wait, total_s=total
        )
        if request is not None and self._channel is not None and self._is_local_leader:
            self._channel.ack(request.request_id, step, path)
        if self.rank == 0:
            self._purge()
        return SaveResult(step=step, path=path, stall_s=job.stall_s, total_s=total, step_wait_s=step_wait)

    def _purge(self) -> None:
        layout.purge_and_log(self.root, self.keep_last, self._bad_steps, self.storage, self._log)

    def _finish(self, result: SaveResult | Future[SaveResult]) -> None:
        try:
            self.last_result = result.result() if isinstance(result, Future) else result
        except (Exception, CheckpointException) as e:
            self.last_error = e
            self._log("checkpoint_save_failed", logging.ERROR, error=f"{type(e).__name__}: {e}")

    def _reap(self) -> None:
        if self._inflight is not None and self._inflight.done():
            fut, self._inflight = self._inflight, None
            self._finish(fut)

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed (or failed, see ``last_error``); its result."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            self._finish(fut)
            return self.last_result
        return None

    def close(self) -> None:
        """Finish the in-flight save and release threads and process groups."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        self._executor.shutdown(wait=True)
        self._stager.close()
        self._save_group.destroy()
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
        dirs = layout.list_step_dirs(self.root, self.storage) if self.rank == 0 else None
        candidates: list[layout.StepDir] = self._sync.broadcast(dirs)
        for d in reversed(candidates):
            problem = self._verify(d)
            if problem is not None:
                self._bad_steps.add(d.step)
                self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problem)
                continue
            info = self._load(d)
            if info is None:
                continue
            self._last_saved_step = info.step
            self._last_save_time = time.monotonic()
            self._log(
                "checkpoint_restored",
                step=info.step,
                path=info.path,
                world_size=f"{info.world_size}->{self.world_size}",
                seconds=time.perf_counter() - t0,
            )
            if self.rank == 0:
                self._purge()
            self._sync.barrier()
            return info
        self._log("checkpoint_restored", step=None, path=self.root, why="no complete checkpoint; starting fresh")
        return None

    def _verify(self, d: layout.StepDir) -> str | None:
        """Every rank checks its share of the files; the first problem any rank found, or ``None``."""
        problem: str | None = None
        try:
            layout.verify_step(d.path, self.verify_checksums, self.rank, self.world_size, self.storage)
            if self.rank == 0:
                issues = metadata_problems(d.path, read_metadata(d.path, self.storage), self.storage)
                if issues:
                    problem = f"{d.path}: " + "; ".join(issues)
        except CheckpointCorruptError as e:
            problem = str(e)
        except OSError as e:
            problem = f"{d.path}: {type(e).__name__}: {e}"
        verdicts = self._sync.all_gather(problem)
        return next((p for p in verdicts if p is not None), None)

    def _load(self, d: layout.StepDir) -> RestoreInfo | None:
        problem: str | None = None
        try:
            marker = layout.read_commit_marker(d.path, self.storage)
            md = read_metadata(d.path, self.storage)
        except (CheckpointCorruptError, OSError) as e:
            problem = str(e)
        problems = [p for p in self._sync.all_gather(problem) if p is not None]
        if problems:
            self._bad_steps.add(d.step)
            self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problems[0])
            return None
        tensors, _ = self.registry.collect()
        names = set(self.registry.names)
        saved_keys = {k for k in md.state_dict_metadata if k.split("/", 1)[0] in names}
        md.state_dict_metadata = {k: md.state_dict_metadata[k] for k in saved_keys}
        check_fits(md, tensors, d.path)  # raises CheckpointMismatchError on every rank alike
        error: str | None = None
        saved_plain: dict[str, Any] = {}
        rng: dict[str, Any] | None = None
        try:
            dcp_load(
                tensors,
                storage_reader=reader_for(d.path),
                process_group=self._sync.pg,
                no_dist=not self._sync.distributed,
            )
            head = json.loads(self.storage.read_bytes(self.storage.join(d.path, _sidecar(0))))
            saved_plain = head["state"]
            if self.rank < marker.world_size:
                rng = json.loads(self.storage.read_bytes(self.storage.join(d.path, _sidecar(self.rank))))["rng"]
        except (Exception, CheckpointException) as e:
            error = f"{d.path}: load failed: {type(e).__name__}: {e}"
        errors = [e for e in self._sync.all_gather(error) if e is not None]
        if errors:
            self._bad_steps.add(d.step)
            self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=errors[0])
            return None
        try:
            self.registry.apply(saved_plain, tensors, d.path)
        except CheckpointMismatchError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatchError(f"{d.path}: saved state does not fit the registered objects: {e}") from e
        if rng is not None:
            restore_rng(rng)
        return RestoreInfo(step=marker.step, path=d.path, world_size=marker.world_size)
