"""The HF Trainer's batch settings per world size: pure, without importing transformers.

The Trainer gives every rank the same micro-batch and accumulation, so a global batch is kept
exactly only when ``micro × accumulation × world`` equals it; :func:`trainer_batch` finds the
largest micro-batch (up to the user's) for which it does.
"""

from __future__ import annotations

import math

from elastrain.errors import ScalingError


def trainer_batch(global_batch: int, micro_batch: int, world_size: int) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` with ``micro × accumulation × world
    == global_batch`` exactly and the micro-batch as large as possible up to ``micro_batch``.

    The Trainer gives every rank the same batch size, so the global batch must be a multiple of the
    world size; :class:`ScalingError` names the fix otherwise.
    """
    if global_batch < 1 or micro_batch < 1 or world_size < 1:
        raise ScalingError(f"global_batch, micro_batch and world_size must be >= 1: {global_batch}, {micro_batch}")
    if global_batch % world_size:
        raise ScalingError(
            f"a global batch of {global_batch} cannot be split evenly over {world_size} workers (the Trainer needs "
            f"that): choose a global batch divisible by every world size you run at (here {world_size})"
        )
    per_rank = global_batch // world_size
    for accumulation in range(math.ceil(per_rank / micro_batch), per_rank + 1):
        if per_rank % accumulation == 0:
            return per_rank // accumulation, accumulation
    return 1, per_rank  # unreachable: accumulation == per_rank always divides
