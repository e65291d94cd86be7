"""The chaos harness follows a trace: kills and returns at the right times, whole trees, no orphans.

The "nodes" here are small fake agents (a parent that starts a worker in its own session, as torch
does), so the test is about the harness, not about training; tests/e2e/test_t5_preemption.py runs
it with real elastrain-run agents.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from support.processes import PYTHON, REPO, free_port, run

from elastrain.chaos.harness import ChaosHarness
from elastrain.chaos.procs import TAG_VARIABLE
from elastrain.chaos.trace import trace_from_dict

FAKE_NODE = r"""
import os, signal, subprocess, sys, time
node, until, pid_dir, ignore_term = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, lambda *_: None)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(os.path.join(pid_dir, f"{node}-{os.getpid()}"), "w") as f:
    f.write(f"{os.getpid()} {worker.pid} {time.time()}")
while time.time() < until:
    time.sleep(0.05)
sys.exit(0)  # leaves its worker behind, like an agent that died: the harness must reap it
"""


@pytest.mark.slow
def test_harness_follows_the_trace_and_leaves_no_orphans(tmp_path):
    script = tmp_path / "fake_node.py"
    script.write_text(FAKE_NODE)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    trace = trace_from_dict(
        {
            "nodes": 3,
            "events": [
                {"at": 1.0, "action": "kill", "node": 1},
                {"at": 1.5, "action": "term", "node": 2, "notice": 1.0},
                {"at": 2.5, "action": "start", "node": 1},
            ],
        }
    )
    until = time.time() + 5.0

    def node_command(i: int) -> list[str]:
        return [sys.executable, str(script), str(i), str(until), str(pid_dir), "1" if i == 2 else "0"]

    out = tmp_path / "out"
    result = ChaosHarness(trace, node_command, out, poll_s=0.05, drain_s=10).run(timeout_s=60)

    assert result.succeeded, result.timeline
    events = [(e["action"], e.get("node")) for e in result.timeline]
    assert events[:3] == [("start", 0), ("start", 1), ("start", 2)]
    by_action = {(e["action"], e.get("node")): e for e in result.timeline}
    kill, term = by_action[("kill", 1)], by_action[("term", 2)]
    restart = [e for e in result.timeline if e["action"] == "start" and e["node"] == 1][1]
    hard = by_action[("notice_expired", 2)]
    assert 1.0 <= kill["t"] < 2.0
    assert 1.5 <= term["t"] < 2.5
    assert 2.5 <= hard["t"] < 3.5, "SIGKILL follows SIGTERM after the notice window, not before"
    assert 2.5 <= restart["t"] < 3.5
    assert restart["incarnation"] == 2
    # Every kill took the agent and its worker (in its own session).
    first_node1 = [p for p in pid_dir.iterdir() if p.name.startswith("1-")]
    agent, worker = min((p.read_text().split()[:2] for p in first_node1), key=lambda x: int(x[0]))
    assert {int(agent), int(worker)} <= set(kill["pids"])
    # Exits are recorded; node 0 and the restarted node 1 finished the "job".
    exits = {(e["node"], e["returncode"]) for e in result.timeline if e["action"] == "exit"}
    assert (0, 0) in exits
    assert {(1, -9), (2, -9)} <= exits, "every kill and expired notice is followed by the node's exit"
    # No process that any node ever started is alive at the end.
    started = [int(x) for p in pid_dir.iterdir() for x in p.read_text().split()[:2]]
    assert len(started) == 8  # 4 incarnations x (agent + worker)
    assert not [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    saved = json.loads((out / "timeline.json").read_text())
    assert saved["result"]["succeeded"] is True
    assert saved["trace"]["nodes"] == 3
    assert (out / "node-1.log").read_text().count("chaos: node 1 start") == 2


HOST_NODE = r"""
import socket, sys, time
node, port = int(sys.argv[1]), int(sys.argv[2])
if node == 0:
    time.sleep(1.0)  # slow to come up, like an agent importing torch
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
time.sleep(1.0)
"""


def test_first_node_is_up_before_the_others_start(tmp_path):
    """With host_port, node 0 binds the store port before any other node starts (so it hosts the store)."""
    script = tmp_path / "host_node.py"
    script.write_text(HOST_NODE)
    port = free_port()
    trace = trace_from_dict({"nodes": 3})
    result = ChaosHarness(
        trace, lambda i: [sys.executable, str(script), str(i), str(port)], tmp_path / "out", poll_s=0.05, host_port=port
    ).run(timeout_s=30)
    assert result.succeeded, result.timeline
    actions = [(e["action"], e.get("node")) for e in result.timeline]
    assert actions[:4] == [("start", 0), ("host_ready", 0), ("start", 1), ("start", 2)]
    assert result.timeline[1]["t"] >= 1.0


@pytest.mark.slow
def test_cli_runs_a_script_as_local_elastrain_nodes(tmp_path):
    """``python -m elastrain.chaos`` with real elastrain-run agents: 2 nodes, the minimal example, no preemption."""
    trace = tmp_path / "trace.yaml"
    trace.write_text("nodes: 2\nevents: []\n")
    out = tmp_path / "chaos"
    cmd = [PYTHON, "-m", "elastrain.chaos", "--trace", str(trace), "--output-dir", str(out), "--port", str(free_port()),
           "--timeout", "150", "--", str(REPO / "examples" / "minimal" / "train.py")]  # fmt: skip
    res = run(cmd, timeout=180)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("node-*.log")))
    assert res.returncode == 0, res.stderr[-3000:] + logs
    assert "world_size=2 sum=3" in logs
    timeline = json.loads((out / "timeline.json").read_text())
    assert [e["action"] for e in timeline["events"]][:3] == ["start", "host_ready", "start"]
    assert timeline["result"] == {**timeline["result"], "succeeded": True, "leftover_pids": []}


CHURN_NODE = r"""
import os, sys, time
node, until, pid_dir = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if node == 2:
    sys.exit(3)
while time.time() < until:
    with open(os.path.join(pid_dir, f"{node}-{os.getpid()}"), "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_stop_cont_kill_all_restart_all_gap_and_escapees(tmp_path):
    script = tmp_path / "churn_node.py"
    script.write_text(CHURN_NODE)
    pid_dir = tmp_path / "beats"
    pid_dir.mkdir()
    trace = trace_from_dict(
        {
            "nodes": 3,
            "max_nodes": 2,
            "events": [
                {"at": 0.5, "action": "stop", "node": 1},
                {"gap": 1.0, "action": "cont", "node": 1},
                {"gap": 0.5, "action": "start", "node": 2},
                {"gap": 2.0, "action": "kill_all"},  # node 2 exits 3 before it, even on a loaded box
                {"gap": 1.0, "action": "restart_all", "nodes": [0, 1]},
            ],
        }
    )
    until = time.time() + 8.0

    def node_command(i: int) -> list[str]:
        return [sys.executable, str(script), str(i), str(until), str(pid_dir)]

    harness = ChaosHarness(trace, node_command, tmp_path / "out", poll_s=0.05, drain_s=10)
    # A process of this run that no node's tree ever saw (re-parented before it was): only the tag finds it.
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, TAG_VARIABLE: harness.tag}
    )
    try:
        result = harness.run(timeout_s=60)
    finally:
        stray.kill()
        stray.wait(timeout=10)

    fired = [e["t"] for e in result.timeline if e["action"] == "fired"]
    # The timeline's times are rounded to the millisecond: 2.03 - 1.53 is 0.4999... in floats.
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(fired)]
    assert fired[0] >= 0.5 and all(g >= want for g, want in zip(gaps, [1.0, 0.5, 2.0, 1.0], strict=True)), fired
    t = {e["action"]: e["t"] for e in result.timeline if e["action"] in ("stop", "cont", "kill_all", "restart_all")}
    # Node 1 wrote no heartbeat while it was stopped, and again after the cont.
    beats = sorted(float(x) for p in pid_dir.glob("1-*") for x in p.read_text().split())
    wall0 = json.loads((tmp_path / "out" / "timeline.json").read_text())["started_at"]
    frozen = [b - wall0 for b in beats if t["stop"] + 0.2 < b - wall0 < t["cont"] - 0.05]
    assert not frozen, frozen
    assert any(t["cont"] < b - wall0 < t["kill_all"] for b in beats)
    starts = [e["node"] for e in result.timeline if e["action"] == "start"]
    assert starts == [0, 1, 2, 0, 1]
    assert result.succeeded is False  # node 2 exited 3 on its own
    assert [e["pid"] for e in result.escaped] == [stray.pid] and "sleep(600)" in result.escaped[0]["cmdline"]
    assert stray.returncode == -9, "the harness killed it"


def test_a_job_that_makes_no_progress_is_ended_as_stalled(tmp_path):
    trace = trace_from_dict({"nodes": 1, "events": [{"after_step": 5, "action": "kill", "node": 0}]})
    node = [sys.executable, "-c", "import time; time.sleep(60)"]
    harness = ChaosHarness(trace, lambda _: node, tmp_path / "out", poll_s=0.05, progress=lambda: 2)
    result = harness.run(timeout_s=30, stall_s=1.0)
    assert result.timed_out and not result.succeeded and result.elapsed_s < 10
    (stalled,) = [e for e in result.timeline if e["action"] == "stalled"]
    assert stalled["at_step"] == 2 and stalled["stalled_s"] >= 1.0
    assert result.leftover_pids, "the node still running at the end was killed"


def test_a_start_waits_for_a_node_still_in_its_notice_window(tmp_path):
    trace = trace_from_dict(
        {
            "nodes": 2,
            "events": [
                {"at": 0.5, "action": "term", "node": 1, "notice": 1.5},
                {"gap": 0.2, "action": "start", "node": 1},
            ],
        }
    )
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, lambda *_: None); time.sleep(4)"
    harness = ChaosHarness(trace, lambda _: [sys.executable, "-c", ignore_term], tmp_path / "out", poll_s=0.05)
    result = harness.run(timeout_s=30)
    actions = [(e["action"], e.get("node")) for e in result.timeline]
    assert ("skip", 1) not in actions
    t = {(e["action"], e.get("node")): e["t"] for e in result.timeline}
    restart = [e["t"] for e in result.timeline if e["action"] == "start" and e["node"] == 1][1]
    assert t[("notice_expired", 1)] <= restart, "the start waited until the termed node was gone"


RESTARTING_AGENT = r"""
import subprocess, sys, time
node, until = int(sys.argv[1]), float(sys.argv[2])
if node == 1:
    time.sleep(2.5)  # still starting when its crash comes: nothing to crash yet
if node == 2:  # never starts a worker (as a spare would not)
    time.sleep(max(0.0, until - time.time()))
    sys.exit(0)


def start():
    ws = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
          for _ in range(2)]
    print("elastrain event=workers_started round=0 pids=" + ",".join(str(w.pid) for w in ws), flush=True)
    return ws


workers = start()
while time.time() < until:
    if any(w.poll() is not None for w in workers):  # one died: stop the others and start them all again
        for w in workers:
            w.kill()
            w.wait()
        workers = start()
    time.sleep(0.05)
for w in workers:
    w.kill()
    w.wait()
"""


@pytest.mark.slow
def test_a_crash_kills_one_worker_and_leaves_its_agent(tmp_path):
    """``crash``: SIGKILL of one worker of the agent's last ``workers_started`` line, each crash of a node the next
    local rank; a crash of a node still starting waits for its workers, and one of a node that starts none in
    ``crash_wait_s`` is skipped, with the reason."""
    script = tmp_path / "agent.py"
    script.write_text(RESTARTING_AGENT)
    trace = trace_from_dict(
        {
            "nodes": 3,
            "events": [
                {"at": 1.0, "action": "crash", "node": 1},
                {"at": 1.5, "action": "crash", "node": 0},
                {"gap": 1.0, "action": "crash", "node": 0},
                {"gap": 0.1, "action": "crash", "node": 2},
            ],
        }
    )
    until = time.time() + 16.0
    out = tmp_path / "out"
    command = lambda i: [sys.executable, str(script), str(i), str(until)]  # noqa: E731
    # Node 1 starts its workers 2.5 s after its interpreter (later on a loaded box): well within the wait.
    harness = ChaosHarness(trace, command, out, poll_s=0.05, crash_wait_s=6.0)
    result = harness.run(timeout_s=60)

    assert result.succeeded, result.timeline
    crashes = [e for e in result.timeline if e["action"] == "crash"]
    skips = [e for e in result.timeline if e["action"] == "skip"]
    assert [e["node"] for e in skips] == [2] and "no worker running" in skips[0]["reason"]
    started = {
        i: [line.split("pids=")[1].split(",") for line in (out / f"node-{i}.log").read_text().splitlines()
            if "workers_started" in line]
        for i in (0, 1)
    }  # fmt: skip
    assert len(started[0]) == 3 and len(started[1]) == 2, started  # the first workers, and again after each crash
    assert [c["node"] for c in crashes] == [1, 0, 0]
    assert crashes[0]["pid"] == int(started[1][0][0]), "node 1's crash waited for its first worker"
    assert [c["pid"] for c in crashes[1:]] == [int(started[0][0][0]), int(started[0][1][1])]
    exits = [e for e in result.timeline if e["action"] == "exit"]
    assert {(e["node"], e["returncode"]) for e in exits} == {(0, 0), (1, 0), (2, 0)}, "the agents lived on"
    assert not result.leftover_pids
