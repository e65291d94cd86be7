"""DeepSpeed batch settings per world size: elastrain's scaling policy fed into a DeepSpeed config.

Pure functions on plain dicts; nothing here imports torch or deepspeed.

A DeepSpeed config fixes ``train_batch_size = micro × accumulation × world``, so a config written
for 2 workers is wrong (DeepSpeed refuses it) at 1 or 3. :func:`elastic_config` reads the user's
intent once (the global batch and the largest micro-batch), asks elastrain's scaling policy for the
plan at the current world size, and writes the three numbers DeepSpeed wants.

DeepSpeed's own ``elasticity`` block was removed in DeepSpeed 0.19 (a config that has one is
rejected). When a config still has an enabled one, it is honoured: the batch and micro-batch that
DeepSpeed's algorithm (versions 0.1 and 0.2) picks at this world size are used, the block is removed
before the config reaches DeepSpeed, and a warning is logged when that batch differs from the one
the user configured, because the algorithm silently changes the global batch at some node counts
(3 nodes of 8 GPUs: 192 instead of 256) without touching the learning rate.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.errors import ScalingError
from elastrain.log import lifecycle
from elastrain.scaling import BatchPlan, Policy, ScalingConfig, plan

TRAIN_BATCH = "train_batch_size"
MICRO_BATCH = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"
ELASTICITY = "elasticity"

# The smallest highly composite numbers: DeepSpeed's elasticity scales its base batch sizes by them.
_HCN = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
)  # fmt: skip


@dataclass(frozen=True)
class ElasticityChoice:
    """What DeepSpeed's (removed) elasticity algorithm picks at one world size."""

    global_batch: int
    micro_batch: int
    valid_world_sizes: tuple[int, ...]


@dataclass(frozen=True)
class DeepSpeedBatch:
    """The batch settings for one world size, and the plan the data loader follows."""

    plan: BatchPlan
    micro_batch: int
    """``train_micro_batch_size_per_gpu``: the largest micro-batch any rank runs."""
    accumulation: int
    """``gradient_accumulation_steps``: micro-batches per optimizer step on every rank."""
    elasticity: ElasticityChoice | None = None

    @property
    def train_batch_size(self) -> int:
        """What DeepSpeed is told; equals the real global batch when the split is even (see :attr:`exact`)."""
        return self.micro_batch * self.accumulation * self.plan.world_size

    @property
    def exact(self) -> bool:
        """True when every rank's every micro-batch has ``micro_batch`` samples."""
        return self.train_batch_size == self.plan.global_batch


# -- DeepSpeed's elasticity algorithm (from deepspeed/elasticity/elasticity.py, removed in 0.19) -------
def _candidate_batches(bases: Sequence[int], max_batch: int) -> list[int]:
    out = set()
    for base in bases:
        if base > max_batch:
            continue
        if base == max_batch:
            out.add(base)
            continue
        limit = max_batch // base
        out.add(max(h for h in _HCN if h <= limit) * base)
    return sorted(out)


def _valid_world_sizes(batch: int, micro_batches: Sequence[int], lo: int, hi: int) -> list[int]:
    valid = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        if lo <= most <= hi:
            valid.add(most)
        valid.update(i for i in range(max(lo, 1), min(most // 2, hi) + 1) if most % i == 0)
    return sorted(valid)


def _compatible_v01(
    micro_batches: Sequence[int], max_batch: int, lo: int, hi: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    if any(m > max_batch for m in micro_batches):
        raise ScalingError(
            f"elasticity.micro_batch_sizes {list(micro_batches)} must all be <= max_train_batch_size {max_batch}"
        )
    bases = [*micro_batches, math.lcm(*micro_batches)]
    best, best_valid = int(min(micro_batches)), list[int]()
    for batch in _candidate_batches(bases, max_batch):
        valid = _valid_world_sizes(batch, micro_batches, lo, hi)
        better = (prefer_larger and batch > best) or (not prefer_larger and batch < best)
        if len(valid) > len(best_valid) or (len(valid) == len(best_valid) and better):
            best, best_valid = batch, valid
    return best, best_valid


def _micro_for(batch: int, dp_world: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
    fits = [m for m in micro_batches if batch // dp_world % m == 0]
    if not fits:
        return None
    return max(fits) if prefer_larger else fits[0]


def deepspeed_elasticity(section: Mapping[str, Any], world_size: int) -> ElasticityChoice:
    """The global batch and micro-batch DeepSpeed's elasticity (version 0.1 or 0.2) picks at ``world_size``."""
    try:
        max_batch = int(section["max_train_batch_size"])
        micro_batches = [int(m) for m in section["micro_batch_sizes"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ScalingError(
            f"the DeepSpeed elasticity section needs max_train_batch_size and micro_batch_sizes ({e!r})"
        ) from None
    if not micro_batches or min(micro_batches) < 1:
        raise ScalingError(f"elasticity.micro_batch_sizes must be positive integers, got {micro_batches}")
    lo, hi = int(section.get("min_gpus", 1)), int(section.get("max_gpus", 10000))
    prefer_larger = bool(section.get("prefer_larger_batch", True))
    version = float(section.get("version", 0.2))
    per_node = int(section.get("num_gpus_per_node", 1))
    mp = int(section.get("model_parallel_size", 1))
    if version == 0.1:
        batch, valid = _compatible_v01(micro_batches, max_batch, lo, hi, prefer_larger)
        if world_size not in valid:
            raise ScalingError(
                f"DeepSpeed elasticity (version 0.1) allows world sizes {valid}, not {world_size}: "
                "change elasticity.micro_batch_sizes / max_train_batch_size or remove the elasticity section"
            )
        micro = _micro_for(batch, world_size, sorted(set(micro_batches)), True)
    elif version == 0.2:
        if per_node % mp:
            raise ScalingError(
                f"elasticity.num_gpus_per_node {per_node} must be a multiple of model_parallel_size {mp}"
            )
        dp_per_node = per_node // mp
        node_batch, valid_nodes = _compatible_v01(
            micro_batches, max_batch // dp_per_node, lo // per_node, hi // per_node, prefer_larger
        )
        batch = node_batch * dp_per_node
        valid = [n * dp_per_node for n in valid_nodes]
        dp_world = world_size // mp
        if dp_world not in valid:
            # Off the list, DeepSpeed fits the largest multiple of micro × world under the cap.
            dp_world = world_size // per_node * dp_per_node
            candidates = [max_batch // (m * dp_world) * m * dp_world for m in micro_batches]
            batch = max(candidates) if prefer_larger else min(candidates)
            valid = [dp_world]
        micro = _micro_for(batch, dp_world, micro_batches, prefer_larger)
    else:
        raise ScalingError(f"elasticity.version must be 0.1 or 0.2, got {version}")
    if micro is None or batch < 1:
        raise ScalingError(
            f"DeepSpeed elasticity finds no micro-batch in {micro_batches} that divides a batch of {batch} "
            f"over {world_size} workers: change elasticity.micro_batch_sizes or remove the elasticity section"
        )
    return ElasticityChoice(global_batch=batch, micro_batch=micro, valid_world_sizes=tuple(valid))


# -- the config elastrain hands to DeepSpeed ------------------------------------------------------------
def user_batch(config: Mapping[str, Any], reference_world_size: int | None = None) -> tuple[int, int]:
    """The user's global batch and largest micro-batch, as written in a DeepSpeed config.

    ``train_batch_size`` is the global batch. Without it, ``micro × accumulation × reference_world_size``
    is (the world size the config was written for). ``train_micro_batch_size_per_gpu`` defaults to the
    global batch over the reference world size.
    """
    raw_global, raw_micro, raw_acc = config.get(TRAIN_BATCH), config.get(MICRO_BATCH), config.get(ACCUMULATION)
    if raw_global is None:
        if raw_micro is None or reference_world_size is None:
            raise ScalingError(
                f"set {TRAIN_BATCH} (the global batch) in the DeepSpeed config, or {MICRO_BATCH} and pass "
                "reference_world_size (the world size the config was written for)"
            )
        global_batch = int(raw_micro) * int(raw_acc or 1) * reference_world_size
    else:
        global_batch = int(raw_global)
    if raw_micro is not None:
        micro = int(raw_micro)
    else:
        ref = reference_world_size or 1
        micro = max(1, global_batch // (ref * int(raw_acc or 1)))
    if global_batch < 1 or micro < 1:
        raise ScalingError(f"{TRAIN_BATCH}={global_batch} and {MICRO_BATCH}={micro} must be >= 1")
    return global_batch, micro


def deepspeed_batch(
    config: Mapping[str, Any], world_size: int, reference_world_size: int | None = None
) -> DeepSpeedBatch:
    """The batch settings at ``world_size`` for a user's DeepSpeed ``config`` (constant global batch)."""
    section = config.get(ELASTICITY)
    choice = None
    if isinstance(section, Mapping) and section.get("enabled", False):
        choice = deepspeed_elasticity(section, world_size)
        global_batch, micro = choice.global_batch, choice.micro_batch
    else:
        global_batch, micro = user_batch(config, reference_world_size)
    batch_plan = plan(ScalingConfig(policy=Policy.CONSTANT, global_batch=global_batch, micro_batch=micro), world_size)
    if not batch_plan.uniform:
        raise ScalingError(
            f"a global batch of {global_batch} cannot give each of {world_size} workers the same number of "
            f"micro-batches (DeepSpeed needs that): raise {TRAIN_BATCH} to at least {micro * world_size} "
            f"or lower {MICRO_BATCH}"
        )
    largest = max(max(sizes) for sizes in batch_plan.micro_sizes)
    return DeepSpeedBatch(plan=batch_plan, micro_batch=largest, accumulation=batch_plan.accumulation, elasticity=choice)


def elastic_config(
    config: Mapping[str, Any], world_size: int, reference_world_size: int | None = None, *, log: bool = True
) -> tuple[dict[str, Any], DeepSpeedBatch]:
    """A copy of ``config`` with the batch settings for ``world_size``, and the batch plan behind them.

    The copy has ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` rewritten and no ``elasticity`` section. Pass the returned
    plan's sizes to the data loader (:class:`elastrain.data.ElasticSampler`).
    """
    batch = deepspeed_batch(config, world_size, reference_world_size)
    out = copy.deepcopy(dict(config))
    out.pop(ELASTICITY, None)
    out[TRAIN_BATCH] = batch.train_batch_size
    out[MICRO_BATCH] = batch.micro_batch
    out[ACCUMULATION] = batch.accumulation
    if log:
        lifecycle(
            "deepspeed_batch",
            world_size=world_size,
            global_batch=batch.plan.global_batch,
            micro_batch=batch.micro_batch,
            accumulation=batch.accumulation,
            deepspeed_train_batch_size=batch.train_batch_size,
        )
        if not batch.exact:
            lifecycle(
                "deepspeed_batch_uneven",
                logging.WARNING,
                global_batch=batch.plan.global_batch,
                deepspeed_train_batch_size=batch.train_batch_size,
                why="ranks get micro-batches of different sizes; scale each micro-batch loss by "
                "loss_multiplier() so the gradient stays the global mean",
            )
    baseline = elasticity_baseline(config, reference_world_size)
    if log and batch.elasticity is not None and baseline is not None and baseline != batch.plan.global_batch:
        lifecycle(
            "deepspeed_elasticity_changes_batch",
            logging.WARNING,
            world_size=world_size,
            configured=baseline,
            elasticity=batch.plan.global_batch,
            fix="remove the elasticity section and set train_batch_size to keep the global batch at every world size",
        )
    return out, batch


def elasticity_baseline(config: Mapping[str, Any], reference_world_size: int | None = None) -> int | None:
    """The global batch an elasticity section should keep: ``train_batch_size`` when the config sets it,
    else what the section picks at ``reference_world_size``; ``None`` without an enabled section."""
    section = config.get(ELASTICITY)
    if not (isinstance(section, Mapping) and section.get("enabled", False)):
        return None
    if config.get(TRAIN_BATCH) is not None:
        return int(config[TRAIN_BATCH])
    if reference_world_size is None:
        return None
    return deepspeed_elasticity(section, reference_world_size).global_batch


def loss_multiplier(micro_size: int, batch: DeepSpeedBatch, step_size: int | None = None) -> float:
    """Multiplier on a micro-batch's mean loss before ``engine.backward`` so the gradient is the step's mean.

    DeepSpeed divides each micro-batch's loss by the accumulation steps and averages gradients over
    ranks, which weights every micro-batch equally; this reweights by the micro-batch's share of the
    ``step_size`` samples of the step (default: the global batch). 1.0 for an even split.
    """
    size = step_size if step_size is not None else batch.plan.global_batch
    if size < 1:
        raise ScalingError(f"a step needs at least one sample, got {size}")
    return micro_size * batch.accumulation * batch.plan.world_size / size
