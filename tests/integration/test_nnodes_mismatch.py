"""Nodes of one job launched with different ``--nnodes``: the newcomer is refused in one line (real agents, c10d).

Every node decides rounds by its own ``--nnodes`` (when a round may form, how many fit), so two ranges in one job
form rounds that half of the nodes would not. torch's handler lets them mix without a word; elastrain's refuses
the node that joins with another range than the job's running nodes, naming both, before it takes part in a round.
"""

from __future__ import annotations

from pathlib import Path

from support.processes import REPO, elastrain_cmd, free_port, reaped, run, spawn, wait_for

SESSION_WORKER = str(REPO / "tests" / "workers" / "session_worker.py")


def node(port: int, nnodes: str, root: Path) -> list[str]:
    return elastrain_cmd(
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=job",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "--rdzv-conf=last_call_timeout=1",
        SESSION_WORKER,
        f"--checkpoint-dir={root}",
        "--save-every=1000",
        "--sleep=0.1",
    )


def test_a_node_with_another_nnodes_than_the_job_is_refused_and_the_job_trains_on(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "a.log"
    a = spawn(node(port, "1:3", tmp_path / "ckpt"), log)
    with reaped(a):
        wait_for(lambda: "event=step" in log.read_text(errors="replace") or "STEP" in log.read_text(errors="replace"),
                 120, what="the job's first node to train")  # fmt: skip
        b = run(node(port, "2:4", tmp_path / "ckpt"), timeout=120)
        detail = (
            f"--- b ---\n{b.stdout[-3000:]}\n{b.stderr[-6000:]}\n--- a ---\n{log.read_text(errors='replace')[-4000:]}"
        )
        assert b.returncode == 2, detail
        last = b.stderr.strip().splitlines()[-1]
        assert last.startswith("elastrain-run: error: --nnodes: this node says 2:4"), detail
        assert "says 1:3" in last, detail
        assert a.poll() is None, detail  # the job's node trains on
