"""A multi-node job must have one checkpoint location: a node-local --checkpoint-dir is refused at start.

Two elastrain-run agents on 127.0.0.1 play two nodes (``--nnodes 2``, one worker each). With the
same directory they pass the probe (:func:`elastrain.storage.check_shared`); with a
directory each (what ``/tmp/ckpt`` on two machines looks like) every rank stops with one line that
names --checkpoint-dir, instead of failing at the first save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, free_port, reaped, spawn, wait_logged

from elastrain import fence

WORKER = str(REPO / "tests" / "workers" / "shared_probe_worker.py")
pytestmark = pytest.mark.slow


def two_nodes(
    tmp_path: Path, dir_a: Path, dir_b: Path, env: dict[str, str] | None = None
) -> tuple[tuple[int, str], tuple[int, str]]:
    port = free_port()

    def agent(ckpt: Path, host: bool) -> list[str]:
        return elastrain_cmd(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={str(host).lower()}",
            "--rdzv-id", f"shared-{port}", "--max-restarts", "0", "--checkpoint-dir", str(ckpt), WORKER,
        )  # fmt: skip

    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = spawn(agent(dir_a, True), log_a, env)
    b = spawn(agent(dir_b, False), log_b, env)
    with reaped(a, b):
        codes = wait_logged([(a, log_a), (b, log_b)], timeout=120)
    return (codes[0], log_a.read_text(errors="replace")), (codes[1], log_b.read_text(errors="replace"))


def test_one_directory_shared_by_both_nodes_passes(tmp_path: Path) -> None:
    shared = tmp_path / "ckpt"
    for code, log in two_nodes(tmp_path, shared, shared):
        assert code == 0, log
        assert "SHARED rank=" in log, log
    # The probe leaves nothing behind (beside the job's fencing generation, claimed by the launcher).
    assert [p.name for p in shared.iterdir() if p.name != fence.FENCE_DIR] == [], "the probe left files"


@pytest.mark.parametrize("slow_rank", [None, 0, 1], ids=["together", "host-slow", "peer-slow"])
def test_a_node_local_directory_is_refused_at_start_naming_the_flag(tmp_path: Path, slow_rank: int | None) -> None:
    # With one rank slow to exit, the other node leaves first on its setting error: the slow node must
    # still end on its own (not stop its workers for a new round that waits for the departed node).
    env = {} if slow_rank is None else {"PROBE_SLOW_RANK": str(slow_rank)}
    dirs = (tmp_path / "node-a" / "ckpt", tmp_path / "node-b" / "ckpt")
    (code_a, log_a), (code_b, log_b) = two_nodes(tmp_path, *dirs, env)
    for code, log in ((code_a, log_a), (code_b, log_b)):
        assert code != 0, log
        line = next(line for line in log.splitlines() if line.startswith("NOT_SHARED"))
        assert "--checkpoint-dir" in line and "is not one directory shared by all nodes" in line, line
        assert "does not see the probe files of rank" in line and ("s3://" in line or "az://" in line), line
    if slow_rank is not None:
        # The slow rank's node: ranks follow the order the nodes joined in, which the store's host need not win.
        slow_log = next(log for log in (log_a, log_b) if f"NOT_SHARED rank={slow_rank} " in log)
        assert "event=peer_config_error" in slow_log and "event=worker_config_error" in slow_log, slow_log
