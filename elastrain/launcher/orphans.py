"""No orphans: a worker dies with its agent, even when the agent is SIGKILLed.

torch starts workers in their own session with no parent-death signal, so a killed agent leaves its
workers training alone (measured: they run on for minutes). elastrain starts every worker command
through a tiny exec wrapper that asks Linux for ``PR_SET_PDEATHSIG = SIGKILL`` and then ``exec``s the
real command: same PID, same arguments, ~20 ms, and the kernel kills the worker the moment the agent
thread that started it dies. If the agent is already gone when the wrapper runs, it exits at once.
"""

from __future__ import annotations

import os
import sys

# Runs as ``python -S -c WRAPPER <agent-pid> <command> <args...>``; stdlib only, no site imports.
WRAPPER = (
    "import ctypes,os,signal,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "libc.prctl(1,int(signal.SIGKILL),0,0,0)\n"  # 1 == PR_SET_PDEATHSIG
    "os.getppid()!=int(sys.argv[1]) and os._exit(137)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def supported() -> bool:
    return sys.platform.startswith("linux")


def wrap(entrypoint: str, args: list[object]) -> tuple[str, list[object]]:
    """The (entrypoint, args) that run ``entrypoint args`` under the parent-death wrapper."""
    if not supported():
        return entrypoint, args
    return sys.executable, ["-S", "-c", WRAPPER, str(os.getpid()), entrypoint, *args]
