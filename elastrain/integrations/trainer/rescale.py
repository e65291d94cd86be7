"""The Trainer's batch at the world size it trains in: the run's global batch kept exactly.

``per_device_train_batch_size × gradient_accumulation_steps × world size`` at the first world size (or an
``ElasticTrainerRun``'s settings) is the run's global batch; at every world size the batch plan
(:func:`~elastrain.integrations.trainer.batch.trainer_plan`) splits it among the ranks, and the Trainer's
per-device batch and accumulation are set from it. The run's length in optimizer steps follows from it.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from elastrain.errors import ScalingError
from elastrain.integrations.trainer.batch import TrainerSettings, device_batch, trainer_plan
from elastrain.integrations.trainer.checkpoints import rank_zero_log
from elastrain.integrations.trainer.errors import TrainerIntegrationError
from elastrain.integrations.trainer.memory import Held
from elastrain.integrations.trainer.weak_trainer import WeakTrainer
from elastrain.scaling import BatchPlan


class TrainerBatch:
    """One Trainer's batch plan: the per-device batch and accumulation that keep the global batch at this size."""

    trainer = WeakTrainer()

    def __init__(self, trainer: Any, settings: TrainerSettings | None, held: Held) -> None:
        args = trainer.args
        self.trainer = trainer
        self.settings = settings
        """An ElasticTrainerRun's settings; None: inferred from the arguments at the first world size."""
        self.held = held
        self.user_micro = settings.micro_batch if settings else int(args.per_device_train_batch_size)
        self.user_accumulation = int(args.gradient_accumulation_steps)
        self.plan: BatchPlan | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def first_global_batch(self) -> int:
        if self.settings is not None:
            return self.settings.global_batch
        return self.user_micro * self.user_accumulation * self.world_size

    def replan(self, global_batch: int) -> BatchPlan:
        """Per-device batch and accumulation for this world size that keep ``global_batch`` exactly."""
        args = self.trainer.args
        try:
            p = trainer_plan(global_batch, self.user_micro, self.world_size)
        except ScalingError as e:
            raise TrainerIntegrationError(str(e)) from None
        args.per_device_train_batch_size, args.gradient_accumulation_steps = device_batch(p, self.rank)
        self.trainer._train_batch_size = args.per_device_train_batch_size
        if self.plan is None or self.plan.world_size != p.world_size:
            rank_zero_log(
                "rescale",
                world_size=p.world_size,
                global_batch=p.global_batch,
                micro_batch=args.per_device_train_batch_size,
                accumulation=p.accumulation,
                policy="constant",
            )
        self.plan = p
        self.held.position.global_batch = p.global_batch
        return p

    def total_steps(self, num_samples: int) -> int:
        """The run's length in optimizer steps, whatever the world size (``max_steps``, or the epochs asked)."""
        args = self.trainer.args
        if args.max_steps > 0:
            return int(args.max_steps)
        return max(1, math.ceil(float(args.num_train_epochs) * num_samples / self.held.position.global_batch))
