"""Rank 0's account of the run: ``events.jsonl``, ``metrics.jsonl`` and TensorBoard, one segment per world.

Every entry into a world (a start, or a live regroup) opens a new segment, whose ``start`` (or
``regroup``) event says where it began; metric points keep their format (``kind``, ``step``,
``time``, ``values``). Other ranks write nothing.
"""

from __future__ import annotations

import logging
from typing import Any

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

    def open(self, env: WorkerEnv, segment: str, restored_step: int) -> None:
        """Rank 0: the segment's writers, continuing the files of earlier segments."""
        events_path = env.events_file
        if self.metrics_dir:
            events_path = events_path or join_path(self.metrics_dir, EVENTS_FILENAME)
            metrics_path = join_path(self.metrics_dir, METRICS_FILENAME)
            logged = max((p.step for p in read_metrics(metrics_path).active), default=0)
            self.steps_rerun = max(0, logged - restored_step)
            self._metrics = MetricsWriter(metrics_path, segment, restored_step)
        self.events = EventsFile(events_path, run_id=env.run_id, segment=segment)
        if self.tensorboard_dir:
            if tensorboard_available():
                self._tensorboard = TensorBoardWriter(self.tensorboard_dir, restored_step)
            else:
                lifecycle("tensorboard_unavailable", level=logging.WARNING, fix="pip install 'elastrain[tensorboard]'")

    def reopen(self, rank: int, env: WorkerEnv, segment: str, restored_step: int) -> None:
        """A new segment at an entry into a world; rank 0 (perhaps a new one) opens it, the others write nothing."""
        self.close_writers()
        if rank == 0:
            self.open(env, segment, restored_step)
        else:
            self.events = EventsFile(None)

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
        if self._metrics is not None:
            self._metrics.log(step, **values)
        if self._tensorboard is not None:
            self._tensorboard.log(step, **values)

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
