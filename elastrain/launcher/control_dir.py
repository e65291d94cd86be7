"""An agent's control directory: one per agent, in the temp folder, shared with its local workers.

The agent removes its own when it ends. One that an agent killed outright left behind (SIGKILL, the OOM killer: no
code runs) is removed by the next agent that starts on the machine: each directory names its owner (``agent.json``:
its PID, the process's start in clock ticks since boot and as a time, and its PID namespace), and a directory whose
owner is gone is swept. The start is compared in ticks, which no clock change moves: the start as a time (psutil's
``create_time``: the boot time, which each process reads from the wall clock, plus the ticks) differs between two
processes' reads once the clock was stepped, and an exact comparison of it judged a live agent gone (a full test
suite saw agents' control directories swept under them; their workers' save acks failed on the missing folder).
A directory with no owner recorded, another user's, or one made in another PID namespace (a container sharing the
folder) is never judged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import psutil

from elastrain import pids
from elastrain.control.files import write_atomic
from elastrain.log import lifecycle

PREFIX = "elastrain-control-"
OWNER = "agent.json"


def make() -> Path:
    """A new control directory for this agent (stale ones of dead agents swept first)."""
    sweep(Path(tempfile.gettempdir()))
    directory = Path(tempfile.mkdtemp(prefix=PREFIX))
    write_atomic(directory / OWNER, _identity(os.getpid()))
    return directory


def remove(directory: Path, owner_pid: int) -> None:
    """Remove this agent's own control directory; never from a forked copy of the agent's process, whose exit would
    take it from the agent still running."""
    if os.getpid() != owner_pid:
        return
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        return  # removed already: nothing left behind
    except OSError as exc:
        lifecycle("control_dir_left", level=logging.WARNING, control_dir=str(directory), error=repr(exc)[:300])
        return
    lifecycle("control_dir_removed", level=logging.DEBUG, control_dir=str(directory))


def sweep(folder: Path) -> list[Path]:
    """Remove the control directories in ``folder`` whose owning agent is gone; returns them."""
    swept: list[Path] = []
    try:
        candidates = list(folder.glob(f"{PREFIX}*"))
    except OSError as exc:
        lifecycle("control_dirs_unswept", level=logging.INFO, folder=str(folder), error=repr(exc)[:200])
        return swept
    for directory in candidates:
        owner = _owner(directory)
        if owner is None or not gone(owner):
            continue
        try:
            shutil.rmtree(directory)
        except OSError as exc:
            lifecycle("control_dir_left", level=logging.INFO, control_dir=str(directory), error=repr(exc)[:200])
            continue
        swept.append(directory)
    if swept:
        lifecycle("control_dirs_swept", count=len(swept), folder=str(folder), why="their agents are gone")
    return swept


def gone(owner: dict[str, Any]) -> bool:
    """Whether the agent ``owner`` names is proved gone: no process with its PID, or another one (started at
    another time), in this PID namespace. Never for an owner recorded in another namespace."""
    try:
        pid, started, namespace = int(owner["pid"]), float(owner["started"]), int(owner["pid_namespace"])
    except (KeyError, TypeError, ValueError):
        return False
    if namespace != _pid_namespace() or namespace == 0:
        return False
    ticks = owner.get("start_ticks")
    # By clock ticks where both sides have them; without (another system, an older owner, or no such process), a
    # creation time more than a clock step away.
    try:
        return not pids.started_as(pid, ticks if isinstance(ticks, int) else None, started)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # not ours to look at (access denied): not proved gone


def _owner(directory: Path) -> dict[str, Any] | None:
    """The owner a control directory records, when it is this user's real directory (None: not to be judged)."""
    try:
        if directory.is_symlink() or not directory.is_dir() or directory.stat().st_uid != os.getuid():
            return None
        raw = json.loads((directory / OWNER).read_text())
    except (OSError, ValueError):
        return None  # no owner recorded (yet, or by an older elastrain)
    return raw if isinstance(raw, dict) else None


def _identity(pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "started": psutil.Process(pid).create_time(),
        "start_ticks": pids.start_ticks(pid),
        "pid_namespace": _pid_namespace(),
    }


def _pid_namespace() -> int:
    """This process's PID namespace (0: unknown, off Linux)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
