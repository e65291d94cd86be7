"""StepFlags: what one rank appends to the step's last gradient bucket, and what the sum tells every rank."""

from __future__ import annotations

import pytest
import torch

from elastrain.checkpoint.schedule import SaveReason, SaveSchedule, SaveTrigger
from elastrain.step_flags import StepFlags


def _rank(raised: dict[str, bool]) -> StepFlags:
    flags = StepFlags()
    for name, value in raised.items():
        flags.add(name, lambda v=value: v)
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 300])
def test_a_flag_is_agreed_when_any_rank_raised_it_and_the_gradients_come_back_whole(
    dtype: torch.dtype, world: int
) -> None:
    grads = [torch.full((5,), float(r), dtype=dtype) / world for r in range(world)]
    ranks = [_rank({"save": r == world - 1, "stop": False, "all": True}) for r in range(world)]
    packed = [f.pack(g) for f, g in zip(ranks, grads, strict=True)]
    total = torch.stack(packed).sum(dim=0, dtype=dtype)  # what the SUM all-reduce gives every rank
    for flags, g in zip(ranks, grads, strict=True):
        assert flags.agreed() is None  # nothing agreed before the sync
        out = flags.unpack(total.clone(), g)
        assert out is g and torch.equal(g, total[:5])
        assert flags.agreed() == {"save": True, "stop": False, "all": True}
        flags.begin_step()
        assert flags.agreed() is None


def test_the_save_trigger_decides_from_the_agreed_flags_without_its_own_collective() -> None:
    def no_collective(values: list[int]) -> list[int]:
        raise AssertionError("the trigger ran its own agreement although the step's sync carried the flags")

    flags = StepFlags()
    trigger = SaveTrigger(SaveSchedule(interval_seconds=3600.0), None, no_collective)
    trigger.use_flags(flags)
    assert flags.active
    grads = torch.zeros(3)
    packed = flags.pack(grads)
    assert packed.tolist() == [0, 0, 0, 0, 0]  # neither due by the clock nor requested on this rank
    packed[-1] = 1.0  # another rank saw the launcher's request
    flags.unpack(packed, grads)
    assert trigger.check(7) is SaveReason.REQUEST
    flags.unpack(torch.zeros(5), grads)
    assert trigger.check(8) is None
    # A step whose backward made no sync: the trigger's own agreement, on every rank alike.
    flags.begin_step()
    agreed: list[list[int]] = []
    trigger._agree = lambda values: agreed.append(values) or [0, 1]  # type: ignore[assignment, func-returns-value]
    assert trigger.check(9) is SaveReason.REQUEST and agreed == [[0, 0]]


def test_a_released_trigger_leaves_the_flags_it_shared_and_keeps_a_newer_triggers() -> None:
    """A worker's flags outlive each Trainer's trigger; a trigger that stays in them keeps its Trainer alive."""
    flags = StepFlags()
    old, new = SaveTrigger(SaveSchedule(), None, None), SaveTrigger(SaveSchedule(), None, None)
    old.use_flags(flags)
    flags.add("regroup", lambda: False)
    new.use_flags(flags)  # the next Trainer's, before the old one let go
    old.release_flags()
    assert flags.pack(torch.zeros(1)).numel() == 1 + 3  # the new trigger's two flags and the regroup flag
    new.release_flags()
    new.release_flags()  # twice: nothing more to take out
    assert flags.pack(torch.zeros(1)).numel() == 1 + 1 and flags.active


@pytest.mark.parametrize("world", [1, 2, 5])
def test_a_total_rides_with_the_flags_and_sums_over_the_ranks(world: int) -> None:
    # The step's loss: each rank's share (a float64 tensor or a float) summed in the same all-reduce.
    shares = [torch.tensor(0.25 * (r + 1), dtype=torch.float64) for r in range(world)]
    ranks = []
    for r in range(world):
        flags = _rank({"regroup": False})
        flags.add_total("loss", lambda r=r: shares[r] if r % 2 == 0 else float(shares[r]))
        ranks.append(flags)
    grads = [torch.ones(4) for _ in range(world)]
    total = torch.stack([f.pack(g) for f, g in zip(ranks, grads, strict=True)]).sum(dim=0)
    for flags, g in zip(ranks, grads, strict=True):
        assert flags.total("loss") is None
        flags.unpack(total.clone(), g)
        assert flags.agreed() == {"regroup": False}
        assert flags.total("loss") == pytest.approx(sum(float(s) for s in shares))
        assert torch.equal(g, torch.full((4,), float(world)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_sync_carries_no_total(dtype: torch.dtype) -> None:
    # A loss summed in 3 significant digits would be a wrong metric: the caller sums it on its own instead.
    flags = _rank({"save": True})
    flags.add_total("loss", lambda: 1234.567)
    grads = torch.zeros(2, dtype=dtype)
    packed = flags.pack(grads)
    assert packed.numel() == 3
    flags.unpack(packed, grads)
    assert flags.agreed() == {"save": True} and flags.total("loss") is None


def test_agree_sums_the_totals_in_float64_when_no_sync_carried_them() -> None:
    flags = _rank({"save": False})
    flags.add_total("loss", lambda: torch.tensor(1 / 3, dtype=torch.float64))
    seen: list[torch.Tensor] = []
    flags.agree(lambda t: seen.append(t.mul_(2)), torch.device("cpu"))  # two ranks alike
    assert seen[0].dtype == torch.float64
    assert flags.total("loss") == 2 / 3 and flags.agreed() == {"save": False}
