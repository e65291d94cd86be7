"""A bench worker kills its whole "node" from inside a step: its agent, the agent's zygote and itself, at once.

The benches' SIGKILL at a chosen point of a step (``bench/workers/*``): from a gradient hook, so the kill lands in a
backward pass, where a lost machine's peers are most of the time. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _agent() -> int | None:
    """This worker's agent, as elastrain-run names it in the worker's environment; ``None`` under another launcher."""
    pid = os.environ.get("ELASTRAIN_AGENT_PID", "")
    return int(pid) if pid.isdigit() else None


def kill_own_node() -> None:
    """SIGKILL this worker's agent and zygote (its parent, when that is not the agent), then itself. First a line
    ``XW_KILL t=<time>``: the bench reads how much of the step in flight the kill destroyed.

    The agent first: the zygote's death kills this worker (its parent-death signal), perhaps before its next call,
    and the agent would live on (it did, on a loaded box). Under another launcher, only this worker dies."""
    print(f"XW_KILL t={time.time():.3f}", flush=True)
    agent, parent = _agent(), os.getppid()
    zygote = parent != agent and _parent_of(parent) == agent
    node = [] if agent is None else [agent, parent] if zygote else [agent]
    for pid in [*node, os.getpid()]:
        with contextlib.suppress(ProcessLookupError):  # the zygote, already gone with the agent
            os.kill(pid, signal.SIGKILL)


def kill_this_worker() -> None:
    """SIGKILL this worker alone (a crash: its agent and the node's other workers live on), after the same
    ``XW_KILL t=<time>`` line as :func:`kill_own_node`."""
    print(f"XW_KILL t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def term_own_agent() -> None:
    """SIGTERM this worker's agent: the node is asked to leave, as a spot VM's notice or a pod's deletion asks it."""
    agent = _agent()
    if agent is None:
        raise RuntimeError("no elastrain agent: ELASTRAIN_AGENT_PID is not in this worker's environment")
    os.kill(agent, signal.SIGTERM)
