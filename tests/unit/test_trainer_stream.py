"""The Trainer's data stream (elastrain.integrations.trainer.stream): pure, world-size independent."""

from __future__ import annotations

import logging

import pytest

from elastrain.errors import DataStateError
from elastrain.integrations.trainer.stream import StreamBatches, ends_epoch, epochs_left
from elastrain.scaling import ScalingConfig, plan


def _steps(n: int, global_batch: int, micro: int, world: int, start: int, steps: int) -> list[list[int]]:
    """Each step's samples over all ranks, in rank order."""
    p = plan(ScalingConfig(global_batch=global_batch, micro_batch=micro), world)
    ranks = [StreamBatches(n, p, r, start, steps, seed=7) for r in range(world)]
    out = []
    for k in range(steps):
        out.append([i for s in ranks for mb in s.step_micro_batches(k) for i in mb])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "global_batch", "micro"), [(37, 8, 4), (64, 16, 8), (10, 12, 3), (5, 4, 4)])
def test_each_step_takes_the_same_samples_at_every_world_size(
    world: int, n: int, global_batch: int, micro: int
) -> None:
    one = _steps(n, global_batch, micro, 1, start=3, steps=9)
    here = _steps(n, global_batch, micro, world, start=3, steps=9)
    assert [sorted(s) for s in here] == [sorted(s) for s in one]
    assert all(len(s) == global_batch for s in here)


@pytest.mark.parametrize(("n", "global_batch"), [(37, 8), (64, 16), (10, 12)])
def test_every_sample_once_per_epoch(n: int, global_batch: int) -> None:
    steps = 3 * n // global_batch + 2
    flat = [i for s in _steps(n, global_batch, 4, 2, start=0, steps=steps) for i in s]
    for epoch in range(len(flat) // n):
        assert sorted(flat[epoch * n : (epoch + 1) * n]) == list(range(n))
    tail = flat[(len(flat) // n) * n :]
    assert len(set(tail)) == len(tail)


def test_resuming_at_a_position_continues_the_same_stream() -> None:
    whole = _steps(23, 6, 2, 2, start=0, steps=10)
    later = _steps(23, 6, 2, 3, start=4 * 6, steps=6)
    assert [sorted(s) for s in later] == [sorted(s) for s in whole[4:]]


def test_a_rank_yields_its_micro_batches_for_the_steps_left() -> None:
    p = plan(ScalingConfig(global_batch=10, micro_batch=2), 3)  # shares 4, 3, 3: two micro-batches each
    s = StreamBatches(50, p, 2, start=0, steps=5, seed=0)
    batches = list(s)
    assert len(batches) == len(s) == 5 * p.accumulation
    assert all(1 <= len(b) <= 2 for b in batches)


def test_the_seed_and_shuffle_decide_the_order() -> None:
    p = plan(ScalingConfig(global_batch=4, micro_batch=4), 1)
    assert StreamBatches(8, p, 0, 0, 2, seed=0, shuffle=False).indices(0, 8) == list(range(8))
    a = StreamBatches(8, p, 0, 0, 2, seed=1).indices(0, 8)
    b = StreamBatches(8, p, 0, 0, 2, seed=2).indices(0, 8)
    assert sorted(a) == sorted(b) == list(range(8)) and a != b


def test_uneven_micro_batch_counts_are_refused_with_the_setting_to_change() -> None:
    p = plan(ScalingConfig(global_batch=5, micro_batch=1), 3)  # shares 2, 2, 1: two micro-batches vs one
    with pytest.raises(DataStateError, match="per_device_train_batch_size"):
        StreamBatches(10, p, 0, 0, 1, seed=0)


def test_an_empty_dataset_is_refused() -> None:
    with pytest.raises(DataStateError, match="empty"):
        StreamBatches(0, plan(ScalingConfig(global_batch=2, micro_batch=2), 1), 0, 0, 1, seed=0)


def test_reading_the_sampler_again_goes_on_from_the_step_the_trainer_reached() -> None:
    """Each of the Trainer's epochs reads the DataLoader again: from the step it reached, whatever was read ahead."""
    p = plan(ScalingConfig(global_batch=8, micro_batch=4), 2)
    reached = [0]
    s = StreamBatches(37, p, 0, 5, 6, seed=7, progress=lambda: reached[0])
    whole = list(s)
    assert len(whole) == len(s) == 6 * p.accumulation
    reached[0] = 4
    assert list(s) == whole[4 * p.accumulation :]
    reached[0] = 6
    assert list(s) == []


@pytest.mark.parametrize(
    ("before", "after", "n", "expected"),
    [
        (0, 16, 1600, False),
        (1584, 1600, 1600, True),  # lands on the epoch's end
        (1592, 1616, 1600, True),  # reads past it: the epoch's last step
        (1600, 1616, 1600, False),  # the next epoch's first step
        (3190, 3214, 1600, True),
        (8, 16, 10, True),
        (0, 25, 10, True),  # a step of more than an epoch
    ],
)
def test_the_step_that_reaches_an_epochs_end_ends_it(before: int, after: int, n: int, expected: bool) -> None:
    assert ends_epoch(before, after, n) is expected


@pytest.mark.parametrize(
    ("next_cursor", "end_cursor", "n", "expected"),
    [
        (0, 3200, 1600, (0, 2)),  # two epochs
        (0, 4800, 1600, (0, 3)),
        (0, 4800, 1608, (0, 3)),  # 200 steps of 24 over 1600 samples
        (1600, 3200, 1600, (1, 2)),  # resumed at the second epoch's start
        (1608, 3200, 1600, (1, 2)),  # resumed in it
        (0, 1920, 1600, (0, 2)),  # max_steps past one epoch: the second is cut short
        (3200, 3200, 1600, (2, 2)),  # nothing left
        (1608, 1608, 1600, (1, 1)),  # nothing left, in an epoch: no epoch's end again
        (0, 160, 1600, (0, 1)),
    ],
)
def test_the_trainer_runs_the_epochs_its_steps_read(
    next_cursor: int, end_cursor: int, n: int, expected: tuple[int, int]
) -> None:
    assert epochs_left(next_cursor, end_cursor, n) == expected


class Stand:
    """A Trainer's stand-in for what reads nothing of it."""


@pytest.mark.parametrize(("strategy", "warned"), [("group_by_length", True), ("random", False), ("sequential", False)])
def test_a_sampling_strategy_the_stream_does_not_follow_is_said_once(
    strategy: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from elastrain.integrations.trainer.dataloader import StreamLoader

    caplog.set_level(logging.INFO, logger="elastrain")
    trainer = Stand()  # elastrain refers to a Trainer weakly: the test holds it
    loader = StreamLoader(trainer=trainer, batch=None, held=None)  # type: ignore[arg-type]
    loader._warn_sampling(strategy)
    loader._warn_sampling(strategy)
    said = caplog.text.count("event=trainer_sampling_replaced")
    assert said == (1 if warned else 0), caplog.text
    if warned:
        assert f"train_sampling_strategy={strategy} instead=random" in caplog.text


def test_a_trainer_subclass_dataloader_of_its_own_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A subclass whose get_train_dataloader never called the Trainer's: the loader built no stream."""
    from transformers import Trainer

    from elastrain.integrations.trainer.dataloader import StreamLoader

    class OwnLoader(Trainer):
        def get_train_dataloader(self):  # type: ignore[no-untyped-def]
            return []

    caplog.set_level(logging.INFO, logger="elastrain")
    trainer = object.__new__(OwnLoader)
    loader = StreamLoader(trainer=trainer, batch=None, held=None)  # type: ignore[arg-type]
    loader.check_own()
    loader.check_own()
    assert caplog.text.count("event=trainer_dataloader_own trainer=OwnLoader") == 1, caplog.text
    caplog.clear()
    trainer = object.__new__(OwnLoader)
    loader = StreamLoader(trainer=trainer, batch=None, held=None)  # type: ignore[arg-type]
    loader.sampler = StreamBatches(8, plan(ScalingConfig(global_batch=4, micro_batch=4), 1), 0, 0, 2, seed=0)
    loader.check_own()  # the Trainer's own get_train_dataloader ran: the stream
    assert "trainer_dataloader_own" not in caplog.text


@pytest.mark.parametrize("own", [True, False])
def test_a_trainer_subclass_sampler_the_stream_does_not_call_is_said_once(
    own: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import Trainer

    from elastrain.integrations.trainer.dataloader import StreamLoader

    class Sampled(Trainer):
        if own:

            def _get_train_sampler(self, train_dataset=None):  # type: ignore[no-untyped-def]
                return None

    caplog.set_level(logging.INFO, logger="elastrain")
    trainer = object.__new__(Sampled)
    loader = StreamLoader(trainer=trainer, batch=None, held=None)  # type: ignore[arg-type]
    loader._warn_sampler()
    loader._warn_sampler()
    assert caplog.text.count("event=trainer_sampler_unused trainer=Sampled") == (1 if own else 0), caplog.text
