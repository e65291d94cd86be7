"""What a stranger on the network can do to a running job, through the real ``elastrain-run``.

* Where a job listens: ``--standalone`` and a two-node job on 127.0.0.1 open no socket on any other address
  (agents and workers, checked while they train).
* With a shared secret (``--rdzv-conf secret_file``), a process without it that writes forged state and keys into
  the job's real store (the c10d TCPStore, or etcd) changes nothing: the job trains on in its first round and
  ends with exit 0; a node started without the secret is refused with one line.

Agents are "nodes" on 127.0.0.1 running tests/workers/membership_worker.py (a gloo all_reduce every 0.05 s).
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
import uuid
from base64 import b64decode, b64encode
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.processes import REPO, elastrain_cmd, free_port, reaped, run, spawn, wait_for

from elastrain import binding
from elastrain.rendezvous import auth

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "workers" / "membership_worker.py"
STEP = re.compile(r"MW_STEP t=(\S+) step=\d+ rank=(\d+) ws=(\d+)")
BOUND_S = 120.0
ENV = {"MW_STEP_S": "0.05", "MW_TIMEOUT": "30"}


def steps(log: Path, after: float = 0.0) -> list[tuple[int, int]]:
    """(rank, world size) of each step ``log``'s worker printed after wall-clock time ``after``."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [(int(r), int(ws)) for t, r, ws in STEP.findall(text) if float(t) > after]


def listeners(root: subprocess.Popen[bytes]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket of ``root`` and its descendants (workers included)."""
    out = []
    procs = [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def assert_loopback_only(nodes: list[subprocess.Popen[bytes]], workers: int) -> None:
    found = [item for n in nodes for item in listeners(n)]
    pids = {pid for pid, _, _ in found}
    # Meaningful: every agent (its probe) and rank 0 (the round's store) and each worker (gloo) listen somewhere.
    assert len(pids) >= len(nodes) + workers, found
    assert all(loopback(ip) for _, ip, _ in found), f"listening beyond loopback: {found}"


def test_standalone_listens_on_loopback_only(tmp_path: Path) -> None:
    log, stop = tmp_path / "node.log", tmp_path / "stop"
    cmd = elastrain_cmd("--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", str(WORKER))
    node = spawn(cmd, log, env={**ENV, "MW_STOP_FILE": str(stop)}, cwd=tmp_path)
    with reaped(node):
        wait_for(lambda: {r for r, _ in steps(log)} == {0, 1}, BOUND_S, what=f"training\n{log.read_text()}")
        assert_loopback_only([node], workers=2)
        workers = [p for p in psutil.Process(node.pid).children(recursive=True) if "GLOO_SOCKET_IFNAME" in p.environ()]
        assert workers and {p.environ()["GLOO_SOCKET_IFNAME"] for p in workers} == {binding.loopback_interface()}
        stop.touch()
        assert node.wait(timeout=BOUND_S) == 0, log.read_text()


def test_two_nodes_on_loopback_listen_on_loopback_only(tmp_path: Path) -> None:
    port, run_id, stop = free_port(), uuid.uuid4().hex[:12], tmp_path / "stop"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    cmd = elastrain_cmd(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, str(WORKER),
    )  # fmt: skip
    nodes = [spawn(cmd, log, env={**ENV, "MW_STOP_FILE": str(stop)}, cwd=tmp_path) for log in logs]
    with reaped(*nodes):
        wait_for(lambda: all((0, 2) in steps(g) or (1, 2) in steps(g) for g in logs), BOUND_S, what="training")
        assert_loopback_only(nodes, workers=2)
        stop.touch()
        assert [n.wait(timeout=BOUND_S) for n in nodes] == [0, 0], "\n".join(g.read_text() for g in logs)


# -- a stranger without the secret -------------------------------------------------------------------------------
class Stranger:
    """What a process on the network can do to the job's store without the secret: read, and write anything."""

    def state(self) -> bytes:
        raise NotImplementedError

    def write_state(self, payload: bytes) -> None:
        raise NotImplementedError

    def set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


class C10dStranger(Stranger):
    def __init__(self, port: int, run_id: str) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", port, is_master=False)
        self.key = f"torch.rendezvous.{run_id}"
        self.version = f"elastrain/{run_id}/version"

    def state(self) -> bytes:
        return b64decode(self.store.get(self.key))

    def write_state(self, payload: bytes) -> None:
        self.store.set(self.key, b64encode(payload).decode())
        self.store.add(self.version, 1)  # every node reads the state again

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)


class EtcdStranger(Stranger):
    def __init__(self, endpoint: str, run_id: str) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from elastrain.rendezvous.backends.etcd_client import EtcdClient
        from elastrain.rendezvous.backends.etcd_options import options_from_params
        from elastrain.rendezvous.backends.etcd_v3 import STATE_MAGIC

        self.client = EtcdClient(options_from_params(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1)), run_id)
        self.client.connect()
        self.magic = STATE_MAGIC
        self.version = f"elastrain/{run_id}/version"

    def state(self) -> bytes:
        found = self.client.get(self.client.root + "state")
        assert found is not None
        return found[0].removeprefix(self.magic)

    def write_state(self, payload: bytes) -> None:
        self.client.put(self.client.root + "state", self.magic + payload)
        found = self.client.get(self.client.root + "store/" + self.version)
        self.client.put(self.client.root + "store/" + self.version, str(int(found[0]) + 1000 if found else 1).encode())

    def set(self, key: str, value: bytes) -> None:
        self.client.put(self.client.root + "store/" + key, value)

    def close(self) -> None:
        self.client.close()


def opened(sealed: bytes) -> dict[str, object]:
    """The state a sealed value carries: seals authenticate, they do not hide."""
    assert auth.is_sealed(sealed), sealed[:40]
    payload: dict[str, object] = json.loads(sealed.split(b"\n", 1)[1])
    return payload


def forge(stranger: Stranger, run_id: str) -> dict[str, object]:
    """Forged state and keys, each aimed at taking the job over; returns the state as it was."""
    before = opened(stranger.state())
    members = [str(m) for m in before["members"]]  # type: ignore[attr-defined]
    nodes = {**before["nodes"], "stranger": ["10.6.6.6", 29500, 1, 2]}  # type: ignore[dict-item]
    forged = {
        **before,
        "members": ["stranger", *members],  # its address first: MASTER_ADDR of the next round
        "nodes": nodes,
        "heartbeats": {**before["heartbeats"], "stranger": 0},  # type: ignore[dict-item]
        "superseded_by": "10.6.6.6:29400",  # every node sent to its store
    }
    for m in members:
        stranger.set(f"elastrain/{run_id}/beat/{m}", b"junk")
        stranger.set(f"elastrain/{run_id}/rejoin/{before['round']}/{m}", b'["10.6.6.6", 29500, 1, 2]')
        stranger.set(f"elastrain/{run_id}/round{before['round']}/torchelastic/assigned_ranks/0", b"[0, 9, 0, 9]")
    stranger.set(f"elastrain/{run_id}/silence", json.dumps(dict.fromkeys(members, 999.0)).encode())
    stranger.write_state(json.dumps(forged).encode())
    return before


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "rdzv.secret"
    path.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    path.chmod(0o600)
    return path


@pytest.fixture(params=["c10d", pytest.param("etcd-v3", marks=pytest.mark.etcd)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(backend, endpoint): the embedded c10d store (the first node hosts it), or a real etcd."""
    if request.param == "c10d":
        yield "c10d", f"127.0.0.1:{free_port()}"
        return
    from bench.support.etcd_server import EtcdServer

    with EtcdServer(tmp_path / "etcd") as server:
        yield "etcd-v3", server.endpoint


def test_with_a_secret_a_stranger_cannot_change_the_rendezvous(
    tmp_path: Path, secret: Path, backend: tuple[str, str]
) -> None:
    name, endpoint = backend
    run_id, stop = uuid.uuid4().hex[:12], tmp_path / "stop"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]

    def cmd(conf: str) -> list[str]:
        return elastrain_cmd(
            "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", name, "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", conf, "--max-restarts", "0", str(WORKER),
        )  # fmt: skip

    env = {**ENV, "MW_STOP_FILE": str(stop)}
    nodes = [spawn(cmd(f"secret_file={secret},last_call_timeout=1"), log, env=env, cwd=tmp_path) for log in logs]
    dump = lambda: "\n".join(f"--- {g.name} ---\n{g.read_text(errors='replace')[-6000:]}" for g in logs)  # noqa: E731
    with reaped(*nodes):
        wait_for(lambda: all((0, 2) in steps(g) or (1, 2) in steps(g) for g in logs), BOUND_S, what="training")
        stranger: Stranger = (
            C10dStranger(int(endpoint.rsplit(":", 1)[1]), run_id) if name == "c10d" else EtcdStranger(endpoint, run_id)
        )
        try:
            forged_at = time.time()
            before = forge(stranger, run_id)

            def restored() -> bool:
                state = stranger.state()
                return auth.is_sealed(state) and opened(state) == before

            wait_for(restored, BOUND_S, what=f"a member to write the job's state back\n{dump()}")
        finally:
            stranger.close()
        # A node without the secret is refused with one line naming the setting.
        refused = run(cmd("last_call_timeout=1"), timeout=BOUND_S, cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr[-4000:]
        assert refused.stderr.strip().splitlines()[-1].startswith("elastrain-run: error: --rdzv-conf secret_file")
        # Training went on in its first round, at world size 2, on both nodes.
        wait_for(lambda: all(len(steps(g, forged_at)) >= 20 for g in logs), BOUND_S, what=f"training on\n{dump()}")
        stop.touch()
        codes = [n.wait(timeout=BOUND_S) for n in nodes]
    text = "\n".join(g.read_text(errors="replace") for g in logs)
    assert codes == [0, 0], dump()
    assert all(ws == 2 for g in logs for _, ws in steps(g)), dump()
    assert text.count("event=workers_started") == 2 and "event=rendezvous_done round=1" not in text, dump()
    assert "event=rendezvous_value_ignored" in text and "event=redirected" not in text, dump()
