"""The save schedule (pure rules and the trigger) and the save-request channel's answers (no torch.distributed)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from elastrain.checkpoint.schedule import (
    DEFAULT_INTERVAL_SECONDS,
    FINAL,
    SaveReason,
    SaveSchedule,
    SaveTrigger,
    decide,
)
from elastrain.control import ControlChannel, SaveAck, SaveCause, SaveRequest
from elastrain.errors import CheckpointError


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"interval_steps": 0}, "interval_steps"),
        ({"interval_seconds": 0.0}, "interval_seconds"),
        ({"interval_seconds": math.nan}, "interval_seconds"),
        ({"hold_after_request_s": -1.0}, "hold_after_request_s"),
        ({"agree_every_steps": 0}, "sync_every_steps"),
    ],
)
def test_bad_schedules_name_the_argument(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(CheckpointError, match=flag):
        SaveSchedule(**kwargs)  # type: ignore[arg-type]


def test_default_interval() -> None:
    assert SaveSchedule.default().interval_seconds == DEFAULT_INTERVAL_SECONDS
    assert SaveSchedule.default(interval_steps=5).interval_seconds is None
    assert not SaveSchedule.default(interval_seconds=math.inf).timed


EVERY_3 = SaveSchedule(interval_steps=3)


@pytest.mark.parametrize(
    ("schedule", "step", "last", "timed", "requested", "want"),
    [
        (EVERY_3, 3, None, False, False, SaveReason.INTERVAL),
        (EVERY_3, 4, 3, False, False, None),
        (EVERY_3, 3, 3, False, True, None),  # already saved at this step
        (EVERY_3, 4, 3, False, True, SaveReason.REQUEST),  # a request wins over the interval
        (EVERY_3, 6, 3, False, True, SaveReason.REQUEST),
        (SaveSchedule(interval_seconds=60.0), 7, 2, True, False, SaveReason.INTERVAL),
        (SaveSchedule(), 7, 2, False, False, None),
    ],
)
def test_decide(
    schedule: SaveSchedule, step: int, last: int | None, timed: bool, requested: bool, want: SaveReason | None
) -> None:
    assert decide(schedule, step, last, timed, requested) is want


def test_a_request_any_rank_saw_makes_every_rank_save_at_the_same_step(tmp_path: Path) -> None:
    # The agreement is an element-wise max over ranks: here the other rank saw the request.
    seen: list[list[int]] = []

    def agree(flags: list[int]) -> list[int]:
        seen.append(flags)
        return [flags[0], 1]

    trigger = SaveTrigger(SaveSchedule(agree_every_steps=2), ControlChannel(tmp_path), agree)
    assert trigger.check(1) is None and seen == []  # agreement only every 2 steps
    assert trigger.check(2) is SaveReason.REQUEST and seen == [[0, 0]]
    assert trigger.claim() is None  # this rank's channel holds no request
    trigger.started(2)
    assert trigger.check(2) is None


def test_schedule_can_be_replaced_between_steps(tmp_path: Path) -> None:
    trigger = SaveTrigger(SaveSchedule(interval_steps=10), None, None)
    assert trigger.check(4) is None
    trigger.schedule = SaveSchedule(interval_steps=2)
    assert trigger.check(4) is SaveReason.INTERVAL


def test_an_ack_answers_every_request_older_than_the_state_it_saved() -> None:
    req = SaveRequest(request_id=1, reason="scale-up", requested_at=100.0)
    assert SaveAck(step=5, checkpoint="c", current_at=100.0).answers(req)
    assert SaveAck(step=5, checkpoint="c", current_at=150.0).answers(req)
    assert not SaveAck(step=5, checkpoint="c", current_at=99.9).answers(req)


def test_an_agent_that_asks_after_the_save_started_accepts_its_commit(tmp_path: Path) -> None:
    agent_a, agent_b = ControlChannel(tmp_path / "a"), ControlChannel(tmp_path / "b")
    # Node A's agent asked first; the job-wide save (synchronous) started; node B's agent asks meanwhile.
    req_a = agent_a.request_save(SaveCause.SCALE_UP, "waiting")
    started = time.time()
    req_b = agent_b.request_save(SaveCause.SCALE_UP, "waiting")
    committed = time.time()
    for directory in (tmp_path / "a", tmp_path / "b"):
        trigger = SaveTrigger(SaveSchedule(), ControlChannel(directory), None)
        assert trigger.claim() is not None
        trigger.committed(7, "/ckpt/step-7", committed)  # a blocking save: training waited until now
    for agent, req in ((agent_a, req_a), (agent_b, req_b)):
        ack = agent.wait_ack(req.request_id, timeout_s=1.0)
        assert ack is not None and (ack.step, ack.request_id) == (7, req.request_id)
    # An asynchronous save holds the state of when it was staged: a later request is not answered by it.
    late = agent_b.request_save(SaveCause.LEAVE, "SIGTERM")
    trigger = SaveTrigger(SaveSchedule(), ControlChannel(tmp_path / "b"), None)
    trigger.committed(8, "/ckpt/step-8", started)
    assert agent_b.ack_for(late) is None
    assert trigger.check(9) is SaveReason.REQUEST  # the worker saves again for it


def test_a_save_training_goes_on_from_answers_only_the_requests_made_before_its_step_ended(tmp_path: Path) -> None:
    """The Trainer's own scheduled save: a SIGTERM's request made while it was written is left to the next step's
    save, after which the ranks hold (a leaving node's workers then stop outside a step); when training ends right
    after such a save (the last step, or stopped early), that save answers it."""
    agent = ControlChannel(tmp_path)
    trigger = SaveTrigger(SaveSchedule(interval_steps=40), ControlChannel(tmp_path), None)
    assert trigger.check(120) is SaveReason.INTERVAL  # the ranks read no request for step 120
    assert trigger.claim("interval") is None and trigger.bound("interval") <= time.time()
    bound = trigger.bound("interval")
    leave = agent.request_save(SaveCause.LEAVE, "SIGTERM")  # while checkpoint-120 is written
    trigger.committed(120, "/ckpt/checkpoint-120", time.time(), bound=bound)
    assert agent.ack_for(leave) is None
    assert agent.latest_ack() is not None and agent.latest_ack().step == 120  # type: ignore[union-attr]
    assert trigger.check(121) is SaveReason.REQUEST
    assert trigger.claim() == leave
    assert trigger.bound("request") == math.inf
    trigger.committed(121, "/ckpt/checkpoint-121", time.time(), defer_answer=True)
    assert agent.ack_for(leave) is None
    trigger.answer()  # at the hold
    ack = agent.ack_for(leave)
    assert ack is not None and ack.step == 121
    assert trigger.check(160) is SaveReason.INTERVAL
    bound = trigger.bound("explicit")  # the script's own save: training goes on from it too
    early = agent.request_save(SaveCause.LEAVE, "SIGTERM")  # while step 160's is written; then training stops early
    trigger.committed(160, "/ckpt/checkpoint-160", time.time(), bound=bound)
    assert agent.ack_for(early) is None
    trigger.answer_at_end(161)  # not the step of the last commit: nothing to answer with
    assert agent.ack_for(early) is None
    trigger.answer_at_end()  # the last step checked, 160
    ack = agent.ack_for(early)
    assert ack is not None and ack.step == 160
    assert trigger.check(200) is SaveReason.INTERVAL
    bound = trigger.bound("interval")
    last = agent.request_save(SaveCause.LEAVE, "SIGTERM")  # while the last step's checkpoint is written
    trigger.committed(200, "/ckpt/checkpoint-200", time.time(), bound=bound)
    trigger.answer_at_end(200)  # training ended there
    ack = agent.ack_for(last)
    assert ack is not None and ack.step == 200
    final = agent.request_save(SaveCause.LEAVE, "SIGTERM")  # a final save answers every request made until its commit
    trigger.committed(201, "/ckpt/checkpoint-201", time.time(), bound=trigger.bound(FINAL))
    ack = agent.ack_for(final)
    assert ack is not None and ack.step == 201


def test_what_a_rank_read_between_agreements_is_not_agreed_on(tmp_path: Path) -> None:
    """With agreements every few steps, a request read at a step without one bounds no save: the last agreement's
    reading does."""
    agent = ControlChannel(tmp_path)
    agreements: list[list[int]] = []
    trigger = SaveTrigger(
        SaveSchedule(interval_steps=3, agree_every_steps=2),
        ControlChannel(tmp_path),
        lambda v: agreements.append(v) or v,
    )
    assert trigger.check(2) is None and len(agreements) == 1
    agreed = trigger.bound("interval")
    leave = agent.request_save(SaveCause.LEAVE, "SIGTERM")
    assert trigger.check(3) is SaveReason.INTERVAL and len(agreements) == 1  # read, not agreed on
    assert trigger.bound("interval") == agreed < leave.requested_at
    assert trigger.check(4) is SaveReason.REQUEST and trigger.bound("interval") > leave.requested_at


def test_a_request_during_the_hold_is_answered_by_the_held_checkpoint(tmp_path: Path) -> None:
    agent = ControlChannel(tmp_path)
    trigger = SaveTrigger(SaveSchedule(hold_after_request_s=1.0), ControlChannel(tmp_path), None)
    first = agent.request_save(SaveCause.SCALE_UP, "waiting")
    trigger.claim()
    trigger.committed(3, "/ckpt/step-3", time.time())
    assert agent.ack_for(first) is not None
    later = agent.request_save(SaveCause.SCALE_UP, "another node's view")
    assert agent.ack_for(later) is None
    t0 = time.monotonic()
    trigger.hold(3)  # no restart comes: it holds the whole second, answering the later request meanwhile
    assert time.monotonic() - t0 >= 1.0
    ack = agent.ack_for(later)
    assert ack is not None and ack.step == 3
    assert trigger.check(4) is None  # answered: no second save for it


def test_restarted_workers_do_not_save_again_for_a_request_already_answered(tmp_path: Path) -> None:
    agent = ControlChannel(tmp_path)
    agent.request_save(SaveCause.SCALE_UP, "waiting")
    before = SaveTrigger(SaveSchedule(), ControlChannel(tmp_path), None)
    assert before.claim() is not None
    before.committed(5, "/ckpt/step-5", time.time())
    after = ControlChannel(tmp_path)  # a worker of the next round: the request file is still there
    assert after.pending() is None
    agent.request_save(SaveCause.LEAVE, "SIGTERM")
    assert after.pending() is not None
