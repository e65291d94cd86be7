"""Learning-rate schedules driven by samples consumed, not by steps or restarts.

A schedule maps the number of samples the job has consumed to a multiplier on the base learning
rate. Counting samples keeps the curve continuous when the global batch changes with the world size
(``linear``/``sqrt`` policies) and when workers restart: nothing re-warms from scratch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from elastrain.errors import ScalingError


class Schedule(Protocol):
    def __call__(self, samples: int) -> float: ...


def constant() -> Schedule:
    def lr(samples: int) -> float:
        return 1.0

    return lr


def _warmup_then(warmup_samples: int, total_samples: int, decay: Callable[[float], float]) -> Schedule:
    """Linear warm-up from 0 to 1 over ``warmup_samples``, then ``decay(progress)`` with progress 0 → 1."""
    _check(warmup_samples, total_samples)
    span = max(total_samples - warmup_samples, 1)

    def lr(samples: int) -> float:
        if samples < warmup_samples:
            return samples / warmup_samples
        return decay(min((samples - warmup_samples) / span, 1.0))

    return lr


def warmup_linear(warmup_samples: int, total_samples: int, final_ratio: float = 0.0) -> Schedule:
    """Linear warm-up from 0 to 1 over ``warmup_samples``, then linear decay to ``final_ratio`` at ``total_samples``."""
    return _warmup_then(warmup_samples, total_samples, lambda p: 1.0 - (1.0 - final_ratio) * p)


def warmup_cosine(warmup_samples: int, total_samples: int, final_ratio: float = 0.0) -> Schedule:
    """Linear warm-up over ``warmup_samples``, then cosine decay to ``final_ratio`` at ``total_samples``."""
    return _warmup_then(
        warmup_samples,
        total_samples,
        lambda p: final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)),
    )


def from_steps(step_schedule: Callable[[int], float], samples_per_step: int) -> Schedule:
    """Adapt a step-based multiplier (say, a ``LambdaLR`` lambda) to samples at a reference global batch.

    The step is ``samples // samples_per_step``, so a run whose global batch changes still follows
    the curve the step-based schedule would draw at ``samples_per_step`` samples per step.
    """
    if samples_per_step < 1:
        raise ScalingError(f"samples_per_step must be >= 1, got {samples_per_step}")

    def lr(samples: int) -> float:
        return float(step_schedule(samples // samples_per_step))

    return lr


def _check(warmup_samples: int, total_samples: int) -> None:
    if warmup_samples < 0:
        raise ScalingError(f"warmup_samples must be >= 0, got {warmup_samples}")
    if total_samples < warmup_samples:
        raise ScalingError(f"total_samples ({total_samples}) must be >= warmup_samples ({warmup_samples})")
