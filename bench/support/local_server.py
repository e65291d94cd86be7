"""What every local server the tests and benches start has in common: its process and log, how it stops, and its
use as a context manager (etcd, the S3-compatible moto server, Azurite)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self


class LocalServer:
    """A server process started on loopback (``start`` is the subclass's), with its log at ``log_path``."""

    STOP_TIMEOUT_S = 10.0
    """How long :meth:`stop` waits after its signal, and again after SIGKILL."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> None:
        """``sig`` (SIGTERM), then SIGKILL if the server has not exited within ``timeout`` (``STOP_TIMEOUT_S``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        wait = self.STOP_TIMEOUT_S if timeout is None else timeout
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=wait)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
