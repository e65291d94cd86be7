"""The chaos run's local nodes as processes: each started in its own session with its output appended to
``OUTPUT_DIR/node-<i>.log``, signalled (SIGKILL, SIGTERM with a notice, SIGSTOP, SIGCONT; SIGKILL of one worker),
reaped when it exits, and killed with whatever it left behind at the end. Every action is recorded on the run's
:class:`Timeline`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from elastrain.chaos.analysis import last_workers_started
from elastrain.chaos.procs import ProcessTree, tagged_processes
from elastrain.chaos.timeline import Timeline


@dataclass
class Node:
    """One node: its log, and its current incarnation's launcher process and process tree."""

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


class Nodes:
    """Every node of the run, started with ``node_command(i)`` in ``env``; ``tag`` finds the processes that escaped."""

    def __init__(
        self,
        count: int,
        node_command: Callable[[int], Sequence[str]],
        output_dir: Path,
        env: Mapping[str, str],
        tag: str,
        timeline: Timeline,
    ) -> None:
        self.node_command = node_command
        self.env = env
        self.tag = tag
        self.timeline = timeline
        self.all = [Node(i, output_dir / f"node-{i}.log") for i in range(count)]
        self._crashes: dict[int, int] = {}  # node -> its crashes so far (each takes the next local rank)

    def __getitem__(self, index: int) -> Node:
        return self.all[index]

    # -- actions ----------------------------------------------------------------------------------
    def start(self, node: Node) -> None:
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
        self.timeline.record("start", node.index, pid=node.proc.pid, incarnation=node.incarnation)

    def kill(self, node: Node, why: str) -> None:
        if node.tree is None:
            return
        pids = node.tree.kill()
        node.signalled = True
        node.hard_kill_at = None
        self.timeline.record(why, node.index, pids=pids)

    def term(self, node: Node, notice_s: float, whole: bool = False) -> None:
        """SIGTERM the node's agent (``whole``: every process of the node), then SIGKILL what is left later."""
        if node.tree is None:
            return
        pids = node.tree.signal(signal.SIGTERM, root_only=not whole)
        node.signalled = True
        node.hard_kill_at = self.timeline.now() + notice_s
        self.timeline.record("term", node.index, pids=pids, notice_s=notice_s, whole=whole)

    def stop(self, node: Node) -> None:
        if node.tree is None:
            return
        node.stopped = True
        self.timeline.record("stop", node.index, pids=node.tree.signal(signal.SIGSTOP))

    def cont(self, node: Node) -> None:
        if node.tree is None:
            return
        node.stopped = False
        self.timeline.record("cont", node.index, pids=node.tree.signal(signal.SIGCONT))

    def crash(self, node: Node) -> None:
        """SIGKILL one of the workers the node's agent started last (each crash takes the next local rank): the
        agent lives. A node with no worker running (a spare, or one still joining) is skipped, with the reason."""
        workers = self.workers_running(node)
        if not workers:
            self.timeline.record("skip", node.index, reason="crash of a node with no worker running (a spare?)")
            return
        done = self._crashes.get(node.index, 0)
        pid = workers[done % len(workers)]
        self._crashes[node.index] = done + 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.timeline.record("crash", node.index, pid=pid, workers=workers)

    def workers_running(self, node: Node) -> list[int]:
        """The PIDs of the workers the node's agent started last that are alive (none yet, or none left: empty)."""
        if node.tree is None:
            return []
        node.tree.refresh()  # workers started since the last reap are in the tree too
        alive = set(node.tree.alive())
        return [p for p in self._workers_started(node) if p in alive]

    def _workers_started(self, node: Node) -> list[int]:
        """The PIDs of the node's current incarnation's last ``workers_started`` line (none yet: empty)."""
        marker = f"==== chaos: node {node.index} start #{node.incarnation} ===="
        try:
            text = node.log.read_text(errors="replace")
        except OSError:
            return []
        return last_workers_started(text[text.rfind(marker) :])

    def wait_for_host(self, node: Node, port: int, timeout_s: float, poll_s: float) -> None:
        """Wait until ``node`` listens on ``port`` on 127.0.0.1, it exits, or the run's clock passes ``timeout_s``."""
        while self.timeline.now() < timeout_s and node.proc is not None and node.proc.poll() is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    self.timeline.record("host_ready", node.index, port=port)
                    return
            time.sleep(poll_s)

    # -- state ------------------------------------------------------------------------------------
    def settled_running(self, node: Node) -> bool:
        """Whether the node runs; one killed a moment ago is first given a moment to finish (its exit recorded)."""
        running = node.proc is not None and node.proc.poll() is None
        if running and node.signalled and node.hard_kill_at is None and node.proc is not None:
            # Killed a moment ago: give the kernel a moment to finish it before deciding.
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=5)
            self.reap()
            running = node.proc.poll() is None
        return running

    def leaving(self, index: int) -> bool:
        """The node was signalled (SIGTERM, notice running; or a kill not yet finished) and still runs."""
        node = self.all[index]
        return node.signalled and node.proc is not None and node.proc.poll() is None

    def reap(self) -> bool:
        """Record exits; True once some node has exited with status 0 (the job finished)."""
        finished = False
        for node in self.all:
            if node.tree is not None:
                node.tree.refresh()
            if node.hard_kill_at is not None and self.timeline.now() >= node.hard_kill_at:
                self.kill(node, "notice_expired")
            if node.proc is not None and not node.exit_recorded and node.proc.poll() is not None:
                node.exit_recorded = True
                rc = node.proc.returncode
                self.timeline.record("exit", node.index, returncode=rc, expected=node.signalled)
                if node.tree is not None:
                    # The agent is gone; whatever it left behind dies with it, as on a real node.
                    leftover = node.tree.kill()
                    if leftover:
                        self.timeline.record("reap_workers", node.index, pids=leftover)
                node.hard_kill_at = None
                # A node that left on our SIGTERM may exit 0 too; only an undisturbed one ends the job.
                finished = finished or (rc == 0 and not node.signalled)
        return finished

    def running(self) -> list[Node]:
        return [n for n in self.all if n.proc is not None and n.proc.poll() is None]

    # -- the end ----------------------------------------------------------------------------------
    def cleanup(self) -> list[int]:
        """Kill whatever of any node is still alive; return those PIDs."""
        leftover: list[int] = []
        for node in self.all:
            if node.tree is None:
                continue
            pids = node.tree.kill()
            if pids:
                self.timeline.record("cleanup", node.index, pids=pids)
                leftover.extend(pids)
            if node.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(timeout=10)
            if node.log_fh:
                node.log_fh.close()
                node.log_fh = None
        return leftover

    def sweep(self) -> list[dict[str, Any]]:
        """Find and SIGKILL whatever of this run escaped every node's tree (re-parented before it was seen)."""
        escaped = []
        for proc in tagged_processes(self.tag):
            with contextlib.suppress(psutil.Error):
                escaped.append({"pid": proc.pid, "cmdline": " ".join(proc.cmdline())[:300]})
                proc.kill()
        if escaped:
            self.timeline.record("escaped", pids=[e["pid"] for e in escaped])
        return escaped
