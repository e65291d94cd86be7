"""A bench worker kills its whole "node" from inside a step: its agent, the agent's zygote and itself, at once.

The benches' SIGKILL at a chosen point of a step (``bench/workers/*``): from a gradient hook, so the kill lands in a
backward pass, where a lost machine's peers are most of the time. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import signal
import time


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _is_elastrain(pid: int) -> bool:
    """Whether ``pid`` is an elastrain process (the agent, ``python -m elastrain``, or its zygote)."""
    return b"elastrain" in _cmdline(pid)


def kill_own_node() -> None:
    """SIGKILL this worker's agent and zygote (those of its two nearest ancestors that are elastrain's), then itself.
    First a line ``XW_KILL t=<time>``: the bench reads how much of the step in flight the kill destroyed."""
    print(f"XW_KILL t={time.time():.3f}", flush=True)
    parents = [os.getppid(), _parent_of(os.getppid())]
    for pid in [p for p in parents if _is_elastrain(p)] + [os.getpid()]:
        os.kill(pid, signal.SIGKILL)


def term_own_agent() -> None:
    """SIGTERM this worker's agent (its nearest elastrain ancestor that is not the zygote): the node is asked to
    leave, as a spot VM's notice or a pod's deletion asks it."""
    for pid in (os.getppid(), _parent_of(os.getppid())):
        if _is_elastrain(pid) and b"zygote" not in _cmdline(pid):
            os.kill(pid, signal.SIGTERM)
            return
    raise RuntimeError("no elastrain agent among this worker's two nearest ancestors")
