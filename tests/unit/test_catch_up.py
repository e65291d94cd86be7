"""The catch-up's pure parts: who contributes to a world's first step, and when DDP allows a member to sit it out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastrain.scaling import Policy, ScalingConfig, plan
from elastrain.session.catch_up import CatchUp, eligible, worth_it
from elastrain.session.config import DataConfig
from elastrain.session.feed import Feed


@pytest.mark.parametrize(
    ("holders", "rank", "contributors", "idle", "index"),
    [
        ((0, 1), 2, 2, True, 0),  # a joiner at the end
        ((0, 1), 0, 2, False, 0),
        ((1, 2), 0, 2, True, 0),  # a joiner that got rank 0
        ((1, 2), 2, 2, False, 1),
        ((0, 2), 1, 2, True, 0),  # a member ahead of the agreed step, in the middle
        ((3,), 0, 1, True, 0),  # one holder, three needy
        ((3,), 3, 1, False, 0),
    ],
)
def test_a_world_first_step_is_the_holders(
    holders: tuple[int, ...], rank: int, contributors: int, idle: bool, index: int
) -> None:
    share = CatchUp(holders, rank, 5)
    assert (share.contributors, share.idle, share.index) == (contributors, idle, index)


@given(st.integers(2, 12).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))))
def test_the_holders_indices_are_the_data_plan_ranks_of_the_step(case: tuple[int, set[int]]) -> None:
    world, held = case
    holders = tuple(sorted(held))
    indices = sorted(CatchUp(holders, r, 5).index for r in range(world) if not CatchUp(holders, r, 5).idle)
    assert indices == list(range(len(holders)))  # every part of the holders' plan once, nobody else's


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))


@pytest.mark.parametrize(
    ("module", "kwargs", "expected"),
    [
        (torch.nn.Linear(4, 4), {}, True),
        (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), {}, True),
        (_WithBuffer(), {}, False),  # DDP broadcasts the buffer in the forward: a collective the idle never joins
        (_WithBuffer(), {"broadcast_buffers": False}, True),
        (torch.nn.BatchNorm1d(4), {}, False),
        (torch.nn.Linear(4, 4), {"find_unused_parameters": True}, False),
        (torch.nn.Linear(4, 4), {"static_graph": True}, False),
        (torch.nn.Linear(4, 4), {"bucket_cap_mb": 1, "gradient_as_bucket_view": True}, True),
    ],
)
def test_a_member_sits_a_step_out_only_where_ddp_syncs_nothing_but_gradients(
    module: torch.nn.Module, kwargs: dict[str, object], expected: bool
) -> None:
    assert eligible(module, kwargs) is expected


def test_an_idle_rank_steps_through_the_holders_ranges_without_data() -> None:
    config = ScalingConfig(policy=Policy.LINEAR, micro_batch=2, accumulation=1)
    feed = Feed(list(range(40)), DataConfig(), torch.device("cpu"))
    two = plan(config, 2)
    feed.build(two, 0)
    holder = Feed(list(range(40)), DataConfig(), torch.device("cpu"))
    holder.build(two, 1)
    feed.replan(two, 0, idle=True)
    idle_step, datas = feed.next()
    held_step, _ = holder.next()
    assert idle_step.micro_batches == () and datas == []
    assert idle_step.range == held_step.range and idle_step.global_size == held_step.global_size == 4
    feed.require_sampler().commit(idle_step)  # the idle rank's cursor moves as the holders' does
    holder.require_sampler().commit(held_step)
    assert feed.require_sampler().position == holder.require_sampler().position
    feed.replan(plan(config, 3), 2)  # the world whole again: this rank takes its part
    whole, data = feed.next()
    assert len(whole.micro_batches) == 1 and len(data) == 1 and whole.global_size == 6


@pytest.mark.parametrize(
    ("holders", "trained_at", "sit_out"),
    [
        (2, 2, True),  # a node joins two: the holders compute what they computed before
        (1, 1, True),  # a node joins one
        (4, 4, True),
        (1, 3, False),  # a SIGKILL of one of three, a survivor rolled back: one holder would do twice the work
        (1, 2, False),  # a spare promoted after a death in a world of two
        (2, 3, False),  # a death and a join in the same round
        (3, 2, True),
        (1, None, True),  # unknown: as before
    ],
)
def test_the_needy_sit_out_only_where_the_holders_compute_no_more_than_before(
    holders: int, trained_at: int | None, sit_out: bool
) -> None:
    assert worth_it(holders, trained_at) is sit_out
