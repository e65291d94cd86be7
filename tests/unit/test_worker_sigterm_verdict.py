"""Who may end a worker with SIGTERM at once, and who only through its agent's leave (worker_sigterm.verdict)."""

from __future__ import annotations

import pytest

from elastrain.control.worker_sigterm import Verdict, verdict

AGENT, PARENT, WORKER, NODE = 100, 200, 300, 999
OWN = (AGENT, PARENT, WORKER)


@pytest.mark.parametrize(
    ("sender", "deferred", "agent_alive", "expected"),
    [
        (AGENT, False, True, Verdict.END),  # the agent stops its workers
        (PARENT, False, True, Verdict.END),  # torch's terminate() of a DataLoader worker
        (WORKER, False, True, Verdict.END),  # the worker ends a process it started, or itself
        (NODE, False, True, Verdict.DEFER),  # a node's shutdown: wait for the agent's leave
        (0, False, True, Verdict.DEFER),  # sent from outside the PID namespace (a container's runtime)
        (NODE, True, True, Verdict.END),  # a second one
        (NODE, False, False, Verdict.END),  # no agent to leave: the signal is the process's own
    ],
)
def test_verdict(sender: int, deferred: bool, agent_alive: bool, expected: Verdict) -> None:
    assert verdict(sender, OWN, deferred, agent_alive) is expected
