"""DeepSpeed engines that survive a change of world size: complete checkpoints, universal conversion, batch rescaling.

Inside a DeepSpeed training script started by ``elastrain-run``::

    from elastrain.integrations import deepspeed as eds

    env = eds.init_distributed()                       # gloo on CPU, the launcher's collective timeout
    config, batch = eds.elastic_config(user_config, env.world_size)   # global batch kept
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ckpt = eds.DeepSpeedCheckpointer(engine, keep_last=2)
    ckpt.register(train_state=state, sampler=sampler)  # world-size independent extras (JSON)
    info = ckpt.restore()                              # newest complete checkpoint, any world size
    ...
    ckpt.maybe_save(step)                              # every N steps, or when the launcher asks

Checkpoints are DeepSpeed's own folders in elastrain's layout (:mod:`elastrain.checkpoint.layout`):
``<root>/step-N/`` holds what ``engine.save_checkpoint`` wrote, and counts only once the commit
marker is there. They go through elastrain's one commit protocol (:mod:`elastrain.checkpoint.commit`):
every rank fsyncs and checksums the files it wrote, and rank 0 commits from the ranks' reports;
DeepSpeed's ``latest`` file is never written nor read (DeepSpeed writes it before the other ranks'
shards are done). DeepSpeed's own save and load barriers run with ``--io-timeout``. On restore every
rank verifies its share of the newest committed step; at the world size it was saved at it loads
natively, at any other it is converted once to DeepSpeed's universal format
(:mod:`elastrain.integrations.ds_universal`) and loaded from there. A failed save raises
:class:`~elastrain.errors.CheckpointSaveError` unless ``on_save_error="warn"``. Checkpoint
directories must be shared by all nodes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import PROTOCOL_FILES, entry_of, fsync_and_checksum
from elastrain.checkpoint.group import Group, default_group_timeout
from elastrain.checkpoint.parts import CheckpointParts
from elastrain.checkpoint.schedule import SaveReason, SaveSchedule
from elastrain.checkpoint.state import Stateful
from elastrain.env import WorkerEnv
from elastrain.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from elastrain.integrations import ds_universal
from elastrain.integrations.ds_config import DeepSpeedBatch, elastic_config, loss_multiplier
from elastrain.log import configure
from elastrain.storage import LocalStorage, Storage, fsync_dir

__all__ = [
    "DeepSpeedBatch",
    "DeepSpeedCheckpointer",
    "DeepSpeedRestoreInfo",
    "elastic_config",
    "init_distributed",
    "loss_multiplier",
]

KIND = "deepspeed"
STATE_FILE = "elastrain-state.json"
_SHM_OP = "deepspeed_shm_comm"
_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_")


def init_distributed(timeout_s: float | None = None, *, cpu_shm_op: bool = False) -> WorkerEnv:
    """``deepspeed.init_distributed`` for a worker started by elastrain-run; returns its :class:`WorkerEnv`.

    The timeout defaults to the launcher's ``--collective-timeout`` (DeepSpeed's own is 30 minutes,
    which turns a dead peer into a 30-minute hang). On CPU, DeepSpeed compiles a shared-memory
    all-reduce op on first use (about two minutes on a busy 2-core machine) that only its inference
    all-reduce uses; ``cpu_shm_op=False`` skips that compile, and training is unaffected.
    """
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    configure()
    env = WorkerEnv.from_environ()
    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    if on_cpu and not cpu_shm_op:
        deepspeed.ops.__compatible_ops__[_SHM_OP] = False
    timeout = timeout_s if timeout_s is not None else env.collective_timeout_s
    kwargs: dict[str, Any] = {"dist_backend": "gloo" if on_cpu else accelerator.communication_backend_name()}
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    deepspeed.init_distributed(**kwargs)
    return env


@dataclass(frozen=True)
class DeepSpeedRestoreInfo:
    """The checkpoint :meth:`DeepSpeedCheckpointer.restore` loaded."""

    step: int
    path: str
    world_size: int
    """The world size it was saved at."""
    universal: bool
    """Whether it was loaded through the universal format (the world size changed)."""
    seconds: float


class DeepSpeedCheckpointer:
    """Complete, verified DeepSpeed checkpoints that load at any world size. Construct on every rank.

    ``env``: the worker's environment (default: read from the process's).
    """

    def __init__(
        self,
        engine: Any,
        directory: str | os.PathLike[str] | None = None,
        keep_last: int = 2,
        interval_steps: int | None = None,
        *,
        verify_checksums: bool = True,
        conversion_timeout_s: float = 1800.0,
        hold_after_request_s: float = 5.0,
        on_save_error: Literal["raise", "warn"] = "raise",
        env: WorkerEnv | None = None,
    ) -> None:
        env = env if env is not None else WorkerEnv.from_environ()
        parts = CheckpointParts(
            "DeepSpeedCheckpointer",
            directory,
            env,
            kind=KIND,
            keep_last=keep_last,
            on_save_error=on_save_error,
            schedule=lambda: SaveSchedule(interval_steps=interval_steps, hold_after_request_s=hold_after_request_s),
            storage=lambda _root: LocalStorage(),
            absolute_root=True,
        )
        self.engine = engine
        self.root = parts.root
        self.keep_last = keep_last
        self.verify_checksums = verify_checksums
        self.conversion_timeout_s = conversion_timeout_s
        self.on_save_error = on_save_error
        self.storage = parts.storage
        self._collective_timeout_s = env.collective_timeout_s
        self._io_timeout_s = env.io_timeout_s
        self._group = parts.sync  # agreeing when to save
        self._io = parts.io  # the commit protocol: waits on storage
        # Ranks other than 0 wait in this group while rank 0 converts a checkpoint (seconds to minutes).
        self._slow = Group(None, conversion_timeout_s + 60.0)
        self.rank, self.world_size = parts.rank, parts.world_size
        self._log = parts.log
        self._trigger = parts.trigger
        self._commit = parts.commit
        self._extras: dict[str, Stateful] = {}
        self.last_error: CheckpointSaveError | None = None

    @property
    def schedule(self) -> SaveSchedule:
        """When this checkpointer saves; assign a new one to change it from the next step on."""
        return self._trigger.schedule

    @schedule.setter
    def schedule(self, schedule: SaveSchedule) -> None:
        self._trigger.schedule = schedule

    def register(self, **objects: Any) -> None:
        """World-size independent objects saved beside the engine (``state_dict()`` of plain JSON data)."""
        for name, obj in objects.items():
            if obj is None:
                continue
            if not isinstance(obj, Stateful):
                raise CheckpointError(
                    f"register({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict()"
                )
            self._extras[name] = obj

    def _io_timeouts(self) -> Any:
        """DeepSpeed's own barriers (on the default group) wait on storage while it saves or loads."""
        return default_group_timeout(self._io_timeout_s, self._collective_timeout_s)

    # -- saving ----------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> bool:
        """Call after every optimizer step: saves every ``interval_steps`` or when the launcher asks."""
        reason = self._trigger.check(step)
        if reason is None:
            return False
        saved = self.save(step, reason=reason.value)
        if saved and reason is SaveReason.REQUEST:
            self._trigger.hold(step)
        return saved

    def save(self, step: int, reason: str = "explicit") -> bool:
        """Save ``step`` (collective) and commit it; False if that step is already committed.

        A failure raises :class:`CheckpointSaveError` naming the path and the cause (with
        ``on_save_error="warn"``: logged, and False).
        """
        t0 = time.perf_counter()
        try:
            path = self._commit.prepare(step)
            if path is None:
                self._trigger.started(step)
                return False
            request = self._trigger.claim(reason)
            bound = self._trigger.bound(reason)  # a save training goes on from answers only the requests agreed on
            self._log("checkpoint_save_started", step=step, path=path, reason=reason, format=KIND)
            self._trigger.started(step)
            self._write_and_commit(step, path)
        except CheckpointSaveError as e:
            self.last_error = e
            self._log("checkpoint_save_failed", logging.ERROR, error=str(e), on_save_error=self.on_save_error)
            if self.on_save_error == "raise":
                raise
            return False
        total = time.perf_counter() - t0
        request_id = request.request_id if request else None
        self._log("checkpoint_committed", step=step, path=path, total_s=total, format=KIND, request=request_id)
        self._trigger.committed(step, path, time.time(), bound=bound)  # synchronous: training waited for the commit
        return True

    def _write_and_commit(self, step: int, path: str) -> None:
        tag = os.path.basename(path)
        error: str | None = None
        report: dict[str, layout.FileEntry] | None = None
        try:
            with self._io_timeouts():
                self.engine.save_checkpoint(
                    self.root, tag=tag, client_state={"elastrain_step": step}, save_latest=False
                )
            report = {}
            if self.rank == 0:
                state = {"format": 1, "step": step, "objects": {n: o.state_dict() for n, o in self._extras.items()}}
                data = json.dumps(state).encode()
                self.storage.write_atomic(os.path.join(path, STATE_FILE), data)
                report[STATE_FILE] = entry_of(data)
            # DeepSpeed's last barrier means every rank's torch.save returned; make this rank's files durable.
            engine_rank = int(getattr(self.engine, "global_rank", self.rank))
            for name in _checkpoint_files(self.storage, path):
                if name != STATE_FILE and _wrote(name, self.rank, engine_rank):
                    report[name] = fsync_and_checksum(os.path.join(path, name), self.verify_checksums)
            if self.rank == 0:
                fsync_dir(path)
        except Exception as e:  # DeepSpeed raises assorted types; every rank reports its own
            error = f"{type(e).__name__}: {e}"
        expected = _checkpoint_files(self.storage, path) if self.rank == 0 and error is None else None
        extra = {"zero_stage": int(self.engine.zero_optimization_stage()), "deepspeed_tag": tag}
        self._commit.commit(step, path, report, error, expected=expected, extra=extra)

    # -- restoring -------------------------------------------------------------------------------
    def restore(self) -> DeepSpeedRestoreInfo | None:
        """Load the newest complete checkpoint every rank verified, at any world size; ``None`` if none."""
        t0 = time.perf_counter()
        read_crc = (lambda name, entry: True) if self.verify_checksums else (lambda name, entry: False)
        info = self._commit.restore(lambda d, marker: self._load_step(d, marker, t0), read_crc)
        if info is None:
            self._log("checkpoint_restored", step=None, path=self.root, why="no complete checkpoint; starting fresh")
            return None
        self._trigger.started(info.step)
        self._log(
            "checkpoint_restored",
            step=info.step,
            path=info.path,
            world_size=f"{info.world_size}->{self.world_size}",
            universal=info.universal,
            seconds=info.seconds,
            format=KIND,
        )
        self._io.barrier()
        return info

    def _load_step(self, d: layout.StepDir, marker: layout.CommitMarker, t0: float) -> DeepSpeedRestoreInfo | None:
        if marker.kind != KIND:
            raise CheckpointMismatchError(
                f"{d.path} is a {marker.kind!r} checkpoint, not a DeepSpeed one: give the DeepSpeed run its "
                "own --checkpoint-dir"
            )
        stage = int(self.engine.zero_optimization_stage())
        universal = marker.world_size != self.world_size or marker.extra.get("zero_stage", stage) != stage
        load_dir, tag = self.root, os.path.basename(d.path)
        if universal:
            if self._universal(d, marker) is None:
                return None
            load_dir, tag = d.path, ds_universal.UNIVERSAL
        self._load(load_dir, tag, universal, d.path)
        _apply_extras(self.storage, self._extras, d.path)
        return DeepSpeedRestoreInfo(
            step=marker.step,
            path=d.path,
            world_size=marker.world_size,
            universal=universal,
            seconds=time.perf_counter() - t0,
        )

    def _verify_universal(self, path: str) -> str | None:
        """Every rank checks its share of the converted folder's files (lengths) against its marker."""
        problem: str | None = None
        try:
            layout.verify_step(path, False, self.rank, self.world_size, self.storage)
        except CheckpointCorruptError as e:
            problem = str(e)
        except OSError as e:
            problem = f"{path}: {type(e).__name__}: {e}"
        return self._commit.agree(problem)

    def _universal(self, d: layout.StepDir, marker: layout.CommitMarker) -> str | None:
        """Rank 0 converts (or finds the cached conversion); every rank verifies it. Its path, or None."""
        error: str | None = None
        cached = False
        if self.rank == 0:
            cached = ds_universal.committed_universal(d.path, self.verify_checksums) is not None
            t0 = time.perf_counter()
            try:
                ds_universal.convert(d.path, marker.step, marker.world_size, self.conversion_timeout_s)
            except CheckpointError as e:
                error = str(e)
            else:
                self._log(
                    "checkpoint_converted",
                    step=marker.step,
                    path=str(ds_universal.universal_dir(d.path)),
                    cached=cached,
                    seconds=time.perf_counter() - t0,
                    world_size=f"{marker.world_size}->{self.world_size}",
                )
        error = self._slow.broadcast(error)
        if error is None:
            error = self._verify_universal(str(ds_universal.universal_dir(d.path)))
        if error is not None:
            self._commit.reject(d, error)
            return None
        return str(ds_universal.universal_dir(d.path))

    def _load(self, load_dir: str, tag: str, universal: bool, where: str) -> None:
        config = self.engine._config
        previous = bool(config.load_universal_checkpoint)
        config.load_universal_checkpoint = universal
        error: str | None = None
        try:
            with self._io_timeouts():
                load_path, _ = self.engine.load_checkpoint(load_dir, tag=tag)
            if load_path is None:
                error = f"{where}: DeepSpeed found nothing to load in {os.path.join(load_dir, tag)}"
        except Exception as e:  # DeepSpeed raises assorted types; every rank reports its own
            error = f"{where}: DeepSpeed load failed on rank {self.rank}: {type(e).__name__}: {e}"
        finally:
            config.load_universal_checkpoint = previous
        error = self._commit.agree(error)
        if error is not None:
            raise CheckpointMismatchError(error)

    def close(self) -> None:
        """Training ended: a launcher's request still pending (made while the last save was written) is answered by
        that save if it holds the last step :meth:`maybe_save` was asked about; then the process groups go."""
        self._trigger.answer_at_end()
        self._group.destroy()
        self._io.destroy()
        self._slow.destroy()


def _checkpoint_files(storage: Storage, path: str) -> list[str]:
    """Every file of the DeepSpeed checkpoint in ``path`` (not the universal cache, not the marker)."""
    return [
        f
        for f in storage.walk_files(path)
        if f not in PROTOCOL_FILES and not f.startswith((ds_universal.UNIVERSAL + "/", ".universal-"))
    ]


def _wrote(name: str, rank: int, engine_rank: int) -> bool:
    """Whether this rank (``engine_rank`` in DeepSpeed's numbering) wrote ``name``: its own
    ``zero_pp_rank_<dp>_*`` shards, and rank 0 the rest."""
    m = _RANK_FILE.match(os.path.basename(name))
    if m is None:
        return rank == 0
    return int(m.group(1)) == engine_rank


def _apply_extras(storage: Storage, extras: Mapping[str, Stateful], path: str) -> None:
    """Load the registered objects' state saved beside the engine's."""
    try:
        state = json.loads(storage.read_bytes(os.path.join(path, STATE_FILE)))
    except FileNotFoundError:
        state = {"objects": {}}
    saved = state.get("objects", {})
    missing = [n for n in extras if n not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"{path} has no state for {', '.join(missing)} (saved: {', '.join(sorted(saved)) or 'nothing'}); "
            "register the same objects that were saved, or start a fresh --checkpoint-dir"
        )
    for name, obj in extras.items():
        obj.load_state_dict(saved[name])
