"""Writing one DCP save and committing it: the writer thread's half of a save (or the training thread's, for a
blocking one).

The training thread builds a :class:`SaveJob` (the staged tensors, the sidecar with the plain state and
RNG); :class:`DcpWriter` finishes the staging copy (which releases ``optimizer.step()``), writes with
DCP (CRC-32s computed as the bytes are written, :mod:`elastrain.checkpoint.dcp_io`), writes this rank's
sidecar, and commits through :mod:`elastrain.checkpoint.commit`; then the save trigger tells the launcher.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import Commit, entry_of, save_error
from elastrain.checkpoint.dcp_io import METADATA, root_cause, writer_for, written_files
from elastrain.checkpoint.dcp_load import sidecar_name
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.rng import capture_rng
from elastrain.checkpoint.schedule import SaveTrigger
from elastrain.checkpoint.staging import Stager
from elastrain.checkpoint.state import Registry
from elastrain.control import SaveRequest
from elastrain.storage import Storage


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    stall_s: float
    total_s: float
    step_wait_s: float = 0.0  # optimizer.step() waiting for the overlapped staging copy


@dataclass
class SaveJob:
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
    bound: float = math.inf  # the latest time it answers requests up to (SaveTrigger.bound)
    stall_s: float = 0.0
    waited_at_start: float = 0.0
    given_up: threading.Event = field(default_factory=threading.Event)
    """Set when the checkpointer gave this save up (:meth:`Checkpointer.close` with a bound): it writes and commits
    nothing more."""


class DcpWriter:
    """Writes and commits save jobs for one checkpointer; ``rank`` and ``world_size`` are its I/O group's."""

    def __init__(
        self,
        stager: Stager,
        storage: Storage,
        io: Group,
        commit: Commit,
        trigger: SaveTrigger,
        thread_count: Callable[[], int],
        log: Callable[..., None],
    ) -> None:
        self.stager = stager
        self.storage = storage
        self.io = io
        self.commit = commit
        self.trigger = trigger
        self.thread_count = thread_count
        self.log = log
        self.rank, self.world_size = io.rank, io.world_size

    def job(
        self,
        registry: Registry,
        step: int,
        path: str,
        request: SaveRequest | None,
        t0: float,
        sync: bool,
        defer_answer: bool,
        bound: float,
    ) -> SaveJob:
        """Training thread: the save of ``step`` into ``path``, its state collected (and staged unless ``sync``)."""
        tensors, plain = registry.collect()
        # A blocking save writes the live tensors; an async one a staged copy that training cannot touch.
        staged, deferred = (tensors, {}) if sync else self.stager.stage(tensors)
        sidecar: dict[str, Any] = {"format": 1, "step": step, "rank": self.rank, "world_size": self.world_size}
        sidecar.update(state=plain, rng=capture_rng())
        job = SaveJob(
            staged,
            deferred,
            sidecar=sidecar,
            step=step,
            path=path,
            request=request,
            t0=t0,
            synchronous=sync,
            captured_at=time.time(),
            defer_answer=defer_answer,
            bound=bound,
        )
        job.stall_s = time.perf_counter() - t0
        job.waited_at_start = self.stager.waited_s
        return job

    def write_and_commit(self, job: SaveJob) -> SaveResult:
        """Writer thread (or the training thread, for a blocking save): write, report, commit."""
        step, path = job.step, job.path
        try:
            job.staged = self.stager.finish(job.staged, job.deferred)  # releases optimizer.step()
            writer = writer_for(path, self.thread_count(), job.given_up)
            md = dcp_save(
                job.staged,
                storage_writer=writer,
                process_group=self.io.pg,
                no_dist=not self.io.distributed,
            )
        except (Exception, CheckpointException) as e:
            # DCP gathers every rank's failure and raises on all of them: no rank waits in a collective.
            raise save_error(path, step, root_cause(e)) from None
        finally:
            self.stager.release()
            job.staged, job.deferred = {}, {}  # written (or failed): the staged copies are not needed any more
        _refuse_if_given_up(job)
        error: str | None = None
        report: dict[str, layout.FileEntry] | None = None
        try:
            data = json.dumps(job.sidecar).encode()
            self.storage.write_atomic(self.storage.join(path, sidecar_name(self.rank)), data)
            report = written_files(writer, md)
            report[sidecar_name(self.rank)] = entry_of(data)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        expected = {str(info.relative_path) for info in (md.storage_data or {}).values()}
        expected |= {METADATA} | {sidecar_name(r) for r in range(self.world_size)}
        _refuse_if_given_up(job)
        self.commit.commit(step, path, report, error, expected=expected)
        total = time.perf_counter() - job.t0
        # stall: the training thread inside save(); step_wait: optimizer.step() waiting for the staging copy.
        step_wait = self.stager.waited_s - job.waited_at_start
        self.log(
            "checkpoint_committed", step=step, path=path, stall_s=job.stall_s, step_wait_s=step_wait, total_s=total
        )
        # A blocking save held training until now; an async one holds the state of when it was staged.
        current_at = time.time() if job.synchronous else job.captured_at
        self.trigger.committed(step, path, current_at, bound=job.bound, defer_answer=job.defer_answer)
        return SaveResult(step=step, path=path, stall_s=job.stall_s, total_s=total, step_wait_s=step_wait)


def _refuse_if_given_up(job: SaveJob) -> None:
    """A save its checkpointer gave up writes no sidecar and commits nothing (its world broke meanwhile)."""
    if job.given_up.is_set():
        raise save_error(job.path, job.step, "given up by its checkpointer (its world broke): not committed")
