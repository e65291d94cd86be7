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
marker is there. The marker is written by rank 0 after every rank fsynced its files and checksummed
its share; DeepSpeed's ``latest`` file is never written nor read (DeepSpeed writes it before the
other ranks' shards are done). On restore every rank verifies its share of the newest committed
step; at the world size it was saved at it loads natively, at any other it is converted once to
DeepSpeed's universal format (:mod:`elastrain.integrations.ds_universal`) and loaded from there.
Checkpoint directories must be shared by all nodes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastrain.checkpoint import layout
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.settings import check_schedule, resolve_root
from elastrain.checkpoint.state import Stateful
from elastrain.checkpoint.storage import LocalStorage, fsync_dir
from elastrain.control import ControlChannel, hold_for_restart
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from elastrain.integrations import ds_universal
from elastrain.integrations.ds_config import DeepSpeedBatch, elastic_config, loss_multiplier
from elastrain.log import configure, lifecycle

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
    """Complete, verified DeepSpeed checkpoints that load at any world size. Construct on every rank."""

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
    ) -> None:
        env = WorkerEnv.from_environ()
        root = resolve_root(directory, env.checkpoint_dir, "DeepSpeedCheckpointer")
        check_schedule(keep_last, interval_steps)
        self.engine = engine
        self.root = os.path.abspath(root)
        self.keep_last = keep_last
        self.interval_steps = interval_steps
        self.verify_checksums = verify_checksums
        self.conversion_timeout_s = conversion_timeout_s
        self.hold_after_request_s = hold_after_request_s
        self.storage = LocalStorage()
        os.makedirs(self.root, exist_ok=True)
        self._group = Group(None, env.collective_timeout_s)
        # Ranks other than 0 wait in this group while rank 0 converts a checkpoint (seconds to minutes).
        self._slow = Group(None, conversion_timeout_s + 60.0)
        self.rank, self.world_size = self._group.rank, self._group.world_size
        self._channel = ControlChannel(env.control_dir) if env.control_dir else None
        self._is_local_leader = env.local_rank == 0
        self._extras: dict[str, Stateful] = {}
        self._bad_steps: set[int] = set()
        self._last_saved_step: int | None = None

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

    def _log(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        if self.rank == 0 or level >= logging.WARNING:
            lifecycle(event, level=level, rank=self.rank, **fields)

    # -- saving ----------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> bool:
        """Call after every optimizer step: saves every ``interval_steps`` or when the launcher asks."""
        due = self.interval_steps is not None and step % self.interval_steps == 0
        requested = self._channel is not None and self._channel.pending() is not None
        if self._channel is not None:
            due_all, requested_all = self._group.all_max([int(due), int(requested)])
            due, requested = bool(due_all), bool(requested_all)
        if not (due or requested) or step == self._last_saved_step:
            return False
        if not requested:
            return self.save(step, reason="interval")
        saved = self.save(step, reason="request")
        hold_for_restart(self.hold_after_request_s, step, self._log)
        return saved

    def save(self, step: int, reason: str = "explicit") -> bool:
        """Save ``step`` (collective) and commit it; False if that step is already committed."""
        t0 = time.perf_counter()
        tag = layout.step_dir_name(step)
        path = os.path.join(self.root, tag)
        if not self._group.broadcast(self._prepare_step_dir(step, path) if self.rank == 0 else None):
            self._last_saved_step = step
            return False
        request = None
        if self._channel is not None:
            request = self._channel.current_request()
            if request is not None:
                self._channel.mark_handled(request.request_id)
        self._log("checkpoint_save_started", step=step, path=path, reason=reason, format=KIND)
        self.engine.save_checkpoint(self.root, tag=tag, client_state={"elastrain_step": step}, save_latest=False)
        if self.rank == 0:
            state = {"format": 1, "step": step, "objects": {n: o.state_dict() for n, o in self._extras.items()}}
            self.storage.write_atomic(os.path.join(path, STATE_FILE), json.dumps(state).encode())
        # DeepSpeed's last barrier means every rank's torch.save returned; make this rank's files durable.
        names = self._group.broadcast(self._checkpoint_files(path) if self.rank == 0 else None)
        for name in names:
            if self._wrote(name):
                _fsync_file(os.path.join(path, name))
        mine = layout.manifest(path, layout.share(names, self.rank, self.world_size), self.verify_checksums)
        parts = self._group.all_gather(mine)
        ok = True
        if self.rank == 0:
            entries: dict[str, layout.FileEntry] = {}
            for part in parts:
                entries.update(part)
            fsync_dir(path)
            extra = {"zero_stage": int(self.engine.zero_optimization_stage()), "deepspeed_tag": tag}
            marker = layout.CommitMarker(step=step, world_size=self.world_size, files=entries, kind=KIND, extra=extra)
            try:
                layout.write_commit_marker(path, marker)
            except OSError as e:
                self._log("checkpoint_save_failed", logging.ERROR, step=step, error=str(e))
                ok = False
        if not self._group.broadcast(ok):
            raise CheckpointError(f"{path}: rank 0 could not write the commit marker")
        self._last_saved_step = step
        total = time.perf_counter() - t0
        self._log("checkpoint_committed", step=step, path=path, total_s=total, format=KIND)
        if request is not None and self._channel is not None and self._is_local_leader:
            self._channel.ack(request.request_id, step, path)
        if self.rank == 0:
            self._purge()
        return True

    def _prepare_step_dir(self, step: int, path: str) -> bool:
        """Rank 0: whether to save into ``path``; removes a leftover of a killed or rejected save there."""
        if not os.path.exists(path):
            return True
        if step not in self._bad_steps and os.path.exists(os.path.join(path, layout.MARKER)):
            self._log("checkpoint_save_skipped", step_dir=path, why="already committed; never overwritten")
            return False
        self._log("checkpoint_purged", removed=path, why="incomplete or rejected leftover; replaced")
        layout.remove_step_dir(path, self.storage)
        return True

    def _checkpoint_files(self, path: str) -> list[str]:
        """Every file of the DeepSpeed checkpoint in ``path`` (not the universal cache, not the marker)."""
        return [
            f
            for f in self.storage.walk_files(path)
            if f != layout.MARKER and not f.startswith((ds_universal.UNIVERSAL + "/", ".universal-"))
        ]

    def _wrote(self, name: str) -> bool:
        """Whether this rank wrote ``name``: its own ``zero_pp_rank_<dp>_*`` shards, and rank 0 the rest."""
        m = _RANK_FILE.match(os.path.basename(name))
        if m is None:
            return self.rank == 0
        return int(m.group(1)) == int(getattr(self.engine, "global_rank", self.rank))

    def _purge(self) -> None:
        layout.purge_and_log(self.root, self.keep_last, self._bad_steps, self.storage, self._log)

    # -- restoring -------------------------------------------------------------------------------
    def restore(self) -> DeepSpeedRestoreInfo | None:
        """Load the newest complete checkpoint every rank verified, at any world size; ``None`` if none."""
        t0 = time.perf_counter()
        dirs: list[layout.StepDir] = self._group.broadcast(
            layout.list_step_dirs(self.root, self.storage) if self.rank == 0 else None
        )
        for d in reversed(dirs):
            if not d.committed:
                self._log("checkpoint_skipped", path=d.path, why="no commit marker (a save that never finished)")
                continue
            problem = self._verify(d.path, self.verify_checksums)
            if problem is not None:
                self._reject(d, problem)
                continue
            marker = layout.read_commit_marker(d.path, self.storage)
            if marker.kind != KIND:
                raise CheckpointMismatchError(
                    f"{d.path} is a {marker.kind!r} checkpoint, not a DeepSpeed one: give the DeepSpeed run its "
                    "own --checkpoint-dir"
                )
            stage = int(self.engine.zero_optimization_stage())
            universal = marker.world_size != self.world_size or marker.extra.get("zero_stage", stage) != stage
            load_dir, tag = self.root, os.path.basename(d.path)
            if universal:
                converted = self._universal(d, marker)
                if converted is None:
                    continue
                load_dir, tag = d.path, ds_universal.UNIVERSAL
            self._load(load_dir, tag, universal, d.path)
            self._apply_extras(d.path)
            self._last_saved_step = marker.step
            info = DeepSpeedRestoreInfo(
                step=marker.step,
                path=d.path,
                world_size=marker.world_size,
                universal=universal,
                seconds=time.perf_counter() - t0,
            )
            self._log(
                "checkpoint_restored",
                step=info.step,
                path=info.path,
                world_size=f"{info.world_size}->{self.world_size}",
                universal=universal,
                seconds=info.seconds,
                format=KIND,
            )
            if self.rank == 0:
                self._purge()
            self._group.barrier()
            return info
        self._log("checkpoint_restored", step=None, path=self.root, why="no complete checkpoint; starting fresh")
        return None

    def _reject(self, d: layout.StepDir, problem: str) -> None:
        self._bad_steps.add(d.step)
        self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problem)

    def _verify(self, path: str, checksum: bool) -> str | None:
        """Every rank checks its share of ``path``'s files against its marker; the first problem found."""
        problem: str | None = None
        try:
            layout.verify_step(path, checksum, self.rank, self.world_size, self.storage)
        except CheckpointCorruptError as e:
            problem = str(e)
        except OSError as e:
            problem = f"{path}: {type(e).__name__}: {e}"
        return next((p for p in self._group.all_gather(problem) if p is not None), None)

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
            error = self._verify(str(ds_universal.universal_dir(d.path)), checksum=False)
        if error is not None:
            self._reject(d, error)
            return None
        return str(ds_universal.universal_dir(d.path))

    def _load(self, load_dir: str, tag: str, universal: bool, where: str) -> None:
        config = self.engine._config
        previous = bool(config.load_universal_checkpoint)
        config.load_universal_checkpoint = universal
        error: str | None = None
        try:
            load_path, _ = self.engine.load_checkpoint(load_dir, tag=tag)
            if load_path is None:
                error = f"{where}: DeepSpeed found nothing to load in {os.path.join(load_dir, tag)}"
        except Exception as e:  # DeepSpeed raises assorted types; every rank reports its own
            error = f"{where}: DeepSpeed load failed on rank {self.rank}: {type(e).__name__}: {e}"
        finally:
            config.load_universal_checkpoint = previous
        errors = [e for e in self._group.all_gather(error) if e is not None]
        if errors:
            raise CheckpointMismatchError(errors[0])

    def _apply_extras(self, path: str) -> None:
        try:
            state = json.loads(self.storage.read_bytes(os.path.join(path, STATE_FILE)))
        except FileNotFoundError:
            state = {"objects": {}}
        saved = state.get("objects", {})
        missing = [n for n in self._extras if n not in saved]
        if missing:
            raise CheckpointMismatchError(
                f"{path} has no state for {', '.join(missing)} (saved: {', '.join(sorted(saved)) or 'nothing'}); "
                "register the same objects that were saved, or start a fresh --checkpoint-dir"
            )
        for name, obj in self._extras.items():
            obj.load_state_dict(saved[name])

    def close(self) -> None:
        """Release the checkpointer's process groups."""
        self._group.destroy()
        self._slow.destroy()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
