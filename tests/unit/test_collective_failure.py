"""Which worker exceptions are a collective broken under the worker (a peer's failure echoed), and the note."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from elastrain.collective_failure import is_collective_failure, names_peer_failure, note_if_collective_failure
from elastrain.control import RegroupChannel
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError

# What gloo raised in a DDP backward here when the peer rank was SIGKILLed (torch 2.13, CPU).
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40870: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RuntimeError(GLOO_RESET), True),
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (dist.DistNetworkError("failed to connect"), True),
        (_chained(ValueError("wrapped"), RuntimeError(GLOO_RESET)), True),
        (RuntimeError("CUDA out of memory"), False),
        (ValueError("bad batch"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_a_collective_failure_is_told_from_a_failure_of_the_worker_itself(exc: BaseException, expected: bool) -> None:
    assert is_collective_failure(exc) is expected


def _env(tmp_path: Path, round_: int) -> WorkerEnv:
    return WorkerEnv.from_environ(
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "job",
            "ELASTRAIN_RUN_ID": "job",
            "ELASTRAIN_ROUND": str(round_),
            "ELASTRAIN_CONTROL_DIR": str(tmp_path),
            "ELASTRAIN_AGENT_PID": "1",
        }
    )


def test_the_note_reaches_the_agent_for_the_round_only_for_a_collective_failure(tmp_path: Path) -> None:
    env = _env(tmp_path, 3)
    channel = RegroupChannel(tmp_path)
    assert not note_if_collective_failure(env, ValueError("bad batch"))
    assert channel.broken_local_ranks(3) == set()
    assert note_if_collective_failure(env, RuntimeError(GLOO_RESET))
    assert channel.broken_local_ranks(3) == {env.local_rank} and channel.broken_local_ranks(2) == set()
    channel.forget_workers()
    assert channel.broken_local_ranks(3) == set()


def _from_context(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised ``from None`` while handling ``inner`` (as the checkpoint writer does): the context stays."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer from None
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # Every rank agreed on the storage's error: raised at once, no regroup awaited.
        (CheckpointSaveError("checkpoint of step 5 in /c/step-5 failed: cannot create the step directory"), False),
        (CheckpointSaveError("checkpoint of step 5 in /c/step-5 failed: rank 1: OSError: No space left"), False),
        # A peer's failure, in the outcome it broadcast (as text) or in the save's own chain.
        (CheckpointSaveError(f"checkpoint of step 5 in /c/step-5 failed: rank 1: RuntimeError: {GLOO_RESET}"), True),
        (_from_context(CheckpointSaveError("step 5: rank 0: DistBackendError"), dist.DistBackendError("x")), True),
        (_chained(CheckpointSaveError("/c: RuntimeError"), RuntimeError(GLOO_RESET)), True),
    ],
)
def test_a_failed_save_names_a_peer_failure_only_when_a_collective_of_it_broke(exc: Exception, expected: bool) -> None:
    assert isinstance(exc, CheckpointSaveError)
    assert names_peer_failure(exc) is expected
