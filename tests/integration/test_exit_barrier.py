"""Through the real elastrain-run, two local nodes: a node whose workers finished waits for its round's other node
(torch's exit barrier) without going silent, and stops waiting once that node is gone.

torch's barrier held the store client that the heartbeat shares for the whole wait: a node that finished a few
seconds before its peer (rank 1 here sleeps after training, as a rank saving the final model does) stopped
beating, the peer declared it dead mid-save (``node_dead how=heartbeat_timeout``) and both hung. And a node whose
peer died while it waited waited out the barrier's 300 s.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from support.processes import elastrain_cmd, events_in, free_port, kill_tree, reaped, spawn, wait_for, wait_logged

pytestmark = pytest.mark.slow

# A plain torch script: a few collectives, then rank 1 takes LATE_S more seconds to finish (a long final save).
WORKER = r"""
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
for _ in range(5):
    dist.all_reduce(t)
dist.destroy_process_group()
print(f"TRAINED {rank}", flush=True)
if rank == 1:
    time.sleep(float(os.environ["LATE_S"]))
print(f"DONE {rank}", flush=True)
"""


Nodes = dict[str, tuple[subprocess.Popen[bytes], Path]]


def _nodes(tmp_path: Path, late_s: float) -> Nodes:
    script = tmp_path / "late.py"
    script.write_text(WORKER)
    port = free_port()
    nodes: Nodes = {}
    for name in ("a", "b"):
        log = tmp_path / f"{name}.log"
        cmd = elastrain_cmd(
            "--nnodes", "2", "--rdzv-backend", "c10d", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"xb-{port}", str(script),
        )  # fmt: skip
        nodes[name] = (spawn(cmd, log, env={"LATE_S": str(late_s)}, cwd=tmp_path), log)
    return nodes


def _dump(nodes: Nodes) -> str:
    return "\n".join(f"--- {n} ---\n{log.read_text(errors='replace')[-6000:]}" for n, (_, log) in nodes.items())


def _finished_first(nodes: Nodes) -> str:
    """The node whose worker is rank 0 (it finishes first)."""
    wait_for(lambda: any("DONE 0" in log.read_text(errors="replace") for _, log in nodes.values()), 120, what="rank 0")
    return next(n for n, (_, log) in nodes.items() if "DONE 0" in log.read_text(errors="replace"))


def test_a_node_that_finished_keeps_beating_until_its_peer_finishes(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path, late_s=12.0)  # more than twice the heartbeat timeout (5 s)
    with reaped(*(p for p, _ in nodes.values())):
        first = _finished_first(nodes)
        codes = wait_logged(list(nodes.values()), 180)
    assert codes == [0, 0], _dump(nodes)
    logs = {n: log.read_text(errors="replace") for n, (_, log) in nodes.items()}
    for text in logs.values():
        assert not events_in(text, "node_dead") and not events_in(text, "membership_changed"), _dump(nodes)
        assert not events_in(text, "store_call_stuck"), _dump(nodes)
        assert len(events_in(text, "workers_started")) == 1, _dump(nodes)  # nobody ran its script again
    waited = events_in(logs[first], "exit_barrier_passed")
    assert waited and float(waited[0]["waited_s"]) > 5.0, _dump(nodes)  # it waited for its peer, beating


def test_a_node_waiting_for_its_peer_stops_waiting_once_the_peer_is_gone(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path, late_s=600.0)
    with reaped(*(p for p, _ in nodes.values())):
        first = _finished_first(nodes)
        log = nodes[first][1]
        wait_for(lambda: bool(events_in(log.read_text(errors="replace"), "exit_barrier_waiting")), 60, what="the wait")
        other = next(n for n in nodes if n != first)
        kill_tree(nodes[other][0].pid, signal.SIGKILL)
        # Released by the departure, far within torch's 300 s barrier.
        codes = wait_logged([nodes[first]], 120)
    assert codes == [0], _dump(nodes)
    text = log.read_text(errors="replace")
    released = events_in(text, "exit_barrier_released")
    assert released and "departed" in released[0]["cause"], _dump(nodes)
    assert events_in(text, "job_succeeded"), _dump(nodes)
