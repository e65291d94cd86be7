"""Rank 0's account of the run: ``events.jsonl``, ``metrics.jsonl`` and TensorBoard, one segment per world.

Every entry into a world (a start, or a live regroup) opens a new segment, whose ``start`` (or
``regroup``) event says where it began; metric points keep their format (``kind``, ``step``,
``time``, ``values``). Other ranks write nothing, but keep the points they were asked to log: rank 0 can
die after a step every member completed and before its point was stored (a SIGKILL between the optimizer step
and ``step.log``; on an object store, points wait in a buffer up to ``flush_every_s``), and the world goes on
from that step. The member that sends the agreed state (the lowest rank that holds it, whichever rank 0 is now:
a worker replaced alone takes its rank back, cold) stores the kept points the file lacks, up to that step.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from elastrain.checkpoint import RestoreInfo
from elastrain.data import ElasticSampler
from elastrain.env import WorkerEnv
from elastrain.log import lifecycle
from elastrain.metrics import (
    EVENTS_FILENAME,
    METRICS_FILENAME,
    EventsFile,
    MetricsWriter,
    TensorBoardWriter,
    read_metrics,
    tensorboard_available,
)
from elastrain.scaling import BatchPlan
from elastrain.session.config import OutputConfig
from elastrain.storage import join_path
from elastrain.train_state import TrainState

KEPT_POINTS = 1024
"""How many metric points a rank that does not write keeps, for when it becomes rank 0 (see the module doc)."""


class Records:
    """The events, metrics and TensorBoard writers of the current segment (open on rank 0 only)."""

    def __init__(self, config: OutputConfig, checkpoint_dir: str | None) -> None:
        self.metrics_dir = config.metrics_dir or checkpoint_dir
        self.tensorboard_dir = config.tensorboard_dir
        self.events = EventsFile(None)
        self.steps_rerun = 0
        """Steps logged past the restored one by an earlier start that died: computed again now."""
        self._metrics: MetricsWriter | None = None
        self._tensorboard: TensorBoardWriter | None = None
        self._kept: deque[tuple[int, dict[str, Any]]] = deque(maxlen=KEPT_POINTS)  # not written: values as given

    def open(self, env: WorkerEnv, segment: str, restored_step: int) -> None:
        """Rank 0: the segment's writers, continuing the files of earlier segments."""
        events_path = env.events_file
        if self.metrics_dir:
            events_path = events_path or join_path(self.metrics_dir, EVENTS_FILENAME)
            metrics_path = join_path(self.metrics_dir, METRICS_FILENAME)
            logged = max((p.step for p in read_metrics(metrics_path).active), default=0)
            self.steps_rerun = max(0, logged - restored_step)
            self._metrics = MetricsWriter(metrics_path, segment, restored_step)
        self._kept.clear()  # it writes from now on; what it kept is stored by the state's source (reopen)
        self.events = EventsFile(events_path, run_id=env.run_id, segment=segment)
        if self.tensorboard_dir:
            if tensorboard_available():
                self._tensorboard = TensorBoardWriter(self.tensorboard_dir, restored_step)
            else:
                lifecycle("tensorboard_unavailable", level=logging.WARNING, fix="pip install 'elastrain[tensorboard]'")

    def reopen(self, rank: int, env: WorkerEnv, segment: str, restored_step: int, source: int | None = None) -> None:
        """A new segment at an entry into a world; rank 0 (perhaps a new one) opens it, the others write nothing.
        ``source``: the rank that sent this world its agreed state (a live world's): it stores the points the metrics
        file lacks up to ``restored_step`` from those it kept (module doc)."""
        kept = list(self._kept)
        self.close_writers()
        if rank == 0:
            self.open(env, segment, restored_step)
        else:
            self.events = EventsFile(None)
        if rank == source and kept and self.metrics_dir:
            self._store_kept(kept, join_path(self.metrics_dir, METRICS_FILENAME), segment, restored_step)

    def record_start(
        self,
        env: WorkerEnv,
        world_size: int,
        restored: RestoreInfo | None,
        state: TrainState,
        sampler: ElasticSampler,
        **extra: Any,
    ) -> None:
        """The ``start`` event of a segment, and ``restore`` when it began from a checkpoint."""
        self.events.record(
            "start",
            world_size=world_size,
            start_reason=env.start_reason.value,
            restart_count=env.restart_count,
            round=env.round,
            generation=env.generation,
            restored_step=restored.step if restored else None,
            checkpoint=restored.path if restored else None,
            **extra,
            samples_seen=state.samples_seen,
            epoch=sampler.epoch,
            cursor=sampler.position.cursor,
        )
        if restored is not None:
            self.events.record(
                "restore",
                step=restored.step,
                path=restored.path,
                saved_world_size=restored.world_size,
                steps_rerun=self.steps_rerun,
            )

    def plan_in_force(
        self, batch_plan: BatchPlan, world_size: str, lr: float, step: int, changed: int | None, new_size: int
    ) -> None:
        """The batch plan in force (a lifecycle line), and the world-size change and rescale events."""
        fields: dict[str, Any] = {
            "world_size": world_size,
            "policy": batch_plan.policy.value,
            "global_batch": batch_plan.global_batch,
            "micro_batch": batch_plan.micro_batch,
            "accumulation": batch_plan.accumulation,
            "lr": f"{lr:.6g}",
            "step": step,
        }
        lifecycle("rescale" if changed is not None else "batch_plan", **fields)
        if changed is not None:
            self.events.record("world_size_changed", old=changed, new=new_size, step=step)
            self.events.record("rescale", **fields)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Write ``values`` at ``step`` (rank 0: tensors become floats); any other rank keeps them (module doc)."""
        if self._metrics is None and self._tensorboard is None:
            # Converted only if ever stored (no device sync per step here); detached, so that a kept loss holds
            # no autograd graph alive.
            self._kept.append((step, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in values.items()}))
            return
        plain = _plain(values)
        if self._metrics is not None:
            self._metrics.log(step, **plain)
        if self._tensorboard is not None:
            self._tensorboard.log(step, **plain)

    def _store_kept(self, kept: list[tuple[int, dict[str, Any]]], path: str, segment: str, restored_step: int) -> None:
        """The ``kept`` points of the steps after the metrics file's last up to the one this world goes on from, in
        ``segment`` (through rank 0's writer, or as a point-only writer of it)."""
        logged = max((p.step for p in read_metrics(path).active), default=0)
        missing = [(step, values) for step, values in kept if logged < step <= restored_step]
        if missing:
            writer = self._metrics or MetricsWriter(path, segment, restored_step, open_segment=False)
            for step, values in missing:
                writer.log(step, **_plain(values))
            if writer is not self._metrics:
                writer.close()
            lifecycle("metrics_recovered", steps=f"{missing[0][0]}-{missing[-1][0]}", points=len(missing))
        self._kept.clear()

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` committed (object stores: no restorable step's points are lost)."""
        if self._metrics is not None:
            self._metrics.checkpointed(step)

    def close_writers(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v.item()) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
