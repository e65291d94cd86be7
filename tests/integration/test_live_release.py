"""How a live worker lets go of a left round's group, per backend (elastrain.live.group)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.processes import REPO, worker_env

from elastrain.live.group import NCCL_CLEANUP_ONLY, NCCL_ERROR_HANDLING, release_by_abort


@pytest.mark.parametrize(("backend", "abort"), [("nccl", True), ("NCCL", True), ("gloo", False), ("mpi", False)])
def test_nccl_groups_are_aborted_never_destroyed(backend: str, abort: bool) -> None:
    assert release_by_abort(backend) is abort


@pytest.mark.parametrize(("given", "expected"), [(None, NCCL_CLEANUP_ONLY), ("0", "0")])
def test_an_nccl_group_keeps_the_process_alive_unless_the_user_chose_otherwise(
    given: str | None, expected: str
) -> None:
    """TrainingGroup("nccl") sets TORCH_NCCL_ASYNC_ERROR_HANDLING to clean-up-only before any group exists (no
    GPU needed: nothing is joined); a value the user set stands."""
    env = worker_env()
    env.pop(NCCL_ERROR_HANDLING, None)
    if given is not None:
        env[NCCL_ERROR_HANDLING] = given
    code = (
        "import os; from elastrain.live.group import TrainingGroup; TrainingGroup('nccl', 30.0); "
        f"print(os.environ[{NCCL_ERROR_HANDLING!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
