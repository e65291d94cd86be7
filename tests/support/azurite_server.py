"""Azure's Blob emulator (Azurite) for tests: a free loopback port, its own data folder, stopped by PID.

Usage (no pytest plugin needed)::

    from support.azurite_server import AzuriteServer

    with AzuriteServer(tmp_path / "azurite") as server:
        server.env              # AZURE_STORAGE_CONNECTION_STRING for adlfs (the well-known dev account)
        server.make_container("ckpt")

Azurite comes from npm: ``./dev setup`` installs a pinned version into ``.tools/`` (override the
binary with ELASTRAIN_TEST_AZURITE).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from bench.support.local_server import LocalServer
from support.processes import REPO, free_port

# Azurite's fixed development account (public, documented by Microsoft; not a secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary() -> str:
    override = os.environ.get("ELASTRAIN_TEST_AZURITE")
    candidates = [
        override,
        str(REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"),
        shutil.which("azurite-blob"),
    ]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    raise FileNotFoundError("azurite-blob not found: run ./dev setup (it installs Azurite from npm into .tools/)")


class AzuriteServer(LocalServer):
    """One Azurite Blob service on 127.0.0.1."""

    STOP_TIMEOUT_S = 2.0
    """Azurite waits for idle keep-alive clients after SIGTERM: SIGKILL it soon."""

    def __init__(self, directory: Path, start_timeout: float = 30.0) -> None:
        self.directory = Path(directory)
        super().__init__(self.directory / "azurite.log")
        self.start_timeout = start_timeout
        self.port = free_port()

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};"
        )

    @property
    def env(self) -> dict[str, str]:
        """The standard variable adlfs (and the Azure SDK tools) read: no elastrain-specific setting."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        cmd = [
            azurite_binary(),
            "--blobHost=127.0.0.1",
            f"--blobPort={self.port}",
            f"--location={data}",
            "--skipApiVersionCheck",
            "--loose",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed right after Popen (the child keeps its copy)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"azurite on 127.0.0.1:{self.port} not ready after {self.start_timeout}s:\n{self.log_tail()}"
        )

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        return "successfully listens" in self.log_path.read_text(errors="replace")

    def filesystem(self):  # type: ignore[no-untyped-def]
        """An adlfs filesystem for this server (the test's own view of the container)."""
        import adlfs

        return adlfs.AzureBlobFileSystem(connection_string=self.connection_string, skip_instance_cache=True)

    def make_container(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name
