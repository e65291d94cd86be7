"""The worker contract: LaunchContext -> ELASTRAIN_* variables -> WorkerEnv."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from elastrain import env as env_mod
from elastrain.env import DEFAULT_IO_TIMEOUT_S, LaunchContext, StartReason, WorkerEnv, start_reason, to_environ
from elastrain.errors import WorkerEnvError

TORCH_VARS = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}


@pytest.mark.parametrize(
    ("previous", "new", "failed", "expected"),
    [
        (None, 4, False, StartReason.FIRST_START),
        (None, 4, True, StartReason.FIRST_START),
        (4, 2, True, StartReason.SCALE_DOWN),
        (4, 2, False, StartReason.SCALE_DOWN),
        (2, 4, False, StartReason.SCALE_UP),
        (2, 4, True, StartReason.SCALE_UP),
        (4, 4, True, StartReason.FAILURE),
        (4, 4, False, StartReason.MEMBERSHIP),
    ],
)
def test_start_reason(previous: int | None, new: int, failed: bool, expected: StartReason) -> None:
    assert start_reason(previous, new, failed) is expected


def test_round_trip_through_environment() -> None:
    ctx = LaunchContext(
        run_id="job-1",
        restart_count=2,
        failure_count=1,
        start_reason=StartReason.SCALE_DOWN,
        previous_world_size=6,
        round=2,
        checkpoint_dir="/ckpt",
        control_dir="/ctl",
        collective_timeout_s=12.5,
        first_step_timeout_s=1800.0,
        io_timeout_s=900.0,
    )
    got = WorkerEnv.from_environ({**TORCH_VARS, **to_environ(ctx)})
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size, got.group_rank) == (3, 1, 4, 2, 1)
    assert got.start_reason is StartReason.SCALE_DOWN
    assert got.previous_world_size == 6 and got.world_size_changed and got.is_restart
    assert (got.restart_count, got.failure_count, got.round, got.run_id) == (2, 1, 2, "job-1")
    assert (got.checkpoint_dir, got.control_dir, got.collective_timeout_s) == ("/ckpt", "/ctl", 12.5)
    assert got.io_timeout_s == 900.0 and got.first_step_timeout_s == 1800.0
    assert got.under_elastrain
    assert not got.first_round


def test_the_jobs_first_round_is_told_only_when_it_is_one() -> None:
    ctx = LaunchContext("job", 0, 0, StartReason.FIRST_START, None, 0, live=True, first_round=True)
    assert WorkerEnv.from_environ({**TORCH_VARS, **to_environ(ctx)}).first_round
    assert not WorkerEnv.from_environ({**TORCH_VARS, **to_environ(replace(ctx, first_round=False))}).first_round


def test_without_a_launcher_is_a_single_process_world() -> None:
    got = WorkerEnv.from_environ({})
    assert (got.rank, got.world_size, got.start_reason, got.under_elastrain) == (0, 1, StartReason.FIRST_START, False)
    assert got.io_timeout_s == DEFAULT_IO_TIMEOUT_S  # storage waits get their own, longer bound


def test_under_plain_torchrun_uses_torch_restart_count() -> None:
    got = WorkerEnv.from_environ({**TORCH_VARS, "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_RUN_ID": "r"})
    assert (got.restart_count, got.run_id, got.under_elastrain) == (3, "r", False)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
        ({"ELASTRAIN_START_REASON": "bored"}, "ELASTRAIN_START_REASON"),
        ({"ELASTRAIN_IO_TIMEOUT": "soon"}, "ELASTRAIN_IO_TIMEOUT"),
        ({"ELASTRAIN_IO_TIMEOUT": "0"}, "ELASTRAIN_IO_TIMEOUT"),
    ],
)
def test_malformed_environment(environ: dict[str, str], match: str) -> None:
    with pytest.raises(WorkerEnvError, match=match):
        WorkerEnv.from_environ(environ)


def test_only_env_module_names_elastrain_variables() -> None:
    root = Path(env_mod.__file__).resolve().parent
    offenders = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "env.py" and '"ELASTRAIN_' in p.read_text()
    ]
    assert offenders == []
