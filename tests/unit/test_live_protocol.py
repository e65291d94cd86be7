"""Live reconfiguration's pure parts: the agreement rule, the regroup notices on the control channel,
the environment a worker rewrites after a regroup, and the --live option."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from elastrain.control import RegroupChannel, RegroupNotice
from elastrain.env import LaunchContext, StartReason, WorkerEnv, regrouped_environ, to_environ
from elastrain.launcher.options import build_parser, options_from_args
from elastrain.live.agreement import Agreement, Ballot, decide


@pytest.mark.parametrize(
    ("ballots", "expected"),
    [
        # Nobody holds state (a first start, or every node restarted): load the checkpoint.
        ([Ballot(False, 0), Ballot(False, 0)], Agreement(step=None, source=None, receivers=(0, 1))),
        # Everyone at the same step: the lowest rank sends, nobody rolls back.
        ([Ballot(True, 7), Ballot(True, 7)], Agreement(step=7, source=0)),
        # Rank 0 applied step 8 (its all-reduce completed), rank 1's failed: back to 7, sent by rank 1.
        ([Ballot(True, 8), Ballot(True, 7)], Agreement(step=7, source=1, behind=(1,), ahead=(0,))),
        # A joining or restarted member receives the state of the members that hold it.
        (
            [Ballot(False, 0), Ballot(True, 5), Ballot(True, 5)],
            Agreement(step=5, source=1, receivers=(0,)),
        ),
        # A restarted member's step (from a checkpoint it did not load) never counts.
        ([Ballot(False, 99), Ballot(True, 3)], Agreement(step=3, source=1, receivers=(0,))),
        (
            [Ballot(True, 4), Ballot(True, 5), Ballot(True, 4), Ballot(False, 0)],
            Agreement(step=4, source=0, behind=(0, 2), ahead=(1,), receivers=(3,)),
        ),
        # A member further behind holds a world the job moved on from (a node cut off by a partition whose
        # workers lived on): it receives, and never rolls the others back to its step.
        (
            [Ballot(True, 151), Ballot(True, 151), Ballot(True, 3)],
            Agreement(step=151, source=0, receivers=(2,), stale=(2,)),
        ),
        (
            [Ballot(True, 3), Ballot(True, 151), Ballot(True, 150), Ballot(False, 0)],
            Agreement(step=150, source=2, behind=(2,), ahead=(1,), receivers=(0, 3), stale=(0,)),
        ),
    ],
)
def test_agreement_is_the_smallest_step_held_in_memory(ballots: list[Ballot], expected: Agreement) -> None:
    got = decide(ballots)
    assert got == expected
    assert got.from_checkpoint is (expected.source is None)


@pytest.mark.parametrize(
    ("ballots", "holders"),
    [
        ([Ballot(False, 0), Ballot(False, 0)], ()),  # the checkpoint: nobody sends
        ([Ballot(True, 7), Ballot(True, 7)], (0, 1)),
        ([Ballot(True, 8), Ballot(True, 7)], (1,)),  # rank 0 rolls back: it receives
        ([Ballot(False, 0), Ballot(True, 5), Ballot(True, 5)], (1, 2)),
        ([Ballot(True, 4), Ballot(True, 5), Ballot(True, 4), Ballot(False, 0)], (0, 2)),
        ([Ballot(True, 3), Ballot(True, 151), Ballot(True, 150), Ballot(False, 0)], (2,)),
    ],
)
def test_the_holders_of_the_agreed_state_are_every_member_that_does_not_receive_it(
    ballots: list[Ballot], holders: tuple[int, ...]
) -> None:
    got = decide(ballots)
    assert got.holders(len(ballots)) == holders
    assert got.source is None or got.source in holders


@pytest.mark.parametrize(
    ("ballots", "trained_at"),
    [
        ([Ballot(True, 7, 2), Ballot(True, 7, 2), Ballot(False, 0, 0)], 2),  # a join: the holders' world
        ([Ballot(True, 8, 3), Ballot(True, 7, 3)], 3),  # a death in the step: the world that trained it
        ([Ballot(False, 0, 0), Ballot(True, 5, 4)], 4),  # the source's, whatever a member without state says
        ([Ballot(True, 5), Ballot(True, 5)], None),  # unknown
        ([Ballot(False, 0, 3), Ballot(False, 0, 3)], None),  # nobody holds state: the checkpoint's
    ],
)
def test_the_agreement_says_at_what_world_size_its_step_was_trained(
    ballots: list[Ballot], trained_at: int | None
) -> None:
    assert decide(ballots).trained_at == trained_at


@pytest.mark.parametrize(
    ("ballots", "training"),
    [
        ([Ballot(True, 7, 2, 11), Ballot(True, 7, 2, 11), Ballot(False, 0, 0, 22)], 11),  # a joiner of another model
        ([Ballot(False, 0, 0, 22), Ballot(True, 5, 1, 11)], 11),  # the source's, whatever a member without state says
        ([Ballot(False, 0, 0, 22), Ballot(False, 0, 0, 11)], 22),  # nobody holds state: rank 0's
        ([Ballot(True, 5), Ballot(False, 0)], 0),  # unknown (a Session)
    ],
)
def test_the_world_continues_the_training_of_its_source(ballots: list[Ballot], training: int) -> None:
    assert decide(ballots).training == training


def _notice(round_: int = 3, **over: object) -> RegroupNotice:
    fields: dict[str, object] = {
        "round": round_,
        "generation": 7,
        "world_size": 4,
        "group_rank": 1,
        "group_world_size": 2,
        "ranks": {0: 2, 1: 3},
        "master_addr": "127.0.0.1",
        "master_port": 29999,
        "start_reason": "scale_down",
        "previous_world_size": 6,
        "announced_at": time.time(),
    }
    fields.update(over)
    return RegroupNotice(**fields)  # type: ignore[arg-type]


def test_regroup_notice_ack_and_live_workers_round_trip(tmp_path: Path) -> None:
    agent, worker = RegroupChannel(tmp_path), RegroupChannel(tmp_path)
    assert worker.notice() is None and agent.live_pids() == {}
    worker.announce_live(0, 111)
    worker.announce_live(1, 222)
    assert agent.live_pids() == {0: 111, 1: 222}

    notice = _notice(generation=None, previous_world_size=None)
    agent.announce(notice)
    assert worker.notice() == notice
    assert worker.newer_than(2) == notice and worker.newer_than(3) is None
    assert agent.wait_acks([0, 1], 3, timeout_s=0.05) == [0, 1]
    worker.ack(0, 3, 111)
    assert agent.wait_acks([0, 1], 3, timeout_s=0.05) == [1]
    worker.ack(1, 4, 222)  # an ack of a later round answers an earlier one too
    assert agent.wait_acks([0, 1], 3, timeout_s=0.05) == []

    newer = _notice(round_=5)
    agent.announce(newer)
    assert worker.wait_newer(3, timeout_s=1.0) == newer
    agent.forget_workers()  # new workers start: the old ones' announcements and acks are void
    assert agent.live_pids() == {} and not agent.acked(0, 3)


@pytest.mark.parametrize(
    "flag",
    ["no_departure", "first_round"],  # the round kept every member; the round is the job's first
)
def test_a_notice_carries_its_flags_and_older_notices_read_as_not(flag: str, tmp_path: Path) -> None:
    agent, worker = RegroupChannel(tmp_path), RegroupChannel(tmp_path)
    agent.announce(_notice(round_=6, **{flag: True}))
    seen = worker.notice()
    assert seen is not None and getattr(seen, flag)
    raw = json.loads((tmp_path / "regroup.json").read_text())
    del raw[flag]  # written by an agent of before the field
    assert not getattr(RegroupNotice.from_json(raw), flag)


def test_warm_workers_that_wait_to_know_whether_their_node_founds_the_job_are_told_when_it_does_not(
    tmp_path: Path,
) -> None:
    agent, worker = RegroupChannel(tmp_path), RegroupChannel(tmp_path)
    worker.announce_warm(0, 111, deciding=True)
    worker.announce_warm(1, 222)
    assert agent.warm_pids() == {0: 111, 1: 222}
    assert agent.warm_pids(deciding=True) == {0: 111} and agent.warm_pids(deciding=False) == {1: 222}
    assert worker.job_forming() is None  # not said yet
    agent.tell_job_forming(True)
    assert worker.job_forming() is True
    agent.tell_job_forming(False)  # the job formed without this node
    assert worker.job_forming() is False
    worker.withdraw_warm(0)  # it evaluates alone, then waits for its round where it trains
    assert agent.warm_pids() == {1: 222}
    worker.announce_warm(0, 111)
    assert agent.warm_pids(deciding=False) == {0: 111, 1: 222}


def test_a_finishing_worker_and_its_broken_collectives_are_seen_by_the_agent(tmp_path: Path) -> None:
    agent, worker = RegroupChannel(tmp_path), RegroupChannel(tmp_path)
    worker.announce_finishing(0, 111)
    worker.report_broken(1, 4)
    assert agent.finishing_pids() == {0: 111}
    assert agent.broken_local_ranks(4) == {1} and agent.broken_local_ranks(3) == set()
    agent.forget_workers()
    assert agent.finishing_pids() == {} and agent.broken_local_ranks(4) == set()


def test_a_foreign_file_is_not_a_notice(tmp_path: Path) -> None:
    (tmp_path / "regroup.json").write_text('{"round": "x"}')
    assert RegroupChannel(tmp_path).notice() is None


def test_worker_env_after_a_regroup_gives_the_new_rank_world_and_generation() -> None:
    ctx = LaunchContext(
        run_id="job",
        restart_count=4,
        failure_count=0,
        start_reason=StartReason.SCALE_DOWN,
        previous_world_size=6,
        round=4,
        control_dir="/tmp/ctl",
        collective_timeout_s=20.0,
        generation=9,
        live=True,
        regroup_timeout_s=50.0,
    )
    stale = {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        **to_environ(
            LaunchContext(
                run_id="job",
                restart_count=0,
                failure_count=0,
                start_reason=StartReason.FIRST_START,
                previous_world_size=None,
                round=0,
                live=True,
            )
        ),
    }
    environ = {**stale, **regrouped_environ(ctx, rank=3, world_size=4, group_rank=1, master_addr="h", master_port=1)}
    env = WorkerEnv.from_environ(environ)
    assert (env.rank, env.world_size, env.local_rank, env.group_rank) == (3, 4, 1, 1)
    assert (env.round, env.generation, env.start_reason, env.previous_world_size) == (4, 9, StartReason.SCALE_DOWN, 6)
    assert env.live and env.regroup_timeout_s == 50.0 and env.under_elastrain
    assert environ["MASTER_ADDR"] == "h" and environ["MASTER_PORT"] == "1"


def test_live_option_defaults_on_and_reads_pet_live(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert options_from_args(parser.parse_args(["train.py"])).live is True
    assert options_from_args(parser.parse_args(["--live", "false", "train.py"])).live is False
    monkeypatch.setenv("PET_LIVE", "0")
    assert options_from_args(build_parser().parse_args(["train.py"])).live is False
