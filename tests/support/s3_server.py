"""A real S3-compatible server for tests: moto in server mode on a free loopback port, stopped by PID.

Usage (no pytest plugin needed)::

    from support.s3_server import S3Server

    with S3Server(tmp_path / "s3") as server:
        server.env              # AWS_* variables that point s3fs (through botocore) at this server
        server.make_bucket("ckpt")

The server is ``moto_server`` from ``moto[server]`` (pyproject's dev extra), run by the current Python.
Buckets live in the server's memory: they vanish when it stops.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.support.local_server import LocalServer
from support.processes import free_port


class S3Server(LocalServer):
    """One moto S3 server on 127.0.0.1 with fixed test credentials."""

    def __init__(self, directory: Path, start_timeout: float = 30.0) -> None:
        self.directory = Path(directory)
        super().__init__(self.directory / "moto.log")
        self.start_timeout = start_timeout
        self.port = free_port()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables s3fs and botocore read: no elastrain-specific setting."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed right after Popen (the child keeps its copy)
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"moto_server on {self.endpoint_url} not ready after {self.start_timeout}s:\n{self.log_tail()}"
        )

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1) as r:
                return int(r.status) < 500
        except (urllib.error.URLError, OSError):
            return False

    def filesystem(self):  # type: ignore[no-untyped-def]
        """An s3fs filesystem for this server (the test's own view of the bucket)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="testing", secret="testing", endpoint_url=self.endpoint_url, skip_instance_cache=True
        )

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name
