"""Fast worker start: fork workers from a process that already imported torch and the script's imports.

A fresh worker pays ``import torch`` (1.3-2 s on an idle machine, 4-8 s on a loaded one) and then
its script's own imports (transformers: another 4-6 s) on every restart. The agent starts one
*zygote* per node when it starts (``--zygote``, on by default); the zygote imports the preload
modules once, then forks a worker for each request and reports its exit code. Workers keep every
guarantee of the normal path: own session, same environment and arguments, stdout/stderr redirection,
death with the agent (zygote and worker both carry ``PR_SET_PDEATHSIG``).

What is preloaded: :data:`DEFAULT_PRELOAD` (torch), then the modules the entrypoint script imports at
its top level (:mod:`elastrain.launcher.preload`: installed packages such as transformers or
datasets, not the script's own modules beside it). A module whose import raises is logged
(``zygote_preload_failed``) and skipped: the worker imports it itself and fails, if it does, with
its own traceback. If the zygote is not ready in time or has died, workers start the normal way.

The zygote process itself (its preload, the fork-safety checks, the forked worker) is
:mod:`elastrain.launcher.zygote_process`.

Only ``python [-u] script.py ...`` and ``python [-u] -m module ...`` commands are forked; anything
else (``--no-python``, other interpreters) starts the normal way. Caveat: environment variables that
a module reads *at import time* are those of the agent, not the worker's (torch reads RANK,
MASTER_ADDR and friends at run time, so they are unaffected; the script's own modules, which might
read RANK at import, are not preloaded).

The agent side is :class:`Zygote` plus :func:`start_processes`, which replaces torch's function of
that name for the duration of one worker start (see ``ElastrainAgent._start_workers``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing import start_processes as torch_start_processes

from elastrain.errors import ElastrainError
from elastrain.launcher import orphans, preload
from elastrain.launcher.zygote_process import serve_command
from elastrain.log import lifecycle

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.distributed.distributed_c10d")
READY_TIMEOUT_S = 120.0
"""How long a worker start waits for the zygote's preload before it starts the worker the normal way."""


class ZygoteError(ElastrainError):
    """The zygote could not start or fork a worker; workers then start the normal way."""


class Zygote:
    """The agent's handle on its zygote process."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, extra: Sequence[str] = ()) -> None:
        """Start a zygote that imports ``preload`` (which must import) and then ``extra`` (best effort)."""
        parent, child = socket.socketpair()
        self._sock = parent
        self._file = parent.makefile("rwb", buffering=0)
        command = serve_command(child.fileno(), preload, extra, may_restart=True, t0=time.time())
        entry, args = orphans.wrap(sys.executable, command)
        self.proc = subprocess.Popen([entry, *map(str, args)], pass_fds=[child.fileno()], start_new_session=True)
        child.close()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._spawned: dict[int, threading.Event] = {}
        self._pids: dict[int, int] = {}
        self.exit_codes: dict[int, int] = {}
        self._next = 0
        self.ready_s: float | None = None
        self._started = time.monotonic()
        self._closing = False
        threading.Thread(target=self._read, name="elastrain-zygote", daemon=True).start()

    def _read(self) -> None:
        try:
            for raw in self._file:
                msg = json.loads(raw)
                if "ready" in msg:
                    self.ready_s = time.monotonic() - self._started
                    self._ready.set()
                elif "spawned" in msg:
                    self._pids[int(msg["spawned"])] = int(msg["pid"])
                    self._spawned[int(msg["spawned"])].set()
                elif "exited" in msg:
                    self.exit_codes[int(msg["exited"])] = int(msg["code"])
        except (OSError, ValueError, KeyError, TypeError) as exc:  # closed (close()), or a message out of shape
            if not self._closing:
                # Its workers' exits could no longer be told: end it, and them with it (PDEATHSIG), as reported below.
                lifecycle("zygote_channel_broken", level=logging.ERROR, error=repr(exc)[:200], action="killing it")
                self.proc.kill()
        # The zygote is gone: its workers died with it (PDEATHSIG).
        self._ready.set()
        for pid in list(self._pids.values()):
            self.exit_codes.setdefault(pid, -int(signal.SIGKILL))
        for ev in self._spawned.values():
            ev.set()

    @classmethod
    def for_entrypoint(cls, entrypoint: Any, args: Sequence[Any]) -> Zygote | None:
        """A zygote that preloads torch and what the worker command's script imports at its top level;
        ``None`` for a command it could not fork (``--no-python``, another interpreter): such a job
        would pay for a zygote's torch import and never use it."""
        argv = python_command(entrypoint, tuple(args)) if isinstance(entrypoint, str) else None
        if argv is None:
            lifecycle("zygote_skipped", why="not a python script or module")
            return None
        return cls(DEFAULT_PRELOAD, [m for m in preload.entrypoint_imports(argv) if m not in DEFAULT_PRELOAD])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) for the preload; ``True`` if the zygote is ready and alive."""
        return self._ready.wait(timeout=timeout) and self.alive and self.ready_s is not None

    def spawn(self, argv: list[str], env: dict[str, str], stdout: str | None, stderr: str | None) -> int:
        """Fork one worker; returns its pid."""
        if not self.wait_ready(READY_TIMEOUT_S):
            raise ZygoteError("the zygote did not become ready (see its output above)")
        with self._lock:
            self._next += 1
            rid = self._next
            self._spawned[rid] = threading.Event()
            full_env = {**os.environ, **env}  # as torch's SubprocessHandler does
            req = {"id": rid, "argv": argv, "env": full_env, "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
            self._file.write(json.dumps(req).encode() + b"\n")
        if not self._spawned[rid].wait(timeout=30) or rid not in self._pids:
            raise ZygoteError("the zygote did not fork the worker")
        return self._pids[rid]

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.close()
        except OSError as exc:
            lifecycle("zygote_close_failed", level=logging.WARNING, error=repr(exc)[:200])
        if self.alive:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                lifecycle("zygote_not_reaped", level=logging.WARNING, pid=self.proc.pid, waited_s=5)


def python_command(entrypoint: str, args: tuple[Any, ...]) -> list[str] | None:
    """``sys.argv`` for the forked worker, or ``None`` if this command cannot be forked from the zygote."""
    argv = [str(a) for a in args]
    if entrypoint == sys.executable and argv[:3] == ["-S", "-c", orphans.WRAPPER] and len(argv) > 4:
        entrypoint, argv = argv[4], argv[5:]  # unwrap orphans.wrap (the zygote sets PDEATHSIG itself)
    if os.path.realpath(entrypoint) != os.path.realpath(sys.executable):
        return None
    while argv and argv[0] == "-u":
        argv = argv[1:]
    if argv[:1] == ["-m"] and len(argv) > 1:
        return ["-m", *argv[1:]]
    if argv and not argv[0].startswith("-"):
        return argv
    return None


class _ZygoteProc:
    """The slice of ``subprocess.Popen`` that torch's SubprocessContext uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return code


class _ZygoteHandler:
    def __init__(self, proc: _ZygoteProc, local_rank: int) -> None:
        self.proc, self.local_rank_id = proc, local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


class ZygoteContext(mp_api.SubprocessContext):
    """torch's SubprocessContext whose processes are forked by the zygote.

    torch's context stops every worker as soon as one fails. Given ``keep_survivors``, it asks first: when that
    says yes for the workers still running (``--live``: each said it can regroup), it reports the failure and leaves
    them running, so that the agent replaces only the failed ones (:meth:`respawn`) and moves the rest to the next
    round in place, their state kept; otherwise it stops them all, as torch's does.
    """

    zygote: Zygote
    argvs: dict[int, list[str]]
    keep_survivors: Callable[[frozenset[int]], bool] | None = None

    def _poll(self) -> mp_api.RunProcsResult | None:
        if self.keep_survivors is not None:
            done: set[int] = set()
            self._capture_process_failures(done)
            self._running_local_ranks.difference_update(done)
            survivors = frozenset(self._running_local_ranks)
            if self._failures and survivors and self.keep_survivors(survivors):
                return mp_api.RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts, stderrs=self.stderrs)
        return super()._poll()

    def failed_ranks(self) -> frozenset[int]:
        """The local ranks whose worker failed while others were kept running (none: empty)."""
        return frozenset(self._failures)

    def running_ranks(self) -> frozenset[int]:
        """The local ranks whose worker runs."""
        return frozenset(r for r, h in self.subprocess_handlers.items() if h.proc.poll() is None)

    def respawn(self, local_ranks: Collection[int], envs: Mapping[int, dict[str, str]]) -> dict[int, int]:
        """Fork a new worker for each of ``local_ranks`` (their old one failed) with its new ``envs``, beside the
        running ones; its output goes on in the same files, and its error file is its predecessor's, whose report
        is set aside first (a later failure must not read it). Returns local rank -> new pid."""
        pids: dict[int, int] = {}
        for r in sorted(local_ranks):
            env = dict(envs[r])
            error_file = self.envs[r].get("TORCHELASTIC_ERROR_FILE", "")
            env["TORCHELASTIC_ERROR_FILE"] = error_file
            if error_file and os.path.exists(error_file):
                with contextlib.suppress(OSError):
                    os.replace(error_file, f"{error_file}.{self.subprocess_handlers[r].proc.pid}")
            pids[r] = self.zygote.spawn(self.argvs[r], env, self.stdouts[r], self.stderrs[r])
            self.envs[r] = env
            self.subprocess_handlers[r] = _ZygoteHandler(_ZygoteProc(self.zygote, pids[r]), r)  # type: ignore[assignment]
            self._failures.pop(r, None)
            self._running_local_ranks.add(r)
        return pids

    def _start(self) -> None:
        self.subprocess_handlers = {
            r: _ZygoteHandler(  # type: ignore[misc]
                _ZygoteProc(
                    self.zygote, self.zygote.spawn(self.argvs[r], self.envs[r], self.stdouts[r], self.stderrs[r])
                ),
                r,
            )
            for r in range(self.nprocs)
        }


def start_processes(zygote: Zygote, **kwargs: Any) -> mp_api.PContext:
    """torch's ``start_processes``, forking from ``zygote`` where the command allows it."""
    entrypoint, args = kwargs["entrypoint"], kwargs["args"]
    argvs = {r: python_command(entrypoint, a) for r, a in args.items()} if isinstance(entrypoint, str) else {}
    why = (
        "not a python script or module"
        if not argvs or any(v is None for v in argvs.values())
        else "numa binding"
        if kwargs.get("numa_options")
        else "the zygote died"
        if not zygote.alive
        # Bounded: a worker started the normal way would spend this time importing the same modules.
        else f"not ready after {READY_TIMEOUT_S:.0f} s"
        if not zygote.wait_ready(READY_TIMEOUT_S)
        else None
    )
    if why is not None:
        lifecycle("zygote_skipped", why=why)
        return torch_start_processes(**kwargs)
    kwargs.pop("start_method", None)
    ctx = ZygoteContext(**kwargs)
    ctx.zygote = zygote
    ctx.argvs = {r: v for r, v in argvs.items() if v is not None}
    try:
        ctx.start()
    except Exception:
        ctx.close()
        raise
    return ctx


@contextlib.contextmanager
def forking_from(zygote: Zygote | None) -> Iterator[None]:
    """Within this block, torch's LocalElasticAgent starts workers through ``zygote``."""
    if zygote is None:
        yield
        return
    with _starting_with(lambda **kw: start_processes(zygote, **kw)):
        yield


@contextlib.contextmanager
def respawning(ctx: ZygoteContext, local_ranks: Collection[int], pids: dict[int, int]) -> Iterator[None]:
    """Within this block, torch's LocalElasticAgent's worker start forks only ``local_ranks`` anew into ``ctx``
    (:meth:`ZygoteContext.respawn`, with the environment torch builds for the round); ``pids`` receives their pids."""

    def respawn(**kw: Any) -> ZygoteContext:
        pids.update(ctx.respawn(local_ranks, kw["envs"]))
        return ctx

    with _starting_with(respawn):
        yield


@contextlib.contextmanager
def _starting_with(start: Callable[..., mp_api.PContext]) -> Iterator[None]:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    original = getattr(lea, "start_processes")  # noqa: B009 - not re-exported; patched for this block only
    setattr(lea, "start_processes", start)  # noqa: B010
    try:
        yield
    finally:
        setattr(lea, "start_processes", original)  # noqa: B010
