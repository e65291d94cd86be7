"""Table tests for the scaling policies, including world sizes that do not divide the global batch."""

from __future__ import annotations

import math

import pytest

from elastrain.errors import ScalingError
from elastrain.scaling import (
    Policy,
    ScalingConfig,
    from_steps,
    loss_scale,
    lr_scale,
    plan,
    ramped_scale,
    split_batch,
    warmup_cosine,
    warmup_linear,
)

# global, world, micro -> per-rank micro-batch sizes
SPLITS = [
    (32, 1, 8, ((8, 8, 8, 8),)),
    (32, 2, 8, ((8, 8), (8, 8))),
    (32, 4, 8, ((8,), (8,), (8,), (8,))),
    (32, 3, 8, ((6, 5), (6, 5), (5, 5))),  # 11, 11, 10: two micro-batches each
    (32, 5, 4, ((4, 3), (4, 3), (3, 3), (3, 3), (3, 3))),  # 7, 7, 6, 6, 6
    (10, 3, 1, ((1, 1, 1, 1), (1, 1, 1), (1, 1, 1))),  # micro 1: no empty micro-batch, one fewer
    (7, 7, 4, ((1,),) * 7),
    (64, 3, 64, ((22,), (21,), (21,))),
    (5, 2, 2, ((2, 1), (1, 1))),
]


@pytest.mark.parametrize(("global_batch", "world", "micro", "expected"), SPLITS)
def test_split_batch(global_batch: int, world: int, micro: int, expected: tuple[tuple[int, ...], ...]) -> None:
    sizes = split_batch(global_batch, world, micro)
    assert sizes == expected
    assert sum(map(sum, sizes)) == global_batch
    assert all(0 < s <= micro for rank in sizes for s in rank)


@pytest.mark.parametrize("world", range(1, 17))
@pytest.mark.parametrize(("global_batch", "micro"), [(64, 8), (48, 5), (17, 3), (16, 1), (100, 16)])
def test_constant_sees_exactly_the_global_batch(global_batch: int, micro: int, world: int) -> None:
    if global_batch < world:
        with pytest.raises(ScalingError, match="global_batch"):
            plan(ScalingConfig(global_batch=global_batch, micro_batch=micro), world)
        return
    p = plan(ScalingConfig(global_batch=global_batch, micro_batch=micro), world)
    assert p.global_batch == global_batch
    assert sum(map(sum, p.micro_sizes)) == global_batch
    assert p.accumulation == math.ceil(math.ceil(global_batch / world) / micro)
    assert p.lr_scale == 1.0
    shares = [sum(s) for s in p.micro_sizes]
    assert max(shares) - min(shares) <= 1
    # Normalised by the global count, the loss scales of the whole step sum to the world size
    # (DDP then divides by it): the gradient is the mean over exactly the global batch.
    total = sum(loss_scale(s, world, global_batch) for rank in p.micro_sizes for s in rank)
    assert total == pytest.approx(world)


# policy, micro, accumulation, reference, world -> (global batch, lr scale)
FOLLOWING = [
    (Policy.LINEAR, 8, 1, 2, 2, 16, 1.0),
    (Policy.LINEAR, 8, 1, 2, 1, 8, 0.5),
    (Policy.LINEAR, 8, 1, 2, 3, 24, 1.5),
    (Policy.LINEAR, 4, 2, 4, 3, 24, 0.75),
    (Policy.SQRT, 8, 1, 2, 2, 16, 1.0),
    (Policy.SQRT, 8, 1, 2, 1, 8, math.sqrt(0.5)),
    (Policy.SQRT, 8, 1, 2, 3, 24, math.sqrt(1.5)),
    (Policy.SQRT, 8, 1, 1, 4, 32, 2.0),
    (Policy.SQRT, 5, 3, 3, 7, 105, math.sqrt(7 / 3)),
]


@pytest.mark.parametrize(("policy", "micro", "accum", "reference", "world", "global_batch", "scale"), FOLLOWING)
def test_linear_and_sqrt(
    policy: Policy, micro: int, accum: int, reference: int, world: int, global_batch: int, scale: float
) -> None:
    cfg = ScalingConfig(policy=policy, micro_batch=micro, accumulation=accum, reference_world_size=reference)
    p = plan(cfg, world)
    assert p.global_batch == global_batch
    assert p.accumulation == accum
    assert p.micro_sizes == ((micro,) * accum,) * world
    assert p.lr_scale == pytest.approx(scale)


def test_reference_defaults_to_the_argument_then_one() -> None:
    cfg = ScalingConfig(policy="linear", micro_batch=4)
    assert plan(cfg, 4, reference_world_size=2).lr_scale == 2.0
    assert plan(cfg, 4).lr_scale == 4.0
    assert lr_scale(Policy.CONSTANT, 5, 2) == 1.0


@pytest.mark.parametrize(
    ("old", "new", "since", "warmup", "expected"),
    [
        (None, 1.5, 0, 4, 1.5),
        (1.0, 1.5, 0, 0, 1.5),
        (1.0, 2.0, 0, 4, 1.25),
        (1.0, 2.0, 1, 4, 1.5),
        (1.0, 2.0, 2, 4, 1.75),
        (1.0, 2.0, 3, 4, 2.0),
        (1.0, 2.0, 99, 4, 2.0),
        (2.0, 1.0, 0, 2, 1.5),
        (2.0, 1.0, 0, 1, 1.0),
    ],
)
def test_ramped_scale(old: float | None, new: float, since: int, warmup: int, expected: float) -> None:
    assert ramped_scale(old, new, since, warmup) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"global_batch": None}, "global_batch"),
        ({"global_batch": 0}, "global_batch"),
        ({"global_batch": 8, "micro_batch": 0}, "micro_batch"),
        ({"policy": "linear", "accumulation": 0}, "accumulation"),
        ({"policy": "sqrt", "reference_world_size": 0}, "reference_world_size"),
        ({"global_batch": 8, "rescale_warmup_steps": -1}, "rescale_warmup_steps"),
    ],
)
def test_bad_config_names_the_setting(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ScalingError, match=field):
        ScalingConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_policy() -> None:
    with pytest.raises(ValueError):
        ScalingConfig(policy="cubic", global_batch=8)  # type: ignore[arg-type]


def test_schedules_follow_samples() -> None:
    lin = warmup_linear(100, 1100)
    assert [lin(s) for s in (0, 50, 100, 600, 1100, 5000)] == pytest.approx([0, 0.5, 1, 0.5, 0, 0])
    cos = warmup_cosine(0, 1000, final_ratio=0.1)
    assert cos(0) == pytest.approx(1.0)
    assert cos(500) == pytest.approx(0.55)
    assert cos(1000) == pytest.approx(0.1)
    stepwise = from_steps(lambda step: 1.0 / (step + 1), samples_per_step=32)
    assert [stepwise(s) for s in (0, 31, 32, 95)] == pytest.approx([1, 1, 0.5, 1 / 3])
    # The same sample count gives the same LR whatever the batch size that led there.
    assert lin(8 * 30) == lin(24 * 10)
