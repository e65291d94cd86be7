"""The agent's workers' phase (launcher/phase.py) and its one launch-context builder (launcher/context.py)."""

from __future__ import annotations

import pytest

from elastrain.env import StartReason
from elastrain.launcher.context import ContextBuilder
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.phase import Phase
from elastrain.launcher.regroup import regroup_timeout_s
from elastrain.rendezvous.state import ChangeKind

# (phase, running, failed, in_place): what the agent's seven booleans said of each phase.
TABLE = [
    (Phase.IDLE, False, False, False),
    (Phase.WARMING, False, False, False),
    (Phase.RUNNING, True, False, True),
    (Phase.FENCED, True, False, True),
    (Phase.LEFT_BEHIND, True, False, True),
    (Phase.EXITED, True, False, False),
    (Phase.FAILED, True, True, False),
    (Phase.RESTARTING_AFTER_FAILURE, False, True, False),
    (Phase.CONFIG_ERROR, True, True, False),
]


@pytest.mark.parametrize(("phase", "running", "failed", "in_place"), TABLE)
def test_what_each_phase_says(phase: Phase, running: bool, failed: bool, in_place: bool) -> None:
    assert (phase.running, phase.failed, phase.in_place) == (running, failed, in_place)


def test_a_failure_restart_is_remembered_until_the_round_forms() -> None:
    phase = Phase.RUNNING
    phase = Phase.FAILED  # the verdict: a worker failed on its own
    phase = phase.stopped()
    assert phase is Phase.RESTARTING_AFTER_FAILURE and not phase.running and phase.failed
    phase = phase.round_formed()
    assert phase is Phase.IDLE and not phase.failed
    assert phase.without_change().started() is Phase.RUNNING


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ChangeKind.FENCED, Phase.FENCED),
        (ChangeKind.SUPERSEDED, Phase.LEFT_BEHIND),
        (ChangeKind.EVICTED, Phase.LEFT_BEHIND),
        (ChangeKind.SCALE_UP, Phase.RUNNING),
    ],
)
def test_the_change_at_hand_is_one_value(kind: ChangeKind, expected: Phase) -> None:
    assert Phase.RUNNING.with_change(kind) is expected
    assert Phase.FENCED.with_change(kind) is expected  # the latest change is the one at hand
    assert expected.without_change() is Phase.RUNNING
    # Failed or exited workers are judged by that, not by a later change.
    assert Phase.EXITED.with_change(kind) is Phase.EXITED
    assert Phase.FAILED.with_change(kind) is Phase.FAILED


def test_new_workers_start_with_no_change_at_hand() -> None:
    for phase in (Phase.IDLE, Phase.WARMING):
        assert phase.without_change() is phase
        assert phase.started() is Phase.RUNNING
    assert Phase.CONFIG_ERROR.started() is Phase.CONFIG_ERROR
    assert Phase.RUNNING.stopped() is Phase.IDLE


def test_one_builder_for_a_round_and_for_a_warm_start() -> None:
    options = ElastrainOptions(checkpoint_dir="/ckpt", live=True, first_step_timeout_s=1200.0)
    builder = ContextBuilder(options, "job", "/control")
    ctx = builder.for_round(4, 1, StartReason.SCALE_UP, 2, 7, first_round=False)
    assert ctx.first_step_timeout_s == builder.warm().first_step_timeout_s == 1200.0
    assert (ctx.run_id, ctx.round, ctx.restart_count, ctx.failure_count) == ("job", 4, 4, 1)
    assert (ctx.start_reason, ctx.previous_world_size, ctx.generation) == (StartReason.SCALE_UP, 2, 7)
    assert (ctx.checkpoint_dir, ctx.control_dir, ctx.live) == ("/ckpt", "/control", True)
    assert ctx.regroup_timeout_s == regroup_timeout_s(options)
    assert not ctx.first_round
    assert builder.for_round(0, 0, StartReason.FIRST_START, None, 1, first_round=True).first_round
    warm = builder.warm()
    assert not warm.first_round  # a warm worker learns it from its first notice
    assert (warm.round, warm.restart_count, warm.failure_count, warm.generation) == (-1, 0, 0, None)
    assert (warm.start_reason, warm.live, warm.regroup_timeout_s) == (
        StartReason.FIRST_START,
        True,
        ctx.regroup_timeout_s,
    )
    restart = ContextBuilder(ElastrainOptions(live=False, first_step_timeout_s=1200.0), "job", "/control").for_round(
        0, 0, StartReason.FIRST_START, None, None, first_round=True
    )
    assert (restart.live, restart.regroup_timeout_s, restart.checkpoint_dir) == (False, None, None)
    assert restart.first_step_timeout_s is None  # a live world's bound: nothing to a worker that restarts
    assert not restart.first_round  # a worker that restarts at every change joins where it sets up
