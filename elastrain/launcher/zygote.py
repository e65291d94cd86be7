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

Fork safety: a forked child has only the thread that forked, and cannot use CUDA once its parent
called the CUDA driver. torch's import starts no thread and leaves CUDA alone; most libraries do the
same at import and start their threads or CUDA on first use, in the worker. A module that does
either *at import* would hand the workers locks that no thread will release, or a CUDA they cannot
use. The zygote preloads with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so that the common case, a
library calling ``torch.cuda.is_available()`` at import, asks NVML instead of the driver; and it
checks after each preloaded module (OS threads of the process, libcuda loaded,
``torch.cuda.is_initialized()``): if one of them changed, it logs ``zygote_preload_unsafe`` naming the
module and restarts itself with only the modules preloaded before it (once; if that is not safe
either, it exits and workers start the normal way). Not detected: a thread that a module starts
and ends during its import, and native state other than threads and CUDA (an open connection, a
seeded random generator); such a module belongs under ``--zygote false``, or behind an import inside
a function. The CUDA checks have run on CPU machines only: no GPU was at hand to test them.

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
import importlib.machinery
import io
import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing import start_processes as torch_start_processes

from elastrain.errors import ElastrainError
from elastrain.launcher import orphans, preload
from elastrain.log import lifecycle

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.distributed.distributed_c10d")
READY_TIMEOUT_S = 120.0
"""How long a worker start waits for the zygote's preload before it starts the worker the normal way."""
_PR_SET_PDEATHSIG = 1
_SAFE_PATH = bool(getattr(sys.flags, "safe_path", False))  # python -P / PYTHONSAFEPATH (3.11+): no sys.path[0]


class ZygoteError(ElastrainError):
    """The zygote could not start or fork a worker; workers then start the normal way."""


# -- agent side -------------------------------------------------------------------------------------


class Zygote:
    """The agent's handle on its zygote process."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, extra: Sequence[str] = ()) -> None:
        """Start a zygote that imports ``preload`` (which must import) and then ``extra`` (best effort)."""
        parent, child = socket.socketpair()
        self._sock = parent
        self._file = parent.makefile("rwb", buffering=0)
        command = _serve_command(child.fileno(), preload, extra, may_restart=True, t0=time.time())
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
    """torch's SubprocessContext whose processes are forked by the zygote."""

    zygote: Zygote
    argvs: dict[int, list[str]]

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
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    original = getattr(lea, "start_processes")  # noqa: B009 - not re-exported; patched for this block only
    setattr(lea, "start_processes", lambda **kw: start_processes(zygote, **kw))  # noqa: B010
    try:
        yield
    finally:
        setattr(lea, "start_processes", original)  # noqa: B010


# -- zygote side ------------------------------------------------------------------------------------


def _prctl_pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _serve_command(fd: int, preload: Sequence[str], extra: Sequence[str], may_restart: bool, t0: float) -> list[object]:
    """``python`` arguments that run :func:`main` on ``fd``.

    ``-u``: workers run as ``python -u`` (torch's command for a script); a forked worker keeps the zygote's
    ``sys.stdout`` and ``sys.stderr``, which then write through to their files as the worker's own would.
    """
    call = f"main({fd}, {list(preload)!r}, {list(extra)!r}, may_restart={may_restart!r}, t0={t0!r})"
    return ["-u", "-c", f"from elastrain.launcher.zygote import main; {call}"]


@dataclass(frozen=True)
class _ProcessState:
    """What a preloaded module must not change before a fork: OS threads (native ones too, which
    ``threading`` does not see), and whether the CUDA driver is loaded or torch's CUDA initialised."""

    threads: int
    cuda_driver: bool
    cuda_initialised: bool

    @classmethod
    def now(cls) -> _ProcessState:
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = threading.active_count()
        try:
            # libcuda is loaded by the first CUDA runtime call (torch.cuda.is_available() makes one): a
            # forked child of a process that made one cannot use CUDA. torch's import does not load it.
            with open("/proc/self/maps", "rb") as maps:
                cuda_driver = b"/libcuda.so" in maps.read()
        except OSError:
            cuda_driver = False
        torch_mod = sys.modules.get("torch")
        return cls(threads, cuda_driver, bool(torch_mod is not None and torch_mod.cuda.is_initialized()))

    def hazard_since(self, before: _ProcessState) -> str | None:
        """Why forking now would hand workers a broken state that ``before`` did not have, or ``None``."""
        if self.cuda_initialised and not before.cuda_initialised:
            return "it initialised CUDA, which a forked worker cannot use"
        if self.cuda_driver and not before.cuda_driver:
            return "it called the CUDA driver, which a forked worker then cannot use"
        if self.threads > before.threads:
            return f"it started {self.threads - before.threads} thread(s), which a forked worker would not have"
        return None


def _preload(fd: int, preload: Sequence[str], extra: Sequence[str], may_restart: bool, t0: float) -> list[str]:
    """Import ``preload``, then each of ``extra`` that imports and is fork-safe; returns those of ``extra``.

    An entry ``module:name`` of ``extra`` reads ``name`` from ``module``, as ``from module import name`` does.
    """
    import importlib

    # torch.cuda.is_available() asks NVML instead of initialising the CUDA driver (which a forked child
    # could not use): libraries that call it at import stay preloadable. Workers get their own environment.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in preload:
        importlib.import_module(name)
    done: list[str] = []
    for name in extra:
        before = _ProcessState.now()
        module, _, attr = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attr:
                getattr(loaded, attr)
        except (Exception, SystemExit) as exc:  # any import error: the worker reports it when it imports
            text = f"{type(exc).__name__}: {exc}"
            lifecycle("zygote_preload_failed", level=logging.WARNING, module=name, error=text[:300])
            continue
        hazard = _ProcessState.now().hazard_since(before)
        if hazard is None:
            done.append(name)
            continue
        lifecycle(
            "zygote_preload_unsafe",
            level=logging.WARNING,
            module=name,
            why=hazard,
            action=f"restarting the zygote with the {len(done)} modules before it" if may_restart else "exiting",
        )
        if not may_restart:
            os._exit(1)  # workers start the normal way
        os.set_inheritable(fd, True)
        command = _serve_command(fd, preload, done, may_restart=False, t0=t0)
        os.execv(sys.executable, [sys.executable, *map(str, command)])
    return done


def main(
    fd: int, preload: list[str], extra: Sequence[str] = (), may_restart: bool = True, t0: float | None = None
) -> None:
    """The zygote process (``python -u -c``): serve the agent; in a forked worker, run the worker's script.

    A forked worker comes back here from :func:`serve`'s loop and runs its script at the interpreter's
    top level, then ends as ``python -u script.py`` ends (:func:`run_worker`).
    """
    run_worker(serve(fd, preload, extra, may_restart, t0))


def serve(
    fd: int, preload: list[str], extra: Sequence[str] = (), may_restart: bool = True, t0: float | None = None
) -> list[str]:
    """The zygote's main loop: preload, then fork one worker per request and report exits.

    It returns only in a forked worker, set up as its request says (session, environment, working
    directory, output files): the worker's ``sys.argv``, for :func:`run_worker`. The zygote itself ends
    when the agent closes its socket.

    ``t0``: when the agent started this zygote (``time.time()``), for the ``zygote_ready`` line.
    """
    import selectors

    from elastrain import log

    log.configure()
    t0 = time.time() if t0 is None else t0
    # sys.path[0] is the agent's working directory (python -c): a module there must not stand in for an
    # installed one of the same name. A worker gets its own sys.path[0] (see _become_worker).
    if sys.path[:1] == [""] and not _SAFE_PATH:
        del sys.path[0]
    preloaded = _preload(fd, preload, extra, may_restart, t0)
    # took_s: from the agent's start of the zygote, so the interpreter's start and torch's import count too.
    lifecycle("zygote_ready", took_s=round(time.time() - t0, 3), preloaded=",".join(preloaded) or "-")
    sock = socket.socket(fileno=fd)
    out = sock.makefile("wb", buffering=0)
    out.write(b'{"ready": true}\n')
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    buf = b""
    while True:
        for _ in sel.select(timeout=0.02):
            chunk = sock.recv(1 << 16)
            if not chunk:
                os._exit(0)
            buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()  # nothing of the zygote's may be written again by a worker
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                # The worker keeps none of the zygote's own state: its socket, selector and children.
                sel.close()
                out.close()
                sock.close()
                return _become_worker(req)
            children.add(pid)
            out.write(json.dumps({"spawned": req["id"], "pid": pid}).encode() + b"\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                out.write(json.dumps({"exited": pid, "code": code}).encode() + b"\n")


def _become_worker(req: dict[str, Any]) -> list[str]:
    """In the forked child: become the worker of ``req`` (as a fresh process started by torch would be);
    returns its ``sys.argv``. An error here ends the child as an uncaught exception ends python (exit 1)."""
    os.setsid()
    _prctl_pdeathsig()
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    for stream, target in ((1, req.get("stdout")), (2, req.get("stderr"))):
        if target:
            f = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, stream)
            os.close(f)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from elastrain.rendezvous.binding import host_worker_store

    host_worker_store(os.environ)  # rank 0: the round's store, on MASTER_ADDR's interface only
    argv: list[str] = req["argv"]
    # As python does (the script's directory, its symbolic link resolved); serve() removed the zygote's own.
    first = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.realpath(argv[0]))
    if not _SAFE_PATH:
        sys.path.insert(0, first)
    return argv


def run_worker(argv: list[str]) -> None:
    """Run a forked worker's script as ``python -u [-m] ...`` runs it, in ``__main__``, and return when it returns.

    The interpreter then ends the worker as it ends any script: ``sys.exit`` codes and messages, the
    non-daemon threads joined, ``atexit`` handlers, stdio flushed, open files closed as ``__main__`` is
    finalised. An uncaught exception prints the script's traceback (without the launcher's frames) and
    exits 1; ``KeyboardInterrupt`` ends the worker by SIGINT, as python does.
    """
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # runpy puts the module's file in argv[0]
            _fresh_main_namespace()
            # What `python -m` itself calls: the module runs in the real __main__, with runpy's frames.
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
        else:
            sys.argv = argv
            _run_path_as_main(argv[0])
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling, as for any script
    except BaseException as exc:
        _print_uncaught(exc)
        _note_collective_failure(exc)
        raise SystemExit(1) from None


def _fresh_main_namespace() -> dict[str, Any]:
    """``__main__``'s namespace as the interpreter starts a script in it: the zygote's names are gone."""
    namespace = sys.modules["__main__"].__dict__
    builtins_module = namespace["__builtins__"]
    namespace.clear()
    namespace.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __spec__=None,
        __annotations__={},
        __builtins__=builtins_module,
    )
    return namespace


def _run_path_as_main(path: str) -> None:
    """What ``python path`` does: compile the file and run it in ``__main__`` (a directory, a zip file or a
    compiled file goes through :func:`runpy.run_path`)."""
    if os.path.isdir(path) or path.endswith((".pyc", ".pyo")) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")
        return
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as exc:  # python's own words and exit code for a script it cannot open
        name = os.path.abspath(path)
        print(f"{sys.executable}: can't open file {name!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    filename = os.path.join(os.getcwd(), path)  # python 3.9+: __file__ and tracebacks name the absolute path
    namespace = _fresh_main_namespace()
    loader = importlib.machinery.SourceFileLoader("__main__", filename)
    namespace.update(__file__=filename, __cached__=None, __loader__=loader)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)


def _print_uncaught(exc: BaseException) -> None:
    """Report ``exc`` as the interpreter reports an uncaught exception, from the script's first frame on."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (_OWN_FILE, "<string>"):
        tb = tb.tb_next  # the zygote's own frames (python -c, main, run_worker)
    exc.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    sys.excepthook(type(exc), exc, tb)


def _note_collective_failure(exc: BaseException) -> None:
    """A plain script's broken collective: tell the agent that it is an echo of a peer's failure."""
    from elastrain.collective_failure import note_if_collective_failure
    from elastrain.env import WorkerEnv

    try:
        note_if_collective_failure(WorkerEnv.from_environ(), exc)
    except ElastrainError as err:  # a worker environment that elastrain-run did not make
        lifecycle("collective_failure_unchecked", level=logging.WARNING, error=repr(err)[:200])


_OWN_FILE = run_worker.__code__.co_filename
