"""--live: a node whose warm worker died, while it built or while it waited, still joins the job.

Three real elastrain-run agents on 127.0.0.1 (c10d), one Session worker each (live_worker.py), ``--nnodes 1:2`` and
``--max-restarts 0``: a and b train, c waits as a spare with its worker built and waiting for a round (warm). c's
worker is SIGKILLed there (an out-of-memory kill while the node idles), then b is SIGKILLed. c is promoted into b's
place: its agent starts a new worker into that round (a cold start that receives the state from a), a and c train
on, and the job ends at world size 2 with every node's exit 0. Before, c's agent found its dead worker only after it
had joined the round, took it for a failure past --max-restarts 0 and left: a trained on alone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from support.processes import LiveNode, free_port, kill_tree, reaped, wait_for

SCRIPT = str(Path(__file__).resolve().parents[1] / "workers" / "live_worker.py")
BOUND = 90.0  # only stops hangs


def _node(name: str, tmp: Path, port: int, env: dict[str, str]) -> LiveNode:
    return LiveNode(
        name, tmp, port, SCRIPT, env, rdzv_id="spare-warm", nnodes="1:2", last_call_s=1, collective_timeout=20
    )


def test_a_spare_whose_warm_worker_died_starts_a_new_one_when_it_is_promoted(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_FILE": str(stop)}
    port = free_port()
    a = _node("a", tmp_path, port, env)  # hosts the c10d store
    time.sleep(0.5)
    b = _node("b", tmp_path, port, env)
    with reaped(a.proc, b.proc):
        wait_for(lambda: all(len(n.lines("LW_STEP")) >= 3 for n in (a, b)), BOUND, what="a and b to train")
        c = _node("c", tmp_path, port, env)
        with reaped(c.proc):
            wait_for(lambda: bool(c.events("standby") and c.events("workers_warm")), BOUND, what="c: a warm spare")
            warm = [int(p) for p in c.events("workers_started")[0]["pids"].split(",")]
            os.kill(warm[0], signal.SIGKILL)
            time.sleep(1)
            t = time.time()
            kill_tree(b.proc.pid)

            def trains_with_c() -> bool:
                return any(s["ws"] == "2" and float(s["t"]) > t for s in c.lines("LW_STEP"))

            try:
                wait_for(trains_with_c, BOUND, what="a and the spare c to train at 2")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{a.dump()}{c.dump()}") from None
            steps = [int(s["step"]) for s in a.lines("LW_STEP")]
            tmp = tmp_path / "stop.tmp"
            tmp.write_text(str(max(steps) + 10))
            tmp.replace(stop)
            detail = a.dump() + c.dump()
            assert a.proc.wait(timeout=BOUND) == 0, detail
            assert c.proc.wait(timeout=BOUND) == 0, detail
    detail = a.dump() + c.dump()
    assert not c.events("node_failed"), detail
    assert c.events("warm_worker_lost"), detail
    # a kept its worker and state: it moved in place (no restart), and c's new worker got the state from it.
    assert len(a.lines("LW_START")) == 1 and not a.events("workers_restarting"), detail
    hashes = {}
    for n in (a, c):
        for s in n.lines("LW_STEP"):
            hashes.setdefault(int(s["step"]), set()).add(s["hash"])
    last = max(hashes)
    assert len(hashes[last]) == 1, f"a and c disagree at step {last}\n{detail}"


def test_a_warm_worker_killed_while_it_builds_starts_warm_again(tmp_path: Path) -> None:
    """A node's warm worker is SIGKILLed while it builds (an out-of-memory kill as the model loads). Its agent starts
    it warm again, and the node founds the job with a warm worker. Before, the kill ended the warm start as if the
    script could not wait for its round (``warm_start_unsupported``): its workers then started after the rendezvous,
    and the round waited for their whole build."""
    built, stop = tmp_path / "built", tmp_path / "stop"
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_FILE": str(stop), "LW_BUILD_UNTIL_FILE": str(built)}
    a = LiveNode("a", tmp_path, free_port(), SCRIPT, env, rdzv_id="rewarm", nnodes="1", last_call_s=1,
                 collective_timeout=20)  # fmt: skip
    with reaped(a.proc):
        wait_for(lambda: bool(a.events("workers_warming")), BOUND, what="a's worker to build\n" + a.dump())
        building = [int(p) for p in a.events("workers_started")[0]["pids"].split(",")]
        os.kill(building[0], signal.SIGKILL)
        wait_for(lambda: len(a.events("workers_started")) >= 2, BOUND, what="a's new worker")
        built.touch()
        try:
            wait_for(lambda: len(a.lines("LW_STEP")) >= 3, BOUND, what="a to train")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{a.dump()}") from None
        (tmp_path / "stop.tmp").write_text(str(max(int(s["step"]) for s in a.lines("LW_STEP")) + 5))
        (tmp_path / "stop.tmp").replace(stop)
        assert a.proc.wait(timeout=BOUND) == 0, a.dump()
    assert a.events("warm_worker_lost") and a.events("workers_warm"), a.dump()
    assert not a.events("warm_start_unsupported"), a.dump()
