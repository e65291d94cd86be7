"""One elastic run of ``ledger_job.py`` through world sizes 2 -> 1 -> 3 -> 2 with SIGKILLs between, shared
by the ledger and equivalence tests (run once per pytest session), and its uninterrupted reference."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastrain.metrics import read_events, read_metrics
from support.processes import REPO, elastrain_cmd, free_port, kill_tree, reaped, spawn, wait_for

JOB = REPO / "tests" / "workers" / "ledger_job.py"
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


def _job_args(out: Path, sleep: float, max_steps: int = MAX_STEPS) -> list[str]:
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
        str(max_steps),
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


def _ledger_job() -> Any:
    """The worker script as a module of this process (it is a script in tests/workers/, not on sys.path)."""
    spec = importlib.util.spec_from_file_location("ledger_job", JOB)
    assert spec is not None and spec.loader is not None, JOB
    module = importlib.util.module_from_spec(spec)
    sys.modules["ledger_job"] = module  # what pickle looks classes up in
    spec.loader.exec_module(module)
    return module


@functools.cache
def uninterrupted(max_steps: int = MAX_STEPS) -> ChainResult:
    """The same job, never interrupted: one process (this one, which has torch imported already)."""
    root = _scratch("elastrain-reference-")
    args = _job_args(root / "out", sleep=0.0, max_steps=max_steps)[1:]
    _ledger_job().main([*args, "--checkpoint-dir", str(root / "ckpt")])
    return ChainResult(root, [])


# --live: one job whose nodes come and go (2 -> 3 -> 2 -> 1): a joiner, a SIGKILL, a SIGTERM leave, and no
# worker restarted. Long enough that every change happens while it trains; each waits for training at the
# new size, so the changes mean the same on a fast or a slow machine.
LIVE_MAX_STEPS, LIVE_SLEEP, LIVE_STEPS_PER_SIZE = 150, 0.2, 4
LIVE_WORLD_SIZES = (2, 3, 2, 1)


@dataclass(frozen=True)
class LiveResult(ChainResult):
    codes: dict[str, int | None]
    node_logs: dict[str, str]


def steps_at(ledger: Path, world_size: int) -> int:
    """How many steps the ledger holds trained at ``world_size``."""
    if not ledger.exists():
        return 0
    return len({p.step for p in read_metrics(ledger).active if p.values.get("world_size") == world_size})


@functools.cache
def live_run() -> LiveResult:
    root = _scratch("elastrain-live-ledger-")
    out, ckpt = root / "out", root / "ckpt"
    ledger = out / "ledger.jsonl"
    port = free_port()

    def node(name: str, host: bool) -> subprocess.Popen[bytes]:
        cmd = elastrain_cmd(
            "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"live-ledger-{port}",
            "--rdzv-conf", f"is_host={str(host).lower()},last_call_timeout=1", "--max-restarts", "0",
            "--live", "true", "--checkpoint-dir", str(ckpt),
        )  # fmt: skip
        job = _job_args(out, sleep=LIVE_SLEEP, max_steps=LIVE_MAX_STEPS)
        return spawn([*cmd, *job], root / f"{name}.log")

    procs: dict[str, subprocess.Popen[bytes]] = {}

    def until(world_size: int, after: int = 0) -> None:
        def reached() -> bool:
            done = [n for n, p in procs.items() if p.poll() is not None and n in ("a",)]
            if done:
                raise AssertionError(f"node a ended before the trace did:\n{(root / 'a.log').read_text()}")
            return steps_at(ledger, world_size) >= after + LIVE_STEPS_PER_SIZE

        wait_for(reached, timeout=LAUNCH_TIMEOUT, what=f"{LIVE_STEPS_PER_SIZE} steps at world size {world_size}")

    try:
        procs["a"] = node("a", True)
        procs["b"] = node("b", False)
        until(2)
        procs["c"] = node("c", False)  # a node comes (back): it starts warm and joins without a restart
        until(3)
        at_two = steps_at(ledger, 2)
        kill_tree(procs["b"].pid)  # a node is lost without notice
        procs["b"].wait(timeout=30)
        until(2, after=at_two)
        procs["c"].send_signal(signal.SIGTERM)  # a node is taken away with notice
        for name in ("a", "c"):
            procs[name].wait(timeout=LAUNCH_TIMEOUT)
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        logs = "\n".join(f"--- {n} ---\n{(root / f'{n}.log').read_text()[-6000:]}" for n in procs)
        raise AssertionError(f"{exc}\n{logs}") from None
    finally:
        with reaped(*procs.values()):
            pass
    node_logs = {n: (root / f"{n}.log").read_text(errors="replace") for n in procs}
    codes = {n: p.returncode for n, p in procs.items()}
    return LiveResult(root, list(node_logs.values()), codes, node_logs)


def two_live_nodes(
    root: Path,
    max_steps: int,
    job: tuple[str, ...] = (),
    env_b: dict[str, str] | None = None,
    during: Callable[[dict[str, subprocess.Popen[bytes]], Path], None] | None = None,
) -> LiveResult:
    """--live, two nodes ``a`` and ``b`` (``b`` a joiner if it comes late) running the ledger job (more arguments:
    ``job``; more environment for ``b``: ``env_b``); ``during(procs, ledger)`` acts on them while they train."""
    out, ckpt = root / "out", root / "ckpt"
    port = free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, host in (("a", True), ("b", False)):
        cmd = elastrain_cmd(
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
            "--rdzv-conf", f"is_host={str(host).lower()},last_call_timeout=1", "--max-restarts", "0",
            "--live", "true", "--checkpoint-dir", str(ckpt), "--save-timeout", "60",
        )  # fmt: skip
        args = [*cmd, *_job_args(out, LIVE_SLEEP, max_steps), *job]
        procs[name] = spawn(args, root / f"{name}.log", env=env_b if name == "b" else None)
    with reaped(*procs.values()):
        try:
            if during is not None:
                during(procs, out / "ledger.jsonl")
            for proc in procs.values():
                proc.wait(timeout=LAUNCH_TIMEOUT)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            logs = "\n".join(f"--- {n} ---\n{(root / f'{n}.log').read_text()[-6000:]}" for n in procs)
            raise AssertionError(f"{exc}\n{logs}") from None
    node_logs = {n: (root / f"{n}.log").read_text(errors="replace") for n in procs}
    return LiveResult(root, list(node_logs.values()), {n: p.returncode for n, p in procs.items()}, node_logs)


def leave_during_save_run(root: Path, term_at: int, max_steps: int, async_save: bool) -> LiveResult:
    """``b``'s worker SIGTERMs its own agent at the first save step from ``term_at`` on that it trains in a world of
    two, while that step is saved (``LEDGER_TERM_AT``)."""
    job = ("--async-save", str(async_save).lower())
    return two_live_nodes(root, max_steps, job, env_b={"LEDGER_TERM_AT": str(term_at)})


@dataclass(frozen=True)
class LedgerSteps:
    """What the ledger says each completed step trained on (superseded points left out)."""

    ids: dict[int, list[int]]
    worlds: dict[int, set[int]]
    epochs: dict[int, int]


def ledger_steps(ledger: Path) -> LedgerSteps:
    ids: dict[int, list[int]] = defaultdict(list)
    worlds: dict[int, set[int]] = defaultdict(set)
    epochs: dict[int, int] = {}
    for p in read_metrics(ledger).active:
        ids[p.step].extend(p.values["ids"])
        worlds[p.step].add(p.values["world_size"])
        epochs[p.step] = p.values["epoch"]
    return LedgerSteps(dict(ids), dict(worlds), epochs)


def assert_each_sample_once_per_epoch(steps: LedgerSteps) -> None:
    """No sample twice in an epoch, every sample in every full epoch."""
    by_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for step, ids in steps.ids.items():
        by_epoch[steps.epochs[step]].update(ids)
    last = max(by_epoch)
    for epoch, counts in by_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch} repeated samples: {[i for i, c in counts.items() if c > 1]}"
        if epoch < last:
            assert sorted(counts) == list(range(SAMPLES)), f"epoch {epoch} skipped samples"


def _worlds(run: ChainResult) -> str:
    """The elastic run's starts and regroups, a line each (for a failure's message)."""
    path = run.ckpt / "events.jsonl"
    kinds = ("start", "restore", "regroup", "checkpoint", "finish")
    events = read_events(path) if path.exists() else []
    return "\n".join(json.dumps(e, sort_keys=True) for e in events if e["event"] in kinds)


def assert_matches(elastic: ChainResult, reference: ChainResult, max_steps: int) -> None:
    """The elastic run ends where the uninterrupted one ends, and every step's loss matches on the way."""
    got_end, want_end = elastic.result(), reference.result()
    assert got_end["step"] == want_end["step"] == max_steps, f"final steps: {got_end} vs {want_end}"
    # Not only the end: every step's loss matches (the steps re-run after a kill replace the cut-off ones).
    got_series = read_metrics(elastic.ckpt / "metrics.jsonl").series("loss")
    got, want = dict(got_series), dict(read_metrics(reference.ckpt / "metrics.jsonl").series("loss"))
    where = f"\nthe elastic run's worlds:\n{_worlds(elastic)}"
    assert len(got) == len(got_series), f"a step has two losses: {sorted(s for s, _ in got_series)} {where}"
    assert sorted(got) == sorted(want), (
        f"steps with a loss: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))} {where}"
    )
    differ = [(s, got[s], want[s]) for s in sorted(want) if got[s] != pytest.approx(want[s], rel=1e-4)]
    assert not differ, (
        f"the loss differs at {len(differ)} steps, first (step, elastic, uninterrupted): {differ[:5]} {where}"
    )
    assert got_end["final_loss"] == pytest.approx(want_end["final_loss"], rel=1e-4), f"{got_end} vs {want_end}"
