"""ElasticSampler: world-size independent order, exact resume, epoch ends, DataLoader use."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from elastrain.data import ElasticSampler, EpochEnd, Position, step_range
from elastrain.errors import DataStateError
from elastrain.scaling import ScalingConfig, plan


def samplers(n: int, world: int, global_batch: int, micro: int, **kw: object) -> list[ElasticSampler]:
    p = plan(ScalingConfig(global_batch=global_batch, micro_batch=micro), world)
    return [ElasticSampler(n, p, r, **kw) for r in range(world)]  # type: ignore[arg-type]


def run_steps(ss: list[ElasticSampler], count: int) -> list[list[int]]:
    """``count`` global steps over all ranks: each step's indices in rank order; commits them."""
    out = []
    for _ in range(count):
        steps = [next(iter(s.steps())) for s in ss]
        out.append([i for st in steps for mb in st.micro_batches for i in mb])
        for s, st in zip(ss, steps, strict=True):
            s.commit(st)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_order_does_not_depend_on_world_size(world: int) -> None:
    ref = run_steps(samplers(50, 1, 8, 8, seed=7), 6)
    assert run_steps(samplers(50, world, 8, 3, seed=7), 6) == ref


def test_resume_at_any_world_size_uses_every_sample_once() -> None:
    n, g = 100, 8
    seen: list[int] = []
    state = None
    schedule = [(2, 3), (1, 2), (3, 4), (2, 5), (3, 3)]  # (world, steps): 17 steps = 13 (epoch 0) + 4
    for world, count in schedule:
        ss = samplers(n, world, g, 3, seed=1)
        if state is not None:
            for s in ss:
                s.load_state_dict(json.loads(json.dumps(state)))
        for step in run_steps(ss, count):
            seen.extend(step)
        state = ss[0].state_dict()
    epoch0, epoch1 = seen[:100], seen[100:]
    assert sorted(epoch0) == list(range(100))  # 12 full steps + a partial step of 4
    assert len(epoch1) == 4 * 8 and len(set(epoch1)) == 32
    assert state == {"version": 1, "epoch": 1, "cursor": 32, "num_samples": 100, "seed": 1, "shuffle": True}


def test_epochs_are_reshuffled_deterministically() -> None:
    (s,) = samplers(20, 1, 5, 5, seed=3)
    e0 = [i for mb in s for i in mb]
    for st in list(s.steps()):
        s.commit(st)
    assert s.epoch == 1
    e1 = [i for mb in s for i in mb]
    assert sorted(e0) == sorted(e1) == list(range(20))
    assert e0 != e1
    (again,) = samplers(20, 1, 5, 5, seed=3)
    assert [i for mb in again for i in mb] == e0


@pytest.mark.parametrize(
    ("mode", "sizes", "end"),
    [
        (EpochEnd.PARTIAL, [8, 8, 4], Position(1, 0)),
        (EpochEnd.DROP, [8, 8], Position(1, 0)),
        (EpochEnd.WRAP, [8, 8, 8], Position(1, 4)),
    ],
)
def test_epoch_end_modes(mode: EpochEnd, sizes: list[int], end: Position) -> None:
    pos = Position(0, 0)
    got = []
    while pos.epoch == 0:
        rng = step_range(pos, 20, 8, 3, mode)
        if rng.start.epoch:
            break
        got.append(rng.size)
        pos = rng.end
    assert got == sizes
    assert pos == end


def test_partial_tail_smaller_than_world_is_skipped() -> None:
    # 17 = 2 * 8 + 1: a one-sample tail cannot feed 2 workers.
    rng = step_range(Position(0, 8), 17, 8, 2, EpochEnd.PARTIAL)
    assert rng.end == Position(1, 0)
    assert step_range(Position(0, 16), 17, 8, 2, EpochEnd.PARTIAL).start == Position(1, 0)
    assert step_range(Position(0, 16), 17, 8, 1, EpochEnd.PARTIAL).size == 1


def test_wrap_spans_epochs_without_repeats() -> None:
    (s,) = samplers(10, 1, 4, 4, seed=0, epoch_end="wrap")
    steps = list(s.steps())
    assert [st.global_size for st in steps] == [4, 4, 4]
    flat = [i for st in steps for mb in st.micro_batches for i in mb]
    assert sorted(flat[:10]) == list(range(10))
    for st in steps:
        s.commit(st)
    assert s.position == Position(1, 2)
    nxt = [i for mb in s for i in mb]
    assert sorted(flat[10:] + nxt[:8]) == list(range(10))


def test_commit_out_of_order_is_refused() -> None:
    (s,) = samplers(40, 1, 8, 8)
    steps = list(s.steps())
    with pytest.raises(DataStateError, match="in order"):
        s.commit(steps[1])


def test_state_must_match_the_dataset() -> None:
    (s,) = samplers(40, 1, 8, 8, seed=1)
    state = s.state_dict()
    (other,) = samplers(41, 1, 8, 8, seed=1)
    with pytest.raises(DataStateError, match="num_samples"):
        other.load_state_dict(state)
    (other,) = samplers(40, 1, 8, 8, seed=2)
    with pytest.raises(DataStateError, match="seed"):
        other.load_state_dict(state)


def test_impossible_configurations() -> None:
    with pytest.raises(DataStateError, match="epoch_end"):
        samplers(5, 1, 8, 8, epoch_end="drop")
    with pytest.raises(DataStateError, match="fewer workers"):
        samplers(2, 3, 3, 1)


class Squares(Dataset[tuple[int, torch.Tensor]]):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.tensor([float(i * i)])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_works_as_a_dataloader_batch_sampler(num_workers: int) -> None:
    ss = samplers(30, 2, 7, 2, seed=5)
    per_rank = []
    for s in ss:
        loader = DataLoader(Squares(), batch_sampler=s, num_workers=num_workers, pin_memory=False)
        assert len(loader) == len(s)
        per_rank.append([int(i) for ids, x in loader for i in ids])
    counts = Counter(per_rank[0] + per_rank[1])
    assert sorted(counts) == list(range(30)) and set(counts.values()) == {1}


def test_iterable_datasets_are_refused() -> None:
    p = plan(ScalingConfig(global_batch=4), 1)
    with pytest.raises(DataStateError, match="map-style"):
        ElasticSampler(iter(range(10)), p, 0)  # type: ignore[arg-type]
