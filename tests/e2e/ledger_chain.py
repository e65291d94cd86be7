"""One elastic run of ``ledger_job.py`` through world sizes 2 -> 1 -> 3 -> 2 with SIGKILLs between, shared
by the ledger and equivalence tests (run once per pytest session), and its uninterrupted reference."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import REPO, elastrain_cmd, kill_tree, reaped, spawn, wait_for

from elastrain.metrics import read_metrics

JOB = REPO / "tests" / "e2e" / "ledger_job.py"
SAMPLES, GLOBAL_BATCH, MICRO_BATCH, MAX_STEPS, SAVE_EVERY = 60, 8, 2, 30, 4
WORLD_SIZES = (2, 1, 3, 2)
# Each killed start runs at least this many steps past the step it restored, so it crosses a checkpoint.
STEPS_BEFORE_KILL = SAVE_EVERY + 2
LAUNCH_TIMEOUT = 150.0


@dataclass(frozen=True)
class ChainResult:
    root: Path
    logs: list[str]

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / "result.json").read_text())
        return data


def _job_args(out: Path, sleep: float) -> list[str]:
    return [
        str(JOB),
        "--out",
        str(out),
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--micro-batch",
        str(MICRO_BATCH),
        "--max-steps",
        str(MAX_STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--sleep",
        str(sleep),
    ]


def _segment_progress(ledger: Path, segment_index: int) -> tuple[int, int] | None:
    """(restored step, highest step logged) of the ``segment_index``-th start, once it has begun."""
    h = read_metrics(ledger)
    if len(h.segments) <= segment_index:
        return None
    seg = h.segments[segment_index]
    if seg not in h.restored_steps:
        return None
    steps = [p.step for p in h.active + h.superseded if p.segment == seg]
    return h.restored_steps[seg], max(steps, default=h.restored_steps[seg])


def _wait_then_kill(proc: subprocess.Popen[bytes], log: Path, ledger: Path, index: int) -> None:
    """Let the ``index``-th start train past a checkpoint, then SIGKILL its agent and workers: a lost node."""

    def far_enough() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"launch {index} exited early:\n{log.read_text()}")
        progress = _segment_progress(ledger, index)
        return progress is not None and progress[1] >= progress[0] + STEPS_BEFORE_KILL

    wait_for(far_enough, timeout=LAUNCH_TIMEOUT, what=f"launch {index} to train")
    kill_tree(proc.pid)
    proc.wait(timeout=30)


def _scratch(prefix: str) -> Path:
    """A directory removed when the test process exits (both tests read it, so not a per-test tmp_path)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def elastic_chain() -> ChainResult:
    root = _scratch("elastrain-ledger-")
    out, ckpt = root / "out", root / "ckpt"
    logs: list[str] = []
    for i, world in enumerate(WORLD_SIZES):
        log = root / f"launch-{i}-w{world}.log"
        cmd = elastrain_cmd("--standalone", "--nproc-per-node", str(world), "--checkpoint-dir", str(ckpt))
        proc = spawn([*cmd, *_job_args(out, sleep=0.15)], log)
        with reaped(proc):
            last = i == len(WORLD_SIZES) - 1
            if last:
                proc.wait(timeout=LAUNCH_TIMEOUT)
            else:
                _wait_then_kill(proc, log, out / "ledger.jsonl", i)
        logs.append(log.read_text())
        if last and proc.returncode != 0:
            raise AssertionError(f"the final launch failed ({proc.returncode}):\n{logs[-1]}")
    return ChainResult(root, logs)


@functools.cache
def uninterrupted() -> ChainResult:
    """The same job, never interrupted: one process (this one, which has torch imported already)."""
    import ledger_job

    root = _scratch("elastrain-reference-")
    ledger_job.main([*_job_args(root / "out", sleep=0.0)[1:], "--checkpoint-dir", str(root / "ckpt")])
    return ChainResult(root, [])
