"""The Trainer's batch settings at a world size that keep the global batch exact: pure, no transformers.

The Trainer runs the same number of micro-batches (``gradient_accumulation_steps``) on every rank; its
per-device batch only sizes its buffers. elastrain's batch plan (:func:`elastrain.scaling.plan`) splits each
step's global batch among the ranks in shares that differ by at most one sample, each share into the same
number of micro-batches of at most the user's micro-batch, so a global batch that a world size does not
divide is kept too. A rank's loss is normalised by the step's global token count where the model takes
``num_items_in_batch`` (causal and seq2seq LMs); models with a mean loss weigh the samples of a smaller
share a little more when the shares differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrain.errors import ScalingError
from elastrain.scaling import BatchPlan, ScalingConfig, plan


@dataclass(frozen=True)
class TrainerSettings:
    """What an ``ElasticTrainerRun`` tells the integration, instead of what it would infer from the arguments."""

    global_batch: int
    micro_batch: int
    seed: int
    shuffle: bool
    keep_last: int


def trainer_plan(global_batch: int, micro_batch: int, world_size: int) -> BatchPlan:
    """The batch plan for the Trainer at ``world_size``; :class:`ScalingError` names the setting to change."""
    p = plan(ScalingConfig(global_batch=global_batch, micro_batch=micro_batch), world_size)
    if not p.uniform:
        raise ScalingError(
            f"per_device_train_batch_size: a global batch of {global_batch} over {world_size} workers with "
            f"micro-batches of at most {micro_batch} would give the workers different numbers of micro-batches, "
            "which the Trainer cannot run: raise the per-device batch or the global batch"
        )
    return p


def device_batch(p: BatchPlan, rank: int) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` for ``rank`` under plan ``p``."""
    return max(p.micro_sizes[rank]), p.accumulation
