"""Which worker failures are this node's own beyond doubt (no grace waited for a peer's departure), and which
name a setting error."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastrain.errors import EX_CONFIG
from elastrain.launcher.verdict import fatal_exit, killed_outright


def _failed(*exit_codes: int) -> RunResult:
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        for rank, code in enumerate(exit_codes)
    }
    return RunResult(state=WorkerState.FAILED, failures=failures)


@pytest.mark.parametrize(
    ("exit_codes", "own"),
    [
        ((-signal.SIGKILL,), True),  # the OOM killer, an operator, a chaos tool
        ((-signal.SIGKILL, -signal.SIGTERM), True),  # the other stopped by torch after the first failure
        ((-signal.SIGKILL, -signal.SIGKILL), True),
        ((1,), False),  # an exception: it may be a peer's failure under another name
        ((-signal.SIGABRT,), False),  # a C++ abort, which a broken collective can cause (NCCL's watchdog)
        ((-signal.SIGSEGV,), False),
        ((-signal.SIGKILL, 1), False),
        ((-signal.SIGTERM,), False),  # only stopped: nothing failed on its own
    ],
)
def test_a_worker_killed_outright_is_this_nodes_own_failure(exit_codes: tuple[int, ...], own: bool) -> None:
    assert killed_outright(_failed(*exit_codes)) is own


def test_an_exit_naming_a_bad_setting_is_fatal_and_a_kill_is_not() -> None:
    assert fatal_exit(_failed(EX_CONFIG))
    assert not fatal_exit(_failed(-signal.SIGKILL))
