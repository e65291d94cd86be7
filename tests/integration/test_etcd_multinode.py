"""Multi-agent jobs on ``--rdzv-backend etcd-v3`` against a real etcd: no node is special.

Agents run as "nodes" on 127.0.0.1 through the real ``python -m elastrain`` with the tiny gloo worker
tests/workers/membership_worker.py (MW_STEP lines say at which world size training goes on). These
tests use whatever handler is registered for etcd-v3 and assert behaviour only; time bounds just stop
hangs.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, free_port, kill_tree, reaped, run, spawn, wait_for

from bench.support.etcd_server import EtcdServer, make_tls_files

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

WORKER = REPO / "tests" / "workers" / "membership_worker.py"
STEP = re.compile(r"MW_STEP t=(\S+) step=\d+ rank=\d+ ws=(\d+) round=(\S+)")
# Generous bounds: a worker's cold start alone is 2-3 s, more on a loaded machine.
CHANGE_S = 90.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


class Job:
    """Agents of one job, each a node with its own log."""

    def __init__(self, tmp_path: Path, endpoint: str, nnodes: str, conf: str = "", extra: tuple[str, ...] = ()) -> None:
        self.tmp = tmp_path
        self.extra = extra
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.run_id = uuid.uuid4().hex[:12]
        self.conf = ",".join(filter(None, ["connect_timeout=10,retry_timeout=60", conf]))
        self.stop_file = tmp_path / "stop"
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start_node(self, conf: str = "", endpoint: str = "") -> int:
        """Start a node (``conf``: more --rdzv-conf for it alone; ``endpoint``: its own spelling of the job's etcd);
        its index."""
        i = len(self.nodes)
        log = self.tmp / f"node{i}.log"
        cmd = elastrain_cmd(
            "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", endpoint or self.endpoint,
            "--rdzv-id", self.run_id,
            "--rdzv-conf", ",".join(filter(None, [self.conf, conf])),
            "--nnodes", self.nnodes,
            "--nproc-per-node", "1",
            "--max-restarts", "10",
            "--monitor-interval", "0.1",
            "--master-port", str(free_port()),
            *self.extra,
            str(WORKER),
        )  # fmt: skip
        env = {"MW_STOP_FILE": str(self.stop_file), "MW_STEP_S": "0.05", "MW_TIMEOUT": "20"}
        self.nodes.append(spawn(cmd, log, env=env, cwd=self.tmp))
        self.logs.append(log)
        return i

    def text(self, i: int) -> str:
        try:
            return self.logs[i].read_text(errors="replace")
        except OSError:
            return ""

    def steps(self, i: int, after: float = 0.0) -> list[int]:
        """World sizes of node ``i``'s training steps that ended after wall-clock time ``after``."""
        return [int(ws) for t, ws, _ in STEP.findall(self.text(i)) if float(t) > after]

    def wait_training(self, nodes: list[int], world_size: int, after: float, what: str) -> None:
        def ok() -> bool:
            for i in nodes:
                if self.nodes[i].poll() is not None:
                    raise AssertionError(f"node{i} exited ({self.nodes[i].returncode}) during: {what}\n{self.dump()}")
                if world_size not in self.steps(i, after):
                    return False
            return True

        try:
            wait_for(ok, CHANGE_S, interval=0.2, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.dump()}") from None

    def kill(self, i: int) -> float:
        kill_tree(self.nodes[i].pid)
        self.nodes[i].wait(timeout=30)
        return time.time()

    def finish(self, nodes: list[int]) -> None:
        self.stop_file.touch()
        for i in nodes:
            try:
                rc = self.nodes[i].wait(timeout=CHANGE_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node{i} did not finish\n{self.dump()}") from None
            assert rc == 0, f"node{i} exited {rc}\n{self.dump()}"

    def dump(self) -> str:
        return "\n".join(f"--- node{i} ---\n{self.text(i)[-4000:]}" for i in range(len(self.nodes)))


def test_job_survives_every_node_in_turn_and_an_etcd_restart_over_tls(tmp_path: Path) -> None:
    """Three nodes over TLS with client certificates and auth; every original node dies in turn."""
    tls = make_tls_files(tmp_path / "tls")
    with EtcdServer(tmp_path / "etcd", tls=tls) as etcd:
        etcd.enable_auth("trainer", "pw", prefix="/jobs/")
        conf = (
            f"key_prefix=/jobs,ca_cert={tls.ca_cert},client_cert={tls.client_cert},"
            f"client_key={tls.client_key},user=trainer,password=pw,lease_ttl=5"
        )
        job = Job(tmp_path, etcd.endpoint, "1:3", conf)
        first, second, third = job.start_node(), job.start_node(), job.start_node()
        with reaped(*job.nodes):
            job.wait_training([first, second, third], 3, 0, "three nodes training")

            t = job.kill(first)  # the first node started: it holds nothing special
            job.wait_training([second, third], 2, t, "two survivors after the first node died")

            etcd.restart(down_for=1.0)  # same data dir (and auth tokens forgotten): the job goes on
            t = time.time()
            # Workers never talk to etcd and train on through the outage; the agents wait and retry.
            # (Measured without auth: same round, no gap in the steps. Whether the round stays the same
            # depends on the handler's heartbeat timeout versus how unevenly the agents reconnect.)
            job.wait_training([second, third], 2, t, "training after the etcd restart")

            t = job.kill(second)
            job.wait_training([third], 1, t, "one survivor")

            fourth = job.start_node()  # a node joining a running job (pytorch#135712 must not bite)
            with reaped(job.nodes[fourth]):
                job.wait_training([third, fourth], 2, t, "a new node joined the survivor")

                t = job.kill(third)  # the last of the original nodes
                job.wait_training([fourth], 1, t, "the newcomer alone")
                client = etcd.client()
                assert list(client.get_prefix(f"/jobs/{job.run_id}/"))
                job.finish([fourth])
        # Nobody keeps the job's lease alive any more: its keys go within lease_ttl.
        wait_for(
            lambda: not list(client.get_prefix(f"/jobs/{job.run_id}/")),
            30,
            interval=0.5,
            what="the finished job's keys to expire",
        )


def test_a_node_that_fails_on_its_own_leaves_the_job_open_for_the_nodes_that_come_later(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """A node whose agent fails on its own (here: alone, no round forms within ``join_timeout``; a pod started before
    the others were scheduled) leaves the job; the nodes launched after it form the job and train. Before, its
    launcher closed the rendezvous on the way out (torch's launcher does), and on etcd that is the job's one
    rendezvous: the later nodes ended at once with exit 0, as if the job had finished, having trained nothing."""
    job = Job(tmp_path, etcd.endpoint, "2:2")
    early = job.start_node("join_timeout=3")
    with reaped(*job.nodes):
        assert job.nodes[early].wait(timeout=CHANGE_S) != 0, job.dump()
        second, third = job.start_node(), job.start_node()
        with reaped(job.nodes[second], job.nodes[third]):
            job.wait_training([second, third], 2, 0, "the two later nodes training")
            job.finish([second, third])
        assert "job_finished_elsewhere" not in job.text(second) + job.text(third), job.dump()
        assert "event=node_failed" in job.text(early) and "job_close" not in job.text(early), job.dump()


def test_a_node_frozen_past_its_eviction_joins_the_world_that_superseded_it(tmp_path: Path, etcd: EtcdServer) -> None:
    """A node frozen (SIGSTOP: a VM paused) until the other one evicted it and claimed the next fencing generation
    wakes up, finds its world superseded, and joins the newer world's next round on the same etcd: the job trains
    on two nodes again. Before, it raised "this backend cannot move there" (a c10d store can move; etcd's
    rendezvous is the job's one) and exited, closing the job's rendezvous: the other node ended as if the job had
    finished at its next round (soak seed 90007). The two nodes spell the job's etcd differently (another order, a
    scheme, the default port): a fencing claim names the store the same way on both (before, the woken node took its
    own etcd for another store, and left)."""
    port = etcd.endpoint.rsplit(":", 1)[1]
    job = Job(tmp_path, f"127.0.0.1:{port},localhost:{port}", "1:2", extra=("--checkpoint-dir", str(tmp_path / "ckpt")))
    first, second = job.start_node(), job.start_node(endpoint=f"http://localhost:{port}/,127.0.0.1:{port}")
    with reaped(*job.nodes):
        job.wait_training([first, second], 2, 0, "two nodes training")
        kill_tree(job.nodes[second].pid, signal.SIGSTOP)
        t = time.time()
        job.wait_training([first], 1, t, "the first node alone, the frozen one evicted")
        kill_tree(job.nodes[second].pid, signal.SIGCONT)
        t = time.time()
        job.wait_training([first, second], 2, t, "both nodes training again")
        woke = job.text(second)
        assert "event=world_superseded" in woke and "event=redirected" in woke, job.dump()
        job.finish([first, second])
        assert "job_close_recorded generation=0" not in woke, job.dump()


FROZEN_AS_FORMED = """
import os, signal, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
endpoint, run_id, conf = sys.argv[1:4]
conf = dict(kv.split("=", 1) for kv in conf.split(","))
params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, "127.0.0.1", **conf)
info = registry.get_rendezvous_handler(params).next_rendezvous()
print("FORMED", info.rank, info.world_size, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # frozen before it shares its worker information (torch's rank assignment)
"""


def test_a_member_frozen_as_its_round_forms_costs_the_others_seconds_not_the_stores_default(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """A node joins a running job's next round and freezes the moment the round forms, before its agent writes
    what torch's rank assignment reads (a VM paused, a SIGSTOP: soak seed 90003). The running node's blocking read
    of that key gives up after ``read_timeout`` (5 s), and it forms the next round without the frozen node, which
    its heartbeat evicts. Before, the etcd store's reads waited the store's default 300 s (the c10d store's, 5 s)."""
    job = Job(tmp_path, etcd.endpoint, "1:2")
    first = job.start_node()
    with reaped(*job.nodes):
        job.wait_training([first], 1, 0, "the first node alone")
        log = tmp_path / "frozen.log"
        frozen = spawn([sys.executable, "-c", FROZEN_AS_FORMED, etcd.endpoint, job.run_id, job.conf], log, cwd=tmp_path)
        with reaped(frozen):
            wait_for(lambda: "FORMED" in log.read_text(errors="replace"), CHANGE_S, what=f"the round\n{job.dump()}")
            formed = time.time()
            job.wait_training([first], 1, formed, "the first node training again without the frozen one")
            assert "rendezvous_incomplete" in job.text(first), job.dump()
            job.finish([first])


def test_plain_torchrun_registry_finds_etcd_v3_and_unreachable_etcd_fails_fast(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """torch's own registry loads the ``torchrun.handlers`` entry point (the script never imports elastrain);
    an etcd nobody answers on is an error naming the endpoint, raised within connect_timeout."""
    dead = f"127.0.0.1:{free_port()}"
    code = f"""
import time
from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
h = registry.get_rendezvous_handler(RendezvousParameters("etcd-v3", "{etcd.endpoint}", "ep-check", 1, 2))
print("HANDLER", type(h).__module__, h.get_backend(), h.get_run_id())
start = time.monotonic()
try:
    registry.get_rendezvous_handler(RendezvousParameters("etcd-v3", "{dead}", "x", 1, 2, connect_timeout=1))
except Exception as exc:
    print("FAILED_AFTER", round(time.monotonic() - start, 1), type(exc).__name__, exc)
"""
    proc = run([sys.executable, "-c", code], timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HANDLER elastrain." in proc.stdout and "etcd-v3 ep-check" in proc.stdout, proc.stdout
    failed = re.search(r"FAILED_AFTER (\S+) EtcdUnavailableError (.*)", proc.stdout)
    assert failed is not None, proc.stdout
    assert f"http://{dead}" in failed.group(2) and "--rdzv-endpoint" in failed.group(2)
    assert float(failed.group(1)) < 10  # connect_timeout=1, plus slack for a loaded machine
