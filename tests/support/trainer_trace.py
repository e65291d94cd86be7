"""Hugging Face Trainer scripts (examples/hf), unmodified, under elastrain-run through a preemption trace.

:func:`make_assets` builds tiny models and data once per session (local files only). :func:`reference` runs a
script uninterrupted on one node (:class:`References`: each once per session); :func:`trace` runs it as local
nodes (separate ``elastrain-run`` agents on 127.0.0.1, elastrain-run's defaults but for ``--checkpoint-dir``) and
plays :class:`Event` s, each when the job has reached a step (read from the sample ledger,
``bench/support/hf/ledger.py``) with the world size it names. ``bench.support.trainer_ledger.Ledger`` reads what
every step trained on, in which world, and how many steps ran twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.support.trainer_ledger import WRITER_DIR, Ledger
from elastrain.chaos.analysis import last_workers_started
from support.processes import (
    PYTHON,
    REPO,
    elastrain_cmd,
    events_in,
    free_port,
    kill_tree,
    reaped,
    run,
    spawn,
    wait_logged,
)

SCRIPTS = REPO / "examples" / "hf"
LEDGER = WRITER_DIR  # the sample ledger module, imported by the scripts when LEDGER_DIR is set
COMMON = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0", "--do_train"]


def make_assets(out: Path) -> Path:
    """The models and data of examples/hf/make_assets.py in ``out``, made once (test processes that share ``out``
    wait for the first)."""
    with locked(out.parent / f"{out.name}.lock"):
        done = out / "done"
        if not done.exists():
            proc = run([PYTHON, str(SCRIPTS / "make_assets.py"), str(out)], timeout=240)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done.write_text("ok")
    return out


@dataclass(frozen=True)
class Workload:
    """A script and its arguments (the output dir is added per run)."""

    script: str
    args: tuple[str, ...]
    max_steps: int


def causal_lm(assets: Path, max_steps: int = 200) -> Workload:
    return Workload(
        "run_clm.py",
        (
            "--model_name_or_path", str(assets / "gpt2"), "--train_file", str(assets / "text" / "train.txt"),
            "--block_size", "32", "--per_device_train_batch_size", "4", "--learning_rate", "2e-3",
            "--save_steps", "40", "--logging_steps", "10", "--max_steps", str(max_steps),
        ),
        max_steps,
    )  # fmt: skip


def causal_lm_streaming(assets: Path, max_steps: int = 240) -> Workload:
    """run_clm.py with ``--streaming``: an iterable training set, read as the files train (the ledger notes its
    samples by content). 240 steps of 8 blocks (1920) read past the end of the first pass (~1700 blocks)."""
    w = causal_lm(assets, max_steps)
    return Workload(w.script, (*w.args, "--streaming"), max_steps)


def seq2seq(assets: Path, max_steps: int = 160) -> Workload:
    return Workload(
        "run_summarization.py",
        (
            "--model_name_or_path", str(assets / "t5"), "--train_file", str(assets / "pairs" / "train.json"),
            "--validation_file", str(assets / "pairs" / "validation.json"), "--do_eval", "--predict_with_generate",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16", "--learning_rate", "3e-3",
            "--save_steps", "40", "--logging_steps", "10", "--max_steps", str(max_steps),
        ),
        max_steps,
    )  # fmt: skip


def classification(assets: Path, max_steps: int = 160) -> Workload:
    return Workload(
        "run_classification.py",
        (
            "--model_name_or_path", str(assets / "bert"), "--train_file", str(assets / "labels" / "train.json"),
            "--validation_file", str(assets / "labels" / "validation.json"), "--do_eval",
            "--per_device_train_batch_size", "8", "--learning_rate", "3e-4",
            "--save_steps", "40", "--logging_steps", "10", "--max_steps", str(max_steps),
        ),
        max_steps,
    )  # fmt: skip


def sft_lora(assets: Path, max_steps: int = 200) -> Workload:
    """TRL's SFTTrainer (a Trainer subclass with its own loss) on prompt-completion pairs, the loss on completions,
    training LoRA adapters (peft) on the frozen GPT-2: its checkpoints hold the adapters only."""
    return Workload(
        "run_sft.py",
        (
            "--model_name_or_path", str(assets / "gpt2"), "--dataset_name", str(assets / "sft"),
            "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
            "--max_length", "64", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--bf16", "false",
            "--save_steps", "40", "--logging_steps", "10", "--max_steps", str(max_steps),
        ),
        max_steps,
    )  # fmt: skip


def dpo(assets: Path, max_steps: int = 200) -> Workload:
    """TRL's DPOTrainer (a Trainer subclass with its own loss, and a frozen reference copy of the model that every
    worker builds itself) on chosen and rejected completions, training the whole GPT-2."""
    return Workload(
        "run_dpo.py",
        (
            "--model_name_or_path", str(assets / "gpt2"), "--dataset_name", str(assets / "prefs"),
            "--max_length", "64", "--per_device_train_batch_size", "4", "--learning_rate", "1e-4", "--bf16", "false",
            "--save_steps", "40", "--logging_steps", "10", "--max_steps", str(max_steps),
        ),
        max_steps,
    )  # fmt: skip


@dataclass(frozen=True)
class Event:
    """At step ``at`` (once the job trains ``world`` ranks), do ``action`` to node ``node``. ``wait`` does nothing
    but waits until the job trains ``world`` ranks again, after some step trained another number or in another
    round."""

    action: str  # "kill" (SIGKILL the node: agent and workers), "crash" (SIGKILL its workers only), "term" (SIGTERM
    # its agent), "term-node" (SIGTERM every process of the node, as a VM's or Slurm's shutdown), "start", "wait"
    node: str
    at: int = 0
    world: int | None = None
    local_rank: int | None = None  # "crash": only this local rank's worker (None: every one)


@dataclass
class Run:
    out: Path
    logs: dict[str, str]
    codes: dict[str, int]
    ledger: Ledger
    wall_s: float
    events: list[str] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """The Trainer's state at the end: what the script saved (``trainer.save_state()``), else its last
        checkpoint's (TRL's sft.py saves no state of its own)."""
        model = self.out / "model"
        saved = model / "trainer_state.json"
        if not saved.exists():
            saved = max(model.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
        data: dict[str, Any] = json.loads(saved.read_text())
        return data

    def losses(self) -> dict[int, float]:
        return {int(h["step"]): float(h["loss"]) for h in self.state()["log_history"] if "loss" in h}

    def dump(self) -> str:
        return "\n".join(f"--- {n} ---\n{digest(log)}" for n, log in self.logs.items())


def _command(w: Workload, out: Path, port: int, rdzv_id: str, nnodes: str, extra: tuple[str, ...]) -> list[str]:
    return elastrain_cmd(
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
        "--checkpoint-dir", str(out / "ckpt"), *extra,
        str(SCRIPTS / w.script), *w.args, "--output_dir", str(out / "model"), *COMMON,
    )  # fmt: skip


def reference(w: Workload, out: Path, nproc: int = 2, timeout: float = 300.0) -> Run:
    """The workload uninterrupted: one node of ``nproc`` workers (the trace's first world size, whose global
    batch every later world keeps)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger").mkdir(exist_ok=True)
    started = time.monotonic()
    cmd = elastrain_cmd("--standalone", "--nproc-per-node", str(nproc), "--checkpoint-dir", str(out / "ckpt"))
    cmd += [str(SCRIPTS / w.script), *w.args, "--output_dir", str(out / "model"), *COMMON]
    proc = run(cmd, timeout=timeout, env={"LEDGER_DIR": str(out / "ledger"), "PYTHONPATH": str(LEDGER)}, cwd=out)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return Run(out, {"ref": proc.stderr}, {"ref": 0}, Ledger.read(out / "ledger"), time.monotonic() - started)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), held by this process until the block ends: the test processes of
    one session (pytest-xdist's workers) build what they share once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class References:
    """The uninterrupted runs of one test session, each run once under ``root`` and shared by every test (and
    every test process) that compares a trace with it: the same script, arguments and world size train the same
    samples to the same losses (seeded, on CPU)."""

    root: Path

    def get(self, w: Workload, nproc: int = 2) -> Run:
        key = hashlib.sha256(json.dumps([w.script, list(w.args), w.max_steps, nproc]).encode()).hexdigest()[:16]
        out = self.root / key
        with locked(self.root / f"{key}.lock"):
            if not (out / "done").exists():
                shutil.rmtree(out, ignore_errors=True)
                ran = reference(w, out, nproc)
                (out / "ref.log").write_text(ran.logs["ref"])
                (out / "done").write_text(f"{ran.wall_s:.3f}")
        log = (out / "ref.log").read_text()
        return Run(out, {"ref": log}, {"ref": 0}, Ledger.read(out / "ledger"), float((out / "done").read_text()))


TRACE_BUDGET_S = 840.0
"""The longest one trace runs, all its waits together; it then fails with every node's log."""
TEST_TIMEOUT_S = TRACE_BUDGET_S + 60.0
"""pytest's timeout for a test that plays a trace (its module's mark): past the trace's own, which dumps the logs."""

HOLD_STEPS, HOLD_S = 8, 8.0
"""While a node started by an event warms up to join, the job's last ``HOLD_STEPS`` steps take ``HOLD_S`` seconds
each: on a loaded machine (CI runs two test processes, each with its nodes) a node's start (torch, transformers,
the model, its first evaluation) outlasted the steps paced at ``pace[1]``, and the job ended before it joined."""


def trace(
    w: Workload,
    out: Path,
    events: list[Event],
    first: tuple[str, ...] = ("a", "b"),
    nnodes: str = "1:2",
    extra: tuple[str, ...] = (),
    timeout: float = 420.0,
    pace: tuple[float, float] = (0.03, 0.4),
    env: dict[str, str] | None = None,
) -> Run:
    """The workload as local nodes, ``first`` started at once, through ``events`` in order. Until the last event
    has played, each step also sleeps (the tests' ledger does) ``pace[0]`` seconds, and ``pace[1]`` while a node
    started by an event warms up to join (until its agent is in a round, or the next event plays): the job outlasts
    the trace whatever the machine's speed. ``env``: more environment for every node (the ledger's own instruments:
    ``LEDGER_KILL``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger").mkdir(exist_ok=True)
    port, rdzv_id = free_port(), f"hf-{random.randrange(1 << 30)}"
    env = {"LEDGER_DIR": str(out / "ledger"), "PYTHONPATH": str(LEDGER), **(env or {})}
    pace_file = out / "ledger" / "pace"
    pace_file.write_text(f"{pace[0]:g}")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    started = time.monotonic()
    done: list[str] = []
    warming: Path | None = None  # the log of the node started last, while the steps wait for it

    def start(name: str) -> Path:
        """Start node ``name`` (again); its log."""
        n = sum(1 for k in logs if k.startswith(name))
        key = name if n == 0 else f"{name}{n + 1}"
        logs[key] = out / f"{key}.log"
        procs[name] = spawn(_command(w, out, port, rdzv_id, nnodes, extra), logs[key], env=env, cwd=out)
        return logs[key]

    for name in first:
        start(name)
    every = list(procs.values())
    with reaped(*every):
        for ev in events:
            deadline = min(time.monotonic() + timeout, started + TRACE_BUDGET_S)
            changed = ev.action != "wait"
            round_before = Ledger.read(out / "ledger").round_now()
            while True:
                ledger = Ledger.read(out / "ledger")
                now = ledger.world_now()
                # Another world trained since the event began: of another size, or the same size in a new round
                # (a restart that the returning node joined before a step trained without it).
                changed = changed or (ev.world is not None and now != ev.world) or ledger.round_now() != round_before
                if ledger.last_step() >= ev.at and changed and (ev.world is None or now == ev.world):
                    pace_file.write_text(f"{pace[0]:g}")
                    warming = None
                    break
                if warming is not None and events_in(warming.read_text(errors="replace"), "rendezvous_done"):
                    pace_file.write_text(f"{pace[0]:g}")  # it is in a round: the steps to the next event go fast
                    warming = None
                elif warming is not None and w.max_steps - ledger.last_step() <= HOLD_STEPS:
                    pace_file.write_text(f"{max(pace[1], HOLD_S):g}")  # a loaded box: the last steps wait for it
                if ledger.last_step() >= w.max_steps or time.monotonic() > deadline:
                    raise AssertionError(f"the job never reached {ev} (at step {ledger.last_step()})\n" + _dump(logs))
                time.sleep(0.05)
            if ev.action == "start":
                warming = start(ev.node)
                every.append(procs[ev.node])
                pace_file.write_text(f"{pace[1]:g}")  # few steps pass while it warms up
            elif ev.action == "kill":
                kill_tree(procs[ev.node].pid, signal.SIGKILL)
            elif ev.action == "crash":
                pids = _worker_pids(logs[max(k for k in logs if k.rstrip("0123456789") == ev.node)])
                for pid in pids if ev.local_rank is None else pids[ev.local_rank : ev.local_rank + 1]:
                    kill_tree(pid, signal.SIGKILL)
            elif ev.action == "term":
                procs[ev.node].send_signal(signal.SIGTERM)
            elif ev.action == "term-node":
                kill_tree(procs[ev.node].pid, signal.SIGTERM)
            elif ev.action != "wait":
                raise ValueError(ev.action)
            done.append(f"{ev.action} {ev.node} at step {Ledger.read(out / 'ledger').last_step()}")
        pace_file.unlink()
        left = min(timeout, started + TRACE_BUDGET_S - time.monotonic())
        codes = wait_logged([(p, logs[k]) for k, p in _by_log(procs, logs).items()], max(1.0, left))
    texts = {k: p.read_text(errors="replace") for k, p in logs.items()}
    keys = list(_by_log(procs, logs))
    return Run(out, texts, dict(zip(keys, codes, strict=True)), Ledger.read(out / "ledger"),
               time.monotonic() - started, done)  # fmt: skip


def _worker_pids(log: Path) -> list[int]:
    """The workers a node's agent started last (its ``workers_started`` line)."""
    pids = last_workers_started(log.read_text(errors="replace"))
    if not pids:
        raise AssertionError(f"{log.name}: no workers started yet")
    return pids


def _by_log(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> dict[str, subprocess.Popen[bytes]]:
    """The last process of each node name, keyed by its log's name (earlier ones were killed)."""
    latest = {}
    for key in logs:
        name = key.rstrip("0123456789") or key
        latest[name] = key
    return {latest[name]: proc for name, proc in procs.items()}


def _dump(logs: dict[str, Path]) -> str:
    return "\n".join(f"--- {k} ---\n{digest(p.read_text(errors='replace'))}" for k, p in logs.items() if p.exists())


_ERROR_MARKS = ("Error", "Traceback", "terminate called", "what():", "enforce fail", "Fatal Python", "exitcode")
"""What a line names when a process failed: a Python exception, or a C++ one that aborted it (a gloo I/O thread's)."""


def digest(log: str, tail: int = 4000) -> str:
    """What a failure message shows of a node's log: every lifecycle line (the node's story, which CI keeps only in
    the message), the lines that name an error (a worker's traceback long before the tail), then the log's tail."""
    lines = log.splitlines()
    events = [line[:300] for line in lines if line.startswith("elastrain event=")]
    errors = [line[:300] for line in lines if any(mark in line for mark in _ERROR_MARKS)][:80]
    return "\n".join(["[events]", *events, "[errors]", *errors, "[tail]", log[-tail:]])
