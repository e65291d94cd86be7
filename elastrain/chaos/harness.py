"""Run a training job as N local nodes and follow a preemption trace; record what happened when.

Each node is one launcher process (by default ``python -m elastrain --nnodes 1:N --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT ... script args``) in its own session, with its
output in ``OUTPUT_DIR/node-<i>.log``. The harness fires the trace's events at their times, notices
when nodes exit, and ends when the job has finished (a node exited with status 0), when every node
is down with nothing left to start, or at the timeout. Whatever is still running at the end is
killed, agents and workers alike, and ``timeline.json`` says what was done and when.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from elastrain.chaos.nodes import Nodes
from elastrain.chaos.procs import TAG_VARIABLE
from elastrain.chaos.timeline import TIMELINE_FILE, ChaosResult, Timeline
from elastrain.chaos.trace import Action, Trace, TraceEvent
from elastrain.errors import TraceError

CRASH_WAIT_S = 60.0
"""How long a crash waits for its node's workers to start (a node started a moment ago) before it is skipped."""

__all__ = ["TIMELINE_FILE", "ChaosHarness", "ChaosResult", "elastrain_node_command", "new_run_id"]


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


class ChaosHarness:
    """Follows a trace over the run's :class:`Nodes`: fires each event when it is due, and records on the
    run's :class:`Timeline`."""

    def __init__(
        self,
        trace: Trace,
        node_command: Callable[[int], Sequence[str]],
        output_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        poll_s: float = 0.1,
        crash_wait_s: float = CRASH_WAIT_S,
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
        self.crash_wait_s = crash_wait_s
        self.drain_s = drain_s
        self.progress = progress
        self.host_port = host_port
        if progress is None and any(e.after_step is not None for e in trace.events):
            raise TraceError("the trace has after_step events: give the harness a progress source (--progress-file)")
        self.timeline = Timeline(trace, node_command, self.output_dir, progress)
        self.nodes = Nodes(trace.nodes, node_command, self.output_dir, self.env, self.tag, self.timeline)
        self._last_fired = 0.0
        self._crash_due_since: dict[int, float] = {}  # id of a crash event -> when it first waited for workers

    # -- the trace's events -----------------------------------------------------------------------
    def _fire(self, event: TraceEvent, index: int) -> None:
        self._last_fired = self.timeline.now()
        self.timeline.record("fired", event.node if event.node >= 0 else None, index=index, what=event.action.value)
        if event.action is Action.KILL_ALL:
            self.timeline.record("kill_all", nodes=[n.index for n in self.nodes.running()])
            for node in self.nodes.running():
                self.nodes.kill(node, "kill")
            return
        if event.action is Action.RESTART_ALL:
            self.timeline.record("restart_all", nodes=list(event.nodes))
            for i in event.nodes:
                self._fire_one(TraceEvent(event.at, Action.START, i))
            return
        self._fire_one(event)

    def _fire_one(self, event: TraceEvent) -> None:
        node = self.nodes[event.node]
        running = self.nodes.settled_running(node)
        if event.action is Action.START:
            if running:
                self.timeline.record("skip", node.index, reason="start of a node that is still running", at=event.at)
            else:
                self.nodes.start(node)
        elif not running:
            self.timeline.record("skip", node.index, reason=f"{event.action.value} of a node that is down", at=event.at)
        elif event.action is Action.KILL:
            self.nodes.kill(node, "kill")
        elif event.action is Action.STOP:
            self.nodes.stop(node)
        elif event.action is Action.CONT:
            self.nodes.cont(node)
        elif event.action is Action.CRASH:
            self.nodes.crash(node)
        else:
            self.nodes.term(node, event.notice_s, event.whole)

    def _due(self, event: TraceEvent) -> bool:
        if event.at > self.timeline.now() or self.timeline.now() - self._last_fired < event.gap_s:
            return False
        # A node comes back only once it has gone: a start waits out the notice of a node still leaving.
        starting = event.nodes if event.action is Action.RESTART_ALL else (event.node,)
        if event.action in (Action.START, Action.RESTART_ALL) and any(self.nodes.leaving(i) for i in starting):
            return False
        if self._crash_waits(event):
            return False
        if event.after_step is None:
            return True
        if self.progress is None:
            raise TraceError(f"an event waits for step {event.after_step}, but the harness has no progress source")
        return self.progress() >= event.after_step

    def _crash_waits(self, event: TraceEvent) -> bool:
        """A crash waits (up to ``crash_wait_s`` from when it was first due) for its node's workers: a node started a
        moment ago may not have started them yet."""
        if event.action is not Action.CRASH:
            return False
        node = self.nodes[event.node]
        since = self._crash_due_since.setdefault(id(event), self.timeline.now())
        if self.timeline.now() - since > self.crash_wait_s or not self.nodes.settled_running(node):
            return False
        return not self.nodes.workers_running(node)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, timeout_s: float = 600.0, stall_s: float | None = None) -> ChaosResult:
        """Follow the trace until the job finished and every node exited, or ``timeout_s`` passed,
        or (with ``stall_s`` and a progress source) the job's step did not advance for ``stall_s``
        while trace events were still waiting. Ctrl-C ends it the same way, with a result."""
        self.timeline.start()
        pending = list(self.trace.events)
        finished_at: float | None = None
        timed_out = False
        progress, progressed_at = -1, 0.0
        try:
            first, *others = self.trace.start
            self.nodes.start(self.nodes[first])
            if self.host_port is not None and others:
                self.nodes.wait_for_host(self.nodes[first], self.host_port, timeout_s, self.poll_s)
            for i in others:
                self.nodes.start(self.nodes[i])
            while True:
                time.sleep(self.poll_s)
                if self.nodes.reap() and finished_at is None:
                    finished_at = self.timeline.now()
                    if pending:
                        self.timeline.record("job_finished", skipped_events=len(pending))
                    pending = []
                while pending and self._due(pending[0]):
                    self._fire(pending.pop(0), len(self.trace.events) - len(pending) - 1)
                if not self.nodes.running() and not pending:
                    self.nodes.reap()  # a node that exited after this tick's reap: its exit is recorded too
                    break
                if finished_at is not None and self.timeline.now() - finished_at > self.drain_s:
                    for node in self.nodes.running():
                        self.nodes.kill(node, "drain_timeout")
                if self.timeline.now() > timeout_s:
                    timed_out = True
                    self.timeline.record("timeout", timeout_s=timeout_s)
                    break
                if stall_s is not None and self.progress is not None and finished_at is None:
                    step = self.progress()
                    if step > progress:
                        progress, progressed_at = step, self.timeline.now()
                    elif self.timeline.now() - progressed_at > stall_s:
                        timed_out = True
                        self.timeline.record(
                            "stalled", stalled_s=round(self.timeline.now() - progressed_at, 1), at_step=step
                        )
                        break
        except KeyboardInterrupt:
            timed_out = True
            self.timeline.record("interrupted")
        finally:
            leftover = self.nodes.cleanup()
            escaped = self.nodes.sweep()
        ok = (
            not timed_out
            and finished_at is not None
            and not any(
                e["action"] == "exit" and e["returncode"] != 0 and not e["expected"] for e in self.timeline.events
            )
        )
        result = ChaosResult(ok, timed_out, self.timeline.now(), self.timeline.events, leftover, escaped)
        self.timeline.record("end", succeeded=ok, timed_out=timed_out, leftover=len(leftover))
        self.timeline.write(result)
        return result


def new_run_id() -> str:
    return "chaos-" + uuid.uuid4().hex[:8]
