"""A multi-node job must have one checkpoint location: a node-local --checkpoint-dir is refused at start.

Two elastrain-run agents on 127.0.0.1 play two nodes (``--nnodes 2``, one worker each). With the
same directory they pass the probe (:func:`elastrain.checkpoint.storage.check_shared`); with a
directory each (what ``/tmp/ckpt`` on two machines looks like) every rank stops with one line that
names --checkpoint-dir, instead of failing at the first save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import REPO, elastrain_cmd, free_port, reaped, spawn

WORKER = str(REPO / "tests" / "integration" / "shared_probe_worker.py")
pytestmark = pytest.mark.slow


def two_nodes(tmp_path: Path, dir_a: Path, dir_b: Path) -> tuple[tuple[int, str], tuple[int, str]]:
    port = free_port()

    def agent(ckpt: Path, host: bool) -> list[str]:
        return elastrain_cmd(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={str(host).lower()}",
            "--rdzv-id", f"shared-{port}", "--max-restarts", "0", "--checkpoint-dir", str(ckpt), WORKER,
        )  # fmt: skip

    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = spawn(agent(dir_a, True), log_a)
    b = spawn(agent(dir_b, False), log_b)
    with reaped(a, b):
        codes = (a.wait(timeout=120), b.wait(timeout=120))
    return (codes[0], log_a.read_text(errors="replace")), (codes[1], log_b.read_text(errors="replace"))


def test_one_directory_shared_by_both_nodes_passes(tmp_path: Path) -> None:
    shared = tmp_path / "ckpt"
    for code, log in two_nodes(tmp_path, shared, shared):
        assert code == 0, log
        assert "SHARED rank=" in log, log
    assert [p.name for p in shared.iterdir()] == [], "the probe leaves nothing behind"


def test_a_node_local_directory_is_refused_at_start_naming_the_flag(tmp_path: Path) -> None:
    (code_a, log_a), (code_b, log_b) = two_nodes(tmp_path, tmp_path / "node-a" / "ckpt", tmp_path / "node-b" / "ckpt")
    for code, log in ((code_a, log_a), (code_b, log_b)):
        assert code != 0, log
        line = next(line for line in log.splitlines() if line.startswith("NOT_SHARED"))
        assert "--checkpoint-dir" in line and "is not one directory shared by all nodes" in line, line
        assert "does not see the probe files of rank" in line and ("s3://" in line or "az://" in line), line
