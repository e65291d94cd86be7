"""Run a training job as N local nodes and follow a preemption trace; record what happened when.

Each node is one launcher process (by default ``python -m elastrain --nnodes 1:N --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT ... script args``) in its own session, with its
output in ``OUTPUT_DIR/node-<i>.log``. The harness fires the trace's events at their times, notices
when nodes exit, and ends when the job has finished (a node exited with status 0), when every node
is down with nothing left to start, or at the timeout. Whatever is still running at the end is
killed, agents and workers alike, and ``timeline.json`` says what was done and when.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from elastrain.chaos.procs import TAG_VARIABLE, ProcessTree, tagged_processes
from elastrain.chaos.trace import Action, Trace, TraceEvent
from elastrain.errors import TraceError
from elastrain.log import lifecycle

TIMELINE_FILE = "timeline.json"


def elastrain_node_command(
    script: Sequence[str],
    nodes: int,
    port: int,
    run_id: str,
    launcher_args: Sequence[str] = (),
    min_nodes: int = 1,
    max_restarts: int = 100,
) -> list[str]:
    """The command of one node: an elastrain-run agent with one worker joining the job on 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "elastrain",
        f"--nnodes={min_nodes}:{nodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",
        f"--max-restarts={max_restarts}",
        *launcher_args,
        *script,
    ]


@dataclass
class _Node:
    index: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    tree: ProcessTree | None = None
    incarnation: int = 0
    signalled: bool = False
    hard_kill_at: float | None = None
    log_fh: IO[bytes] | None = None
    exit_recorded: bool = False
    stopped: bool = False


@dataclass
class ChaosResult:
    succeeded: bool
    timed_out: bool
    elapsed_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    leftover_pids: list[int] = field(default_factory=list)
    """Processes still running when the harness ended and that it had to kill (orphans, hung nodes)."""
    escaped: list[dict[str, Any]] = field(default_factory=list)
    """Processes of this run (by their environment tag) alive after every tree was killed: ``pid``, ``cmdline``."""


class ChaosHarness:
    def __init__(
        self,
        trace: Trace,
        node_command: Callable[[int], Sequence[str]],
        output_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        poll_s: float = 0.1,
        drain_s: float = 60.0,
        progress: Callable[[], int] | None = None,
        host_port: int | None = None,
    ) -> None:
        """``node_command(i)`` gives node ``i``'s command line; ``drain_s`` bounds how long the other
        nodes may take to exit after the first one finished the job; ``progress()`` returns the job's
        highest step so far, for events with ``after_step`` (for example a :class:`MetricsProgress`).

        ``host_port``: start the first node alone and wait until it listens on this port on
        127.0.0.1 before starting the others, so that the first node hosts the c10d store (whose
        host a trace should not kill) instead of whichever node wins the race to bind it."""
        self.trace = trace
        self.node_command = node_command
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.tag = uuid.uuid4().hex
        self.env[TAG_VARIABLE] = self.tag
        self.poll_s = poll_s
        self.drain_s = drain_s
        self.progress = progress
        self.host_port = host_port
        if progress is None and any(e.after_step is not None for e in trace.events):
            raise TraceError("the trace has after_step events: give the harness a progress source (--progress-file)")
        self.nodes = [_Node(i, self.output_dir / f"node-{i}.log") for i in range(trace.nodes)]
        self.timeline: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._wall0 = 0.0
        self._last_fired = 0.0

    # -- recording --------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _record(self, action: str, node: int | None = None, **fields: Any) -> None:
        entry: dict[str, Any] = {"t": round(self._now(), 3), "wall": round(time.time(), 3), "action": action}
        if node is not None:
            entry["node"] = node
        entry.update(fields)
        self.timeline.append(entry)
        if self.progress is not None:
            entry["step"] = self.progress()
        lifecycle(
            "chaos_" + action, node=node, **{k: v for k, v in entry.items() if k not in ("pids", "action", "node")}
        )
        self._write_timeline(result=None)

    def _write_timeline(self, result: ChaosResult | None) -> None:
        data: dict[str, Any] = {
            "started_at": self._wall0,
            "nodes": self.trace.nodes,
            "trace": self.trace.to_dict(),
            "commands": [list(self.node_command(i)) for i in range(self.trace.nodes)],
            "events": self.timeline,
        }
        if result is not None:
            data["result"] = {
                "succeeded": result.succeeded,
                "timed_out": result.timed_out,
                "elapsed_s": round(result.elapsed_s, 3),
                "leftover_pids": result.leftover_pids,
                "escaped": result.escaped,
            }
        tmp = self.output_dir / f".{TIMELINE_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.output_dir / TIMELINE_FILE)

    # -- node actions -----------------------------------------------------------------------------
    def _start(self, node: _Node) -> None:
        node.incarnation += 1
        if node.log_fh:
            node.log_fh.close()
        node.log_fh = open(node.log, "ab")  # noqa: SIM115 - closed when the node is restarted or at the end
        node.log_fh.write(f"\n==== chaos: node {node.index} start #{node.incarnation} ====\n".encode())
        node.log_fh.flush()
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        node.proc = subprocess.Popen(
            list(self.node_command(node.index)),
            stdout=node.log_fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        node.tree = ProcessTree(node.proc.pid)
        node.exit_recorded = False
        node.signalled = False
        node.stopped = False
        node.hard_kill_at = None
        self._record("start", node.index, pid=node.proc.pid, incarnation=node.incarnation)

    def _kill(self, node: _Node, why: str) -> None:
        if node.tree is None:
            return
        pids = node.tree.kill()
        node.signalled = True
        node.hard_kill_at = None
        self._record(why, node.index, pids=pids)

    def _term(self, node: _Node, notice_s: float) -> None:
        if node.tree is None:
            return
        pids = node.tree.signal(signal.SIGTERM, root_only=True)
        node.signalled = True
        node.hard_kill_at = self._now() + notice_s
        self._record("term", node.index, pids=pids, notice_s=notice_s)

    def _stop(self, node: _Node) -> None:
        if node.tree is None:
            return
        node.stopped = True
        self._record("stop", node.index, pids=node.tree.signal(signal.SIGSTOP))

    def _cont(self, node: _Node) -> None:
        if node.tree is None:
            return
        node.stopped = False
        self._record("cont", node.index, pids=node.tree.signal(signal.SIGCONT))

    def _fire(self, event: TraceEvent, index: int) -> None:
        self._last_fired = self._now()
        self._record("fired", event.node if event.node >= 0 else None, index=index, what=event.action.value)
        if event.action is Action.KILL_ALL:
            self._record("kill_all", nodes=[n.index for n in self._running()])
            for node in self._running():
                self._kill(node, "kill")
            return
        if event.action is Action.RESTART_ALL:
            self._record("restart_all", nodes=list(event.nodes))
            for i in event.nodes:
                self._fire_one(TraceEvent(event.at, Action.START, i))
            return
        self._fire_one(event)

    def _fire_one(self, event: TraceEvent) -> None:
        node = self.nodes[event.node]
        running = node.proc is not None and node.proc.poll() is None
        if running and node.signalled and node.hard_kill_at is None and node.proc is not None:
            # Killed a moment ago: give the kernel a moment to finish it before deciding.
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=5)
            self._reap()
            running = node.proc.poll() is None
        if event.action is Action.START:
            if running:
                self._record("skip", node.index, reason="start of a node that is still running", at=event.at)
            else:
                self._start(node)
        elif not running:
            self._record("skip", node.index, reason=f"{event.action.value} of a node that is down", at=event.at)
        elif event.action is Action.KILL:
            self._kill(node, "kill")
        elif event.action is Action.STOP:
            self._stop(node)
        elif event.action is Action.CONT:
            self._cont(node)
        else:
            self._term(node, event.notice_s)

    def _wait_for_host(self, node: _Node, timeout_s: float) -> None:
        while self._now() < timeout_s and node.proc is not None and node.proc.poll() is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                if s.connect_ex(("127.0.0.1", self.host_port or 0)) == 0:
                    self._record("host_ready", node.index, port=self.host_port)
                    return
            time.sleep(self.poll_s)

    def _leaving(self, index: int) -> bool:
        """The node was signalled (SIGTERM, notice running; or a kill not yet finished) and still runs."""
        node = self.nodes[index]
        return node.signalled and node.proc is not None and node.proc.poll() is None

    def _due(self, event: TraceEvent) -> bool:
        if event.at > self._now() or self._now() - self._last_fired < event.gap_s:
            return False
        # A node comes back only once it has gone: a start waits out the notice of a node still leaving.
        starting = event.nodes if event.action is Action.RESTART_ALL else (event.node,)
        if event.action in (Action.START, Action.RESTART_ALL) and any(self._leaving(i) for i in starting):
            return False
        if event.after_step is None:
            return True
        if self.progress is None:
            raise TraceError(f"an event waits for step {event.after_step}, but the harness has no progress source")
        return self.progress() >= event.after_step

    def _reap(self) -> bool:
        """Record exits; True once some node has exited with status 0 (the job finished)."""
        finished = False
        for node in self.nodes:
            if node.tree is not None:
                node.tree.refresh()
            if node.hard_kill_at is not None and self._now() >= node.hard_kill_at:
                self._kill(node, "notice_expired")
            if node.proc is not None and not node.exit_recorded and node.proc.poll() is not None:
                node.exit_recorded = True
                rc = node.proc.returncode
                self._record("exit", node.index, returncode=rc, expected=node.signalled)
                if node.tree is not None:
                    # The agent is gone; whatever it left behind dies with it, as on a real node.
                    leftover = node.tree.kill()
                    if leftover:
                        self._record("reap_workers", node.index, pids=leftover)
                node.hard_kill_at = None
                # A node that left on our SIGTERM may exit 0 too; only an undisturbed one ends the job.
                finished = finished or (rc == 0 and not node.signalled)
        return finished

    def _running(self) -> list[_Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, timeout_s: float = 600.0, stall_s: float | None = None) -> ChaosResult:
        """Follow the trace until the job finished and every node exited, or ``timeout_s`` passed,
        or (with ``stall_s`` and a progress source) the job's step did not advance for ``stall_s``
        while trace events were still waiting. Ctrl-C ends it the same way, with a result."""
        self._t0, self._wall0 = time.monotonic(), time.time()
        pending = list(self.trace.events)
        finished_at: float | None = None
        timed_out = False
        progress, progressed_at = -1, 0.0
        try:
            first, *others = self.trace.start
            self._start(self.nodes[first])
            if self.host_port is not None and others:
                self._wait_for_host(self.nodes[first], timeout_s)
            for i in others:
                self._start(self.nodes[i])
            while True:
                time.sleep(self.poll_s)
                if self._reap() and finished_at is None:
                    finished_at = self._now()
                    if pending:
                        self._record("job_finished", skipped_events=len(pending))
                    pending = []
                while pending and self._due(pending[0]):
                    self._fire(pending.pop(0), len(self.trace.events) - len(pending) - 1)
                if not self._running() and not pending:
                    self._reap()  # a node that exited after this tick's reap: its exit is recorded too
                    break
                if finished_at is not None and self._now() - finished_at > self.drain_s:
                    for node in self._running():
                        self._kill(node, "drain_timeout")
                if self._now() > timeout_s:
                    timed_out = True
                    self._record("timeout", timeout_s=timeout_s)
                    break
                if stall_s is not None and self.progress is not None and finished_at is None:
                    step = self.progress()
                    if step > progress:
                        progress, progressed_at = step, self._now()
                    elif self._now() - progressed_at > stall_s:
                        timed_out = True
                        self._record("stalled", stalled_s=round(self._now() - progressed_at, 1), at_step=step)
                        break
        except KeyboardInterrupt:
            timed_out = True
            self._record("interrupted")
        finally:
            leftover = self._cleanup()
            escaped = self._sweep()
        ok = (
            not timed_out
            and finished_at is not None
            and not any(e["action"] == "exit" and e["returncode"] != 0 and not e["expected"] for e in self.timeline)
        )
        result = ChaosResult(ok, timed_out, self._now(), self.timeline, leftover, escaped)
        self._record("end", succeeded=ok, timed_out=timed_out, leftover=len(leftover))
        self._write_timeline(result)
        return result

    def _cleanup(self) -> list[int]:
        """Kill whatever of any node is still alive; return those PIDs."""
        leftover: list[int] = []
        for node in self.nodes:
            if node.tree is None:
                continue
            pids = node.tree.kill()
            if pids:
                self._record("cleanup", node.index, pids=pids)
                leftover.extend(pids)
            if node.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(timeout=10)
            if node.log_fh:
                node.log_fh.close()
                node.log_fh = None
        return leftover

    def _sweep(self) -> list[dict[str, Any]]:
        """Find and SIGKILL whatever of this run escaped every node's tree (re-parented before it was seen)."""
        escaped = []
        for proc in tagged_processes(self.tag):
            with contextlib.suppress(psutil.Error):
                escaped.append({"pid": proc.pid, "cmdline": " ".join(proc.cmdline())[:300]})
                proc.kill()
        if escaped:
            self._record("escaped", pids=[e["pid"] for e in escaped])
        return escaped


def new_run_id() -> str:
    return "chaos-" + uuid.uuid4().hex[:8]
