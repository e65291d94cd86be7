"""Batch and learning-rate scaling policies: what one optimizer step looks like at a given world size.

Pure functions, no ``torch.distributed``: the table tests in ``tests/unit/test_scaling*.py`` cover
every policy, including world sizes that do not divide the global batch.

``constant`` (default)
    The global batch is fixed. Each step's samples are split among the ranks of the moment (shares
    differ by at most one sample) and each share into micro-batches of at most ``micro_batch``.
    Accumulation is ``ceil(global / (micro × world))``. With a loss normalised by the step's global
    sample count (:func:`loss_scale`), the gradient equals the uninterrupted run's. LR unchanged.
``linear`` / ``sqrt``
    The micro-batch and the accumulation are fixed, so the global batch follows the world size
    (``micro × accumulation × world``). The learning rate is scaled by ``world / reference`` (linear,
    Goyal et al., for SGD) or by its square root (for Adam-style optimisers), optionally ramped from
    the old scale to the new one over a few steps after a change.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from elastrain.errors import ScalingError


class Policy(str, enum.Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    SQRT = "sqrt"


@dataclass(frozen=True)
class ScalingConfig:
    """The user's batch settings; validated once, independent of the world size."""

    policy: Policy = Policy.CONSTANT
    global_batch: int | None = None
    """Samples per optimizer step (``constant``: required; ``linear``/``sqrt``: ignored)."""
    micro_batch: int = 1
    """Most samples one rank puts through one forward/backward pass."""
    accumulation: int = 1
    """``linear``/``sqrt`` only: micro-batches per optimizer step on every rank."""
    reference_world_size: int | None = None
    """``linear``/``sqrt``: the world size at which the configured LR is right (None: the first start's)."""
    rescale_warmup_steps: int = 0
    """``linear``/``sqrt``: after a change, ramp the LR scale from old to new over this many steps."""

    def __post_init__(self) -> None:
        policy = Policy(self.policy)  # accepts the string form too
        object.__setattr__(self, "policy", policy)
        if self.micro_batch < 1:
            raise ScalingError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.accumulation < 1:
            raise ScalingError(f"accumulation must be >= 1, got {self.accumulation}")
        if self.rescale_warmup_steps < 0:
            raise ScalingError(f"rescale_warmup_steps must be >= 0, got {self.rescale_warmup_steps}")
        if self.reference_world_size is not None and self.reference_world_size < 1:
            raise ScalingError(f"reference_world_size must be >= 1, got {self.reference_world_size}")
        if policy is Policy.CONSTANT:
            if self.global_batch is None:
                raise ScalingError("the constant policy needs global_batch (samples per optimizer step)")
            if self.global_batch < 1:
                raise ScalingError(f"global_batch must be >= 1, got {self.global_batch}")


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step at one world size."""

    policy: Policy
    world_size: int
    global_batch: int
    micro_batch: int
    accumulation: int
    """Micro-batches per optimizer step on the busiest rank."""
    lr_scale: float
    """Multiplier on the configured learning rate (1.0 for ``constant``)."""
    micro_sizes: tuple[tuple[int, ...], ...]
    """``micro_sizes[rank]``: the sizes of that rank's micro-batches, in order."""

    @property
    def uniform(self) -> bool:
        """True when every rank runs the same number of micro-batches (DeepSpeed needs this)."""
        return len({len(s) for s in self.micro_sizes}) == 1

    def describe(self) -> str:
        return (
            f"policy={self.policy.value} world_size={self.world_size} global_batch={self.global_batch} "
            f"micro_batch={self.micro_batch} accumulation={self.accumulation} lr_scale={self.lr_scale:g}"
        )


def _even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes that differ by at most one, larger first."""
    q, r = divmod(total, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def split_batch(global_size: int, world_size: int, micro_batch: int) -> tuple[tuple[int, ...], ...]:
    """Sizes of each rank's micro-batches for one step of ``global_size`` samples.

    Ranks get contiguous shares that differ by at most one sample. Every rank runs the same number of
    micro-batches, ``ceil(largest share / micro_batch)``, each as even as possible, except where a
    share is smaller than that count (only with ``micro_batch == 1``): then that rank runs one
    micro-batch per sample instead of an empty one. No micro-batch is empty or exceeds ``micro_batch``.
    """
    if world_size < 1:
        raise ScalingError(f"world size must be >= 1, got {world_size}")
    if micro_batch < 1:
        raise ScalingError(f"micro_batch must be >= 1, got {micro_batch}")
    if global_size < world_size:
        raise ScalingError(
            f"a step of {global_size} samples cannot feed {world_size} workers (each needs at least one): "
            f"raise global_batch to at least {world_size} or run fewer workers"
        )
    shares = _even_split(global_size, world_size)
    count = math.ceil(shares[0] / micro_batch)
    return tuple(tuple(_even_split(share, min(count, share))) for share in shares)


def lr_scale(policy: Policy, world_size: int, reference_world_size: int) -> float:
    """The learning-rate multiplier at ``world_size`` relative to ``reference_world_size``."""
    if world_size < 1 or reference_world_size < 1:
        raise ScalingError(f"world sizes must be >= 1, got {world_size} and reference {reference_world_size}")
    ratio = world_size / reference_world_size
    if policy is Policy.LINEAR:
        return ratio
    if policy is Policy.SQRT:
        return math.sqrt(ratio)
    return 1.0


def plan(config: ScalingConfig, world_size: int, reference_world_size: int | None = None) -> BatchPlan:
    """The batch plan for ``world_size``; ``reference_world_size`` defaults to the config's, then to 1."""
    if world_size < 1:
        raise ScalingError(f"world size must be >= 1, got {world_size}")
    reference = config.reference_world_size or reference_world_size or 1
    if config.policy is Policy.CONSTANT:
        global_batch = int(config.global_batch or 0)
    else:
        global_batch = config.micro_batch * config.accumulation * world_size
    sizes = split_batch(global_batch, world_size, config.micro_batch)
    return BatchPlan(
        policy=config.policy,
        world_size=world_size,
        global_batch=global_batch,
        micro_batch=config.micro_batch,
        accumulation=max(len(s) for s in sizes),
        lr_scale=lr_scale(config.policy, world_size, reference),
        micro_sizes=sizes,
    )


def ramped_scale(old_scale: float | None, new_scale: float, steps_since_change: int, warmup_steps: int) -> float:
    """The LR scale ``steps_since_change`` steps after a rescale, ramping linearly from old to new.

    Step 0 is the first step at the new world size; it already moves ``1 / warmup_steps`` of the way,
    and from step ``warmup_steps - 1`` on the new scale applies in full.
    """
    if old_scale is None or warmup_steps <= 0 or steps_since_change >= warmup_steps - 1:
        return new_scale
    frac = (max(steps_since_change, 0) + 1) / warmup_steps
    return old_scale + (new_scale - old_scale) * frac


def loss_scale(micro_size: int, world_size: int, step_size: int) -> float:
    """Multiplier on a micro-batch's *mean* loss so that the averaged gradient is the step's mean.

    DDP (and FSDP) average gradients over ranks, so a rank's contribution is multiplied by the
    world size; dividing by the step's global count makes the result the mean over all its samples
    (or tokens, when the sizes are token counts), whatever the split.
    """
    if step_size < 1:
        raise ScalingError(f"a step needs at least one sample or token, got {step_size}")
    return micro_size * world_size / step_size
