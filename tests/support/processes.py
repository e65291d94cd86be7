"""Shared helpers for tests that start real processes: bounded, PID-scoped, loopback only."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from elastrain import binding

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def free_port() -> int:
    """A loopback port free now, drawn where the kernel gives no connection its source port (as elastrain's)."""
    return binding.free_port("127.0.0.1")


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for launched processes: one thread each, no inherited PET_*/ELASTRAIN_*. The
    repository under test comes first on ``PYTHONPATH`` after ``extra``'s own (a checkout other than the installed
    one runs its own elastrain)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTRAIN_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    inherited = env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [(extra or {}).get("PYTHONPATH"), str(REPO), inherited]))
    return env


def elastrain_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "elastrain", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", *args]


def run(
    cmd: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run to completion with a hard timeout; the whole process tree is killed on timeout."""
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def spawn(
    cmd: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start a long-running process (an agent, a "node") in its own session, output to ``log``."""
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=worker_env(env), cwd=cwd, start_new_session=True
    )


def events_in(text: str, name: str) -> list[dict[str, str]]:
    """The lifecycle lines named ``name`` in a log's text (agents' and workers')."""
    from elastrain.log import parse_event_line

    found = [parse_event_line(line) for line in text.splitlines()]
    return [e for e in found if e is not None and e.get("event") == name]


_CXX_TRACE = re.compile(r"^(frame #\d+: |Exception raised from |<omitting python frames>)")


def readable(text: str, tail: int) -> str:
    """The last ``tail`` characters of a node's output without torch's C++ stack traces (a c10d warning prints ~20
    frames, and a few of them filled a failure's whole dump, hiding the events before them)."""
    kept = "\n".join(line for line in text.splitlines() if not _CXX_TRACE.match(line))
    return kept[-tail:]


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal ``pid`` and every descendant we can see now (workers run in their own sessions)."""
    victims = [pid, *descendants(pid)]
    for p in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
    return victims


def alive(pids: Sequence[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            proc = psutil.Process(p)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_logged(procs: Sequence[tuple[subprocess.Popen[bytes], Path]], timeout: float) -> list[int]:
    """Wait for every process to exit (one deadline for all); on timeout, fail with every process's log."""
    deadline = time.monotonic() + timeout
    codes: list[int] = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logs = "\n".join(f"--- {log} ---\n{log.read_text(errors='replace')[-20000:]}" for _, log in procs)
            raise AssertionError(f"timed out after {timeout}s: {' '.join(map(str, proc.args))}\n{logs}") from None
    return codes


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    """Kill (by PID, with their trees) the processes a test started, whatever happens."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def run_ranks(worker: str, mode: str, world: int, *extra: str, timeout: float = 60.0) -> list[str]:
    """``python worker mode RANK WORLD *extra`` for every rank at once (a gloo group of plain processes); their
    outputs by rank, once every one exited 0."""
    procs = [
        subprocess.Popen(
            [PYTHON, worker, mode, str(rank), str(world), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(),
            start_new_session=True,
        )
        for rank in range(world)
    ]
    outs: list[str] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    return outs


def spawned_ranks(target: Callable[..., None], world: int, *extra: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``target(rank, port, queue, *extra)`` in ``world`` spawned processes (``port``: a free one for the group's
    store; each puts one result with a ``"rank"`` key on ``queue``); the results, by rank. Every process is reaped."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, out, *extra)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((out.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def printed_fields(line: str) -> dict[str, str]:
    """The ``key=value`` words of a line a test worker printed, after its tag (``LW_STEP step=3 ws=2``)."""
    return dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)


class LiveNode:
    """One test "node": an ``elastrain-run --live true`` agent with one worker (or ``nproc_per_node``) running
    ``script`` on 127.0.0.1 (c10d, the first node's agent hosts the store); its log, the lines its workers printed,
    its events."""

    def __init__(
        self,
        name: str,
        tmp: Path,
        port: int,
        script: str,
        env: Mapping[str, str],
        *,
        rdzv_id: str,
        nnodes: str,
        last_call_s: float,
        collective_timeout: float,
        extra: Sequence[str] = (),
        nproc_per_node: int = 1,
        max_restarts: int = 0,
    ) -> None:
        self.name = name
        self.log = tmp / f"{name}.log"
        cmd = elastrain_cmd(
            "--nnodes", nnodes,
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"last_call_timeout={last_call_s:g}",
            "--max-restarts", str(max_restarts),
            "--live", "true",
            "--collective-timeout", f"{collective_timeout:g}",
            *extra,
            script,
        )  # fmt: skip
        self.proc = spawn(cmd, self.log, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def lines(self, prefix: str) -> list[dict[str, str]]:
        """The fields of every line the worker printed with tag ``prefix``."""
        return [printed_fields(line) for line in self.text().splitlines() if line.startswith(prefix + " ")]

    def events(self, name: str) -> list[dict[str, str]]:
        """The agent's and worker's lifecycle lines named ``name``."""
        return events_in(self.text(), name)

    def dump(self) -> str:
        return f"--- {self.name} ---\n" + readable(self.text(), 6000)
