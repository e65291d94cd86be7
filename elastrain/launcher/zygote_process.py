"""The zygote process: preload torch and the script's imports once, then fork a worker per request.

The agent starts it (:class:`elastrain.launcher.zygote.Zygote`) as ``python -u -c`` running :func:`main`
on one end of a socket pair. It imports the preload modules, says it is ready, and then, for each
request the agent sends, forks a child and reports the child's pid and, later, its exit code. The
child becomes the worker the request describes (its own session, environment, working directory,
output files, ``PR_SET_PDEATHSIG``) and runs the worker's script at the interpreter's top level, as
``python -u [-m] ...`` would (:func:`run_worker`).

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
"""

from __future__ import annotations

import importlib.machinery
import io
import json
import logging
import os
import runpy
import signal
import socket
import sys
import threading
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.control import worker_sigterm
from elastrain.errors import ElastrainError
from elastrain.log import lifecycle

_PR_SET_PDEATHSIG = 1
_SAFE_PATH = bool(getattr(sys.flags, "safe_path", False))  # python -P / PYTHONSAFEPATH (3.11+): no sys.path[0]


def _prctl_pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def serve_command(fd: int, preload: Sequence[str], extra: Sequence[str], may_restart: bool, t0: float) -> list[object]:
    """``python`` arguments that run :func:`main` on ``fd``.

    ``-u``: workers run as ``python -u`` (torch's command for a script); a forked worker keeps the zygote's
    ``sys.stdout`` and ``sys.stderr``, which then write through to their files as the worker's own would.
    """
    call = f"main({fd}, {list(preload)!r}, {list(extra)!r}, may_restart={may_restart!r}, t0={t0!r})"
    return ["-u", "-c", f"from elastrain.launcher.zygote_process import main; {call}"]


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
    # pyarrow (under datasets, so under every Hugging Face example) starts its bundled jemalloc's background thread as
    # it loads, which a forked worker would not have: the zygote then preloaded neither datasets nor anything after it
    # (transformers), and restarted. Arrow's default pool is mimalloc; its jemalloc purges inline instead.
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
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
        command = serve_command(fd, preload, done, may_restart=False, t0=t0)
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
    # A SIGTERM to every process of the node (a VM's or Slurm's shutdown) is the agent's leave: the zygote lives on,
    # so that its workers (which die with it: PDEATHSIG) can save. The agent ends it with SIGKILL (Zygote.close).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    worker_sigterm.install(os.environ)  # as the bootstrap does in a worker started the normal way
    from elastrain.binding import host_worker_store

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
