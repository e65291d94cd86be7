"""Batch and learning-rate scaling policies (pure functions) and sample-driven LR schedules."""

from elastrain.scaling.policy import (
    BatchPlan,
    Policy,
    ScalingConfig,
    loss_scale,
    lr_scale,
    plan,
    ramped_scale,
    split_batch,
)
from elastrain.scaling.schedule import Schedule, constant, from_steps, warmup_cosine, warmup_linear

__all__ = [
    "BatchPlan",
    "Policy",
    "ScalingConfig",
    "Schedule",
    "constant",
    "from_steps",
    "loss_scale",
    "lr_scale",
    "plan",
    "ramped_scale",
    "split_batch",
    "warmup_cosine",
    "warmup_linear",
]
