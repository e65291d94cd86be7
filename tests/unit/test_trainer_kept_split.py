"""The new world's split of a step lost to a SIGKILL, where survivors kept finished micro-batches (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrain.integrations.trainer.kept_split import LossScale, Offer, rescale, split_step, usable
from elastrain.integrations.trainer.stream import StreamBatches
from elastrain.scaling import ScalingConfig, plan


def offer(*offsets: int, step: int = 5, cursor: int = 60, global_batch: int = 12) -> Offer:
    return Offer(step, cursor, global_batch, tuple(offsets))


def test_the_bench_case_two_survivors_each_keep_their_first_micro_batch() -> None:
    # 3 ranks x 2 micro-batches of 2 (global batch 12); rank 2 died; ranks 0 and 1 finished their first micro-batch.
    # The new world of 2 runs 3 micro-batches of 2: the kept one, then 2 of the 8 samples left each.
    split = split_step([offer(0, 1), offer(4, 5)], step=5, cursor=60, global_batch=12, micro_batch=2, accumulation=3)
    assert split is not None and split.kept == (True, True) and split.kept_samples == 4
    assert split.micro_batches[0] == ((0, 1), (2, 3), (6, 7))
    assert split.micro_batches[1] == ((4, 5), (8, 9), (10, 11))


@pytest.mark.parametrize(
    ("offers", "why"),
    [
        ([offer(0, 1, step=4), None], "another step"),
        ([offer(0, 1, cursor=48), None], "another position"),
        ([offer(0, 1, global_batch=24), None], "another global batch"),
        ([offer(0, 12), None], "outside the batch"),
        ([offer(0, 0), None], "a position twice"),
        ([None, None], "nothing kept"),
    ],
)
def test_an_offer_for_another_step_or_position_is_not_kept(offers: list[Offer | None], why: str) -> None:
    assert split_step(offers, step=5, cursor=60, global_batch=12, micro_batch=2, accumulation=3) is None, why


def test_overlapping_offers_keep_the_lower_rank_s() -> None:
    assert usable([offer(0, 1), offer(1, 2), offer(3)], 5, 60, 12) == [(0, 1), (), (3,)]


def test_a_keeper_must_still_compute_a_micro_batch() -> None:
    # One micro-batch per rank: its backward carries the all-reduce, so nothing can be kept.
    assert split_step([offer(0, 1), None], 5, 60, 12, micro_batch=6, accumulation=1) is None


def test_when_the_rest_cannot_fill_every_micro_batch_the_smallest_keeper_computes_again() -> None:
    # 5 samples, 2 ranks x 2 micro-batches: with both keeping 2, one sample is left for two micro-batches. Rank 0's
    # (the smallest, the lower rank on a tie) go back to the rest.
    both = [offer(0, 1, global_batch=5), offer(2, 3, global_batch=5)]
    split = split_step(both, 5, 60, 5, micro_batch=2, accumulation=2)
    assert split is not None and split.kept == (False, True)
    assert split.micro_batches == (((0,), (1,)), ((2, 3), (4,)))
    # Nothing fits: micro-batches of one sample, and a keeper would leave too few for the others.
    assert split_step([offer(0, 1, 2, global_batch=4), offer(3, global_batch=4)], 5, 60, 4, 1, 2) is None


@given(
    st.integers(1, 5),  # world
    st.integers(1, 4),  # micro
    st.integers(2, 4),  # accumulation
    st.data(),
)
def test_every_position_once_every_rank_the_same_count_keepers_first(
    world: int, micro: int, acc: int, data: st.DataObject
) -> None:
    global_batch = data.draw(st.integers(world * acc, world * acc * micro))
    positions = list(range(global_batch))
    offers: list[Offer | None] = []
    free = set(positions)
    for _ in range(world):
        if data.draw(st.booleans()):
            n = data.draw(st.integers(1, max(1, min(len(free), micro * (acc - 1)))))
            picked = tuple(sorted(data.draw(st.permutations(sorted(free))))[:n]) if free else ()
            free -= set(picked)
            offers.append(offer(*picked, global_batch=global_batch) if picked else None)
        else:
            offers.append(None)
    split = split_step(offers, 5, 60, global_batch, micro, acc)
    if split is None:
        return
    flat = [o for mbs in split.micro_batches for mb in mbs for o in mb]
    assert sorted(flat) == positions
    assert all(len(mbs) == acc for mbs in split.micro_batches)
    for r, mbs in enumerate(split.micro_batches):
        computed = mbs[1:] if split.kept[r] else mbs
        assert all(1 <= len(mb) <= micro for mb in computed)
        if split.kept[r]:
            kept = offers[r]
            assert kept is not None and mbs[0] == kept.offsets
    loads = [
        sum(len(mb) for mb in (mbs[1:] if k else mbs)) for mbs, k in zip(split.micro_batches, split.kept, strict=True)
    ]
    slots = [acc - (1 if k else 0) for k in split.kept]
    # Every rank computes about as many samples, unless its micro-batches are full.
    for r, load in enumerate(loads):
        assert load == slots[r] * micro or load >= max(loads) - 1


@pytest.mark.parametrize(
    ("old", "new", "factor"),
    [
        (LossScale(items=96.0, world=3), LossScale(items=96.0, world=2), 2 / 3),  # tokens counted over the world
        (LossScale(items=40.0), LossScale(items=60.0), 40 / 60),  # this rank's own token count
        (LossScale(accumulation=2), LossScale(accumulation=3), 2 / 3),  # a mean loss over each micro-batch
        (LossScale(), LossScale(), 1.0),
    ],
)
def test_kept_gradients_are_rescaled_to_the_new_world_s_loss_scaling(
    old: LossScale, new: LossScale, factor: float
) -> None:
    assert rescale(old, new) == pytest.approx(factor)


def test_the_stream_s_first_step_follows_the_split_then_the_plan() -> None:
    p = plan(ScalingConfig(global_batch=12, micro_batch=2), 2)
    split = split_step([offer(0, 1, cursor=0), offer(4, 5, cursor=0)], 5, 0, 12, p.micro_batch, p.accumulation)
    assert split is not None
    ranks = [StreamBatches(50, p, r, 0, 3, seed=1, first=split.micro_batches[r]) for r in range(2)]
    plain = [StreamBatches(50, p, r, 0, 3, seed=1) for r in range(2)]
    for k in range(3):
        got = sorted(i for s in ranks for mb in s.step_micro_batches(k) for i in mb)
        assert got == sorted(i for s in plain for mb in s.step_micro_batches(k) for i in mb)
    samples = ranks[0].indices(0, 12)
    assert ranks[0].step_micro_batches(0)[0] == [samples[0], samples[1]]
    assert ranks[1].step_micro_batches(0)[0] == [samples[4], samples[5]]
    assert ranks[0].step_micro_batches(1) == plain[0].step_micro_batches(1)
    assert len(list(ranks[0])) == len(ranks[0]) == 3 * p.accumulation
