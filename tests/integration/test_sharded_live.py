"""A sharded model (FSDP2, ``Session(shard=...)``) through membership changes under ``elastrain-run --live true``.

Three "nodes" on 127.0.0.1, one gloo worker each (tests/workers/sharded_worker.py). A node joins a
running job of two, later it is SIGKILLed between two checkpoints, taking its shards with it. No
survivor's process restarts: at the join the members save at the agreed step and everyone builds the
new world's sharded model from that checkpoint (nothing redone); after the kill the survivors rebuild
theirs and load the last committed checkpoint in place (the steps since are redone). The job ends at
the uninterrupted run's state (one process, same data; float tolerance: sums in another order).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

from support.processes import LiveNode, free_port, printed_fields, reaped, wait_for, worker_env

SCRIPT = str(Path(__file__).resolve().parents[1] / "workers" / "sharded_worker.py")
BOUND = 120.0  # only stops hangs
MAX_STEPS = 40


def _node(name: str, tmp: Path, port: int, env: dict[str, str]) -> LiveNode:
    # The first round: a and b (the minimum) after a 3 s last call; c joins later.
    ckpt = ("--checkpoint-dir", str(tmp / "ckpt"))
    return LiveNode(
        name, tmp, port, SCRIPT, env, rdzv_id="sharded-live", nnodes="2:3", last_call_s=3, collective_timeout=30,
        extra=ckpt,
    )  # fmt: skip


def test_a_sharded_job_grows_and_loses_a_node_in_place(tmp_path: Path) -> None:
    env = {"SW_MAX_STEPS": str(MAX_STEPS), "SW_SAVE_EVERY": "5", "SW_SLEEP": "0.15"}
    alone = subprocess.run(
        [sys.executable, SCRIPT], env=worker_env(env), capture_output=True, text=True, timeout=BOUND, check=True
    )
    (baseline,) = [printed_fields(line) for line in alone.stdout.splitlines() if line.startswith("SW_DONE ")]

    port = free_port()
    joined = tmp_path / "joined"
    env.update({"SW_DIE_NODE": "2", "SW_DIE_AFTER": "7"})  # the joiner (group rank 2), 7 steps after it joined
    env["SW_SLOW_UNTIL"] = str(joined)  # a and b train slowly until c trains with them
    nodes: list[LiveNode] = []
    try:
        nodes = [_node("a", tmp_path, port, env)]
        time.sleep(0.3)
        nodes.append(_node("b", tmp_path, port, env))
        a, b = nodes
        wait_for(lambda: len(a.lines("SW_STEP")) >= 6, BOUND, what="a and b to train a few steps")
        nodes.append(_node("c", tmp_path, port, env))
        c = nodes[2]
        wait_for(lambda: bool(c.lines("SW_STEP")) or c.proc.poll() is not None, BOUND, what="c to train")
        joined.touch()
        wait_for(lambda: all(n.proc.poll() is not None for n in (a, b)), BOUND, what="the job to end")
        detail = "\n".join(f"--- {n.name} ---\n{n.text()[-8000:]}" for n in nodes)
        assert a.proc.returncode == b.proc.returncode == 0, detail
        assert c.proc.poll() is not None and c.proc.returncode != 0, detail  # SIGKILLed with its worker

        # No survivor's worker restarted: one worker pid per node for the whole job.
        for n in (a, b):
            assert len({s["pid"] for s in n.lines("SW_STEP")}) == 1, detail
            assert len(n.events("workers_started")) == 1, detail
        assert {s["ws"] for s in c.lines("SW_STEP")} == {"3"}, detail  # c trained only in the world of three

        regroups = [e for n in (a, b) for e in n.events("regrouped")]
        grow = [e for e in regroups if e["world_size"] == "2->3"]
        shrink = [e for e in regroups if e["world_size"] == "3->2"]
        assert grow and shrink, detail
        # Every regroup loads the checkpoint (sharded state is never broadcast); the join saved first.
        assert all(e.get("source") is None and e.get("checkpoint") for e in regroups), detail
        assert grow[0]["rolled_back"] == "0", detail
        lost = int(shrink[0]["rolled_back"])
        assert 0 <= lost < 5, detail  # back to the last commit: at most save_every - 1 steps redone

        done = [d for n in (a, b) for d in n.lines("SW_DONE")]
        assert {d["step"] for d in done} == {str(MAX_STEPS)} and {d["samples"] for d in done} == {str(MAX_STEPS * 24)}
        for d in done:
            for key in ("norm", "total"):
                assert math.isclose(float(d[key]), float(baseline[key]), rel_tol=1e-4, abs_tol=1e-6), (d, baseline)
    finally:
        with reaped(*(n.proc for n in nodes)):
            pass
