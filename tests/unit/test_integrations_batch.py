"""Batch settings for DeepSpeed and the HF Trainer per world size (pure; no DeepSpeed or Trainer started)."""

from __future__ import annotations

import pytest

from elastrain.errors import ScalingError
from elastrain.integrations.ds_config import deepspeed_elasticity, elastic_config, elasticity_baseline, loss_multiplier
from elastrain.integrations.trainer.batch import device_batch, trainer_plan

USER = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6, "zero_optimization": {"stage": 2}}


def batch_keys(config: dict[str, object]) -> tuple[object, object, object]:
    return (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    )


@pytest.mark.parametrize(
    ("world", "expected", "exact"),
    [
        (1, (12, 6, 2), True),
        (2, (12, 6, 1), True),
        (3, (12, 4, 1), True),
        (4, (12, 3, 1), True),
        (5, (15, 3, 1), False),
    ],
)
def test_the_global_batch_is_kept_at_every_world_size(world: int, expected: tuple[int, int, int], exact: bool) -> None:
    config, batch = elastic_config(USER, world, log=False)
    assert batch_keys(config) == expected
    assert batch.exact is exact and batch.plan.global_batch == 12
    assert config["zero_optimization"] == {"stage": 2} and config is not USER


def test_an_uneven_split_is_corrected_by_the_loss_multiplier() -> None:
    _, batch = elastic_config(USER, 5, log=False)  # shares 3,3,2,2,2; DeepSpeed weighs micro-batches equally
    weights = [loss_multiplier(n, batch) / (batch.accumulation * 5) for sizes in batch.plan.micro_sizes for n in sizes]
    # Each micro-batch's mean loss then counts in proportion to its samples: the gradient is the global mean.
    assert weights == pytest.approx([3 / 12, 3 / 12, 2 / 12, 2 / 12, 2 / 12])
    _, even = elastic_config(USER, 2, log=False)
    assert loss_multiplier(6, even) == 1.0


def test_a_world_size_larger_than_the_global_batch_is_refused() -> None:
    with pytest.raises(ScalingError, match="global_batch"):
        elastic_config(USER, 13, log=False)


def test_global_batch_from_micro_and_accumulation_needs_the_reference_world_size() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ScalingError, match="train_batch_size"):
        elastic_config(config, 2, log=False)
    out, batch = elastic_config(config, 1, reference_world_size=2, log=False)
    assert batch.plan.global_batch == 16 and batch_keys(out) == (16, 4, 4)


ELASTIC_V02 = {"enabled": True, "max_train_batch_size": 256, "micro_batch_sizes": [8], "num_gpus_per_node": 8}


@pytest.mark.parametrize(("gpus", "batch"), [(8, 256), (16, 256), (24, 192), (32, 256)])
def test_deepspeed_elasticity_v02_picks_what_deepspeed_picked(gpus: int, batch: int) -> None:
    # deepspeed#5405: 3 nodes of 8 GPUs silently train with 192 instead of 256.
    assert deepspeed_elasticity({**ELASTIC_V02, "version": 0.2}, gpus).global_batch == batch


def test_deepspeed_elasticity_v01_matches_its_documented_example() -> None:
    section = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}
    choice = deepspeed_elasticity(section, 4)
    assert choice.global_batch == 1680 and choice.micro_batch == 6
    with pytest.raises(ScalingError, match="world sizes"):
        deepspeed_elasticity(section, 9)


def test_an_elasticity_section_is_honoured_removed_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    user = {"train_batch_size": 256, "elasticity": {**ELASTIC_V02, "ignore_non_elastic_batch_info": True}}
    assert elasticity_baseline(user) == 256
    config, batch = elastic_config(user, 24)
    assert "elasticity" not in config and batch.plan.global_batch == 192
    assert batch_keys(config) == (192, 8, 1)
    assert any("deepspeed_elasticity_changes_batch" in r.getMessage() for r in caplog.records)
    _, same = elastic_config(user, 16, log=False)
    assert same.plan.global_batch == 256


@pytest.mark.parametrize(
    ("global_batch", "micro", "world", "expected"),
    [
        (12, 3, 1, (3, 4)),
        (12, 3, 2, (3, 2)),
        (12, 3, 3, (2, 2)),
        (12, 3, 4, (3, 1)),
        (12, 5, 2, (3, 2)),
        (64, 8, 4, (8, 2)),
        (16, 8, 3, (6, 1)),  # shares 6, 5, 5: the world size need not divide the global batch
    ],
)
def test_the_trainer_keeps_the_global_batch_at_every_world_size(
    global_batch: int, micro: int, world: int, expected: tuple[int, int]
) -> None:
    p = trainer_plan(global_batch, micro, world)
    assert device_batch(p, 0) == expected and p.global_batch == global_batch
    assert sum(sum(s) for s in p.micro_sizes) == global_batch
    assert all(len(s) == p.accumulation and max(s) <= micro for s in p.micro_sizes)


def test_the_trainer_refuses_ranks_with_different_numbers_of_micro_batches() -> None:
    with pytest.raises(ScalingError, match="per_device_train_batch_size"):
        trainer_plan(5, 1, 3)  # shares 2, 2, 1 in micro-batches of 1
