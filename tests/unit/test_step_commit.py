"""A step's mean loss and metrics around a regroup that comes after its gradient sync (live mode).

The step's loss sum rides on its gradient sync (StepFlags totals); a regroup may come later in the same
step (its save's collective broke, its flags' own all-reduce broke). The step then reports the loss of the
world that computed it, never a sum over another world's group, and a step the new world rolled back is
given up (its re-run logs it). A stand-in session: only what ``Step`` reads of it (its ``StepHost``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from elastrain.data import RankStep
from elastrain.session.step import LOSS_TOTAL, MicroBatch, Step
from elastrain.step_flags import StepFlags


class _Session:
    """What Step uses of a Session, with ``finish_step`` optionally moving it to a new world (a regroup)."""

    def __init__(self, world_size: int, total: float | None, regroup_to: tuple[int, int] | None = None) -> None:
        self.state = SimpleNamespace(step=9)
        self.world_size = world_size
        self.segment = "old"
        self.distributed = True
        self.device = torch.device("cpu")
        self.model = torch.nn.Linear(1, 1)
        self._flags = StepFlags()
        self._flags.add("save", lambda: False)
        self._flags.add_total(LOSS_TOTAL, lambda: 0.0)
        if total is not None:  # what the step's gradient sync agreed: [save, loss]
            packed = self._flags.pack(torch.zeros(0))
            packed[-1] = total
            self._flags.unpack(packed, torch.zeros(0))
        self.regroup_to = regroup_to  # (new world size, agreed step) when finish_step regroups
        self.reduced: list[torch.Tensor] = []
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.sat_out: list[Step] = []
        self.holders: int | None = None  # a catch-up's first step: the ranks that compute it

    @property
    def contributors(self) -> int:
        return self.holders if self.holders is not None else self.world_size

    def agreed_total(self, name: str) -> float | None:
        return self._flags.total(name) if self.distributed else None

    def sit_out(self, step: Step) -> None:
        self.sat_out.append(step)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.reduced.append(tensor)

    def collective_broke(self, exc: BaseException, step: Step | None, group_error: bool) -> None:
        raise exc

    def finish_step(self, step: Step) -> None:
        self.state.step = step.number
        if self.regroup_to is not None:  # the save's collective broke; the vote decided the agreed step
            self.world_size, self.state.step = self.regroup_to
            self.segment = "new"

    def log(self, step: int, **values: Any) -> None:
        self.logged.append((step, values))


def _step(session: _Session) -> Step:
    rank_step = RankStep(range=SimpleNamespace(start=SimpleNamespace(epoch=0), size=12), micro_batches=((0, 1),),
                         world_size=session.world_size)  # type: ignore[arg-type]  # fmt: skip
    return Step(session, rank_step, [MicroBatch(None, [0, 1], 1.0)], lr=None)  # type: ignore[arg-type]


def test_the_loss_that_rode_the_sync_is_the_mean_over_the_world_that_computed_it() -> None:
    session = _Session(world_size=3, total=6.0, regroup_to=(2, 10))  # 3 -> 2 after the sync; the step stands
    step = _step(session)
    step.optimizer_step()
    assert not step.abandoned
    assert step.mean_loss() == 2.0 and session.reduced == []  # 6 / 3, no collective
    step.log(loss=step.mean_loss())
    assert session.logged == [(10, {"loss": 2.0})]


def test_a_step_the_new_world_rolled_back_is_given_up_and_logs_nothing() -> None:
    session = _Session(world_size=3, total=None, regroup_to=(2, 9))  # agreed on step 9: step 10 runs again
    step = _step(session)
    step.optimizer_step()
    assert step.abandoned
    assert math.isnan(step.mean_loss()) and session.reduced == []
    step.log(loss=1.0)
    assert session.logged == []


def test_a_loss_no_sync_carried_is_not_summed_in_a_later_world() -> None:
    # The shares were scaled for 3 ranks and one of them is gone: a sum over the new group would be wrong.
    session = _Session(world_size=3, total=None, regroup_to=(2, 10))
    step = _step(session)
    step.optimizer_step()
    assert math.isnan(step.mean_loss()) and session.reduced == []
    step.log(loss=step.mean_loss(), lr=0.1)
    assert session.logged == []


def test_without_a_regroup_a_loss_no_sync_carried_is_summed_by_its_own_all_reduce() -> None:
    session = _Session(world_size=2, total=None)
    step = _step(session)
    step.loss_sum = torch.tensor(3.0, dtype=torch.float64)
    step.optimizer_step()
    assert step.mean_loss() == 1.5 and len(session.reduced) == 1


def test_a_rank_without_micro_batches_sits_the_step_out_once_and_the_loss_is_the_contributors_mean() -> None:
    session = _Session(world_size=3, total=6.0)
    session.holders = 2  # two holders computed the step; this rank joined its gradient sync with zeros
    rank_step = RankStep(range=SimpleNamespace(start=SimpleNamespace(epoch=0), size=12), micro_batches=(),
                         world_size=2)  # type: ignore[arg-type]  # fmt: skip
    step = Step(session, rank_step, [], lr=None)  # type: ignore[arg-type]
    assert list(step) == [] and session.sat_out == [step]  # at the end of the (empty) micro-batch loop
    step.optimizer_step()
    assert session.sat_out == [step]  # once
    assert step.mean_loss() == 3.0  # the holders' sum over the holders, not over the world


def test_a_step_never_iterated_still_sits_out_before_its_optimizer_step() -> None:
    session = _Session(world_size=3, total=6.0)
    rank_step = RankStep(range=SimpleNamespace(start=SimpleNamespace(epoch=0), size=12), micro_batches=(),
                         world_size=3)  # type: ignore[arg-type]  # fmt: skip
    step = Step(session, rank_step, [], lr=None)  # type: ignore[arg-type]
    step.optimizer_step()
    assert session.sat_out == [step]
