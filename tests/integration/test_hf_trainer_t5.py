"""Done-when of issue 8: the Trainer variant of the T5 fine-tune survives 2 -> 1 -> 2 under elastrain-run.

Each phase is killed with SIGKILL (agent and workers) once a checkpoint is committed, and the next
phase starts at the other world size from the same checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, kill_tree, reaped, run, spawn, wait_for

from elastrain.metrics import read_metrics

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "examples" / "t5" / "train_trainer.py")


def cmd(nproc: int, tmp: Path) -> list[str]:
    return elastrain_cmd(
        "--standalone", f"--nproc-per-node={nproc}", f"--checkpoint-dir={tmp / 'ckpt'}", SCRIPT,
        f"--output-dir={tmp / 'out'}", "--max-steps=12", "--save-every=4", "--global-batch-size=16",
        "--train-limit=160", "--eval-size=16", "--warmup-steps=2",
    )  # fmt: skip


def committed(tmp: Path, step: int) -> bool:
    return (tmp / "ckpt" / f"checkpoint-{step}" / "elastrain-commit.json").exists()


def run_until_committed(nproc: int, tmp: Path, step: int) -> None:
    log = tmp / f"phase-{nproc}-{step}.log"
    proc = spawn(cmd(nproc, tmp), log)
    with reaped(proc):
        wait_for(lambda: committed(tmp, step) or proc.poll() is not None, timeout=240, what=f"step {step}")
        assert committed(tmp, step), log.read_text()
        kill_tree(proc.pid)  # a preemption: every process of the job dies at once


def test_t5_trainer_survives_2_1_2(tmp_path: Path) -> None:
    run_until_committed(2, tmp_path, 4)
    run_until_committed(1, tmp_path, 8)
    proc = run(cmd(2, tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["step"] == 12 and summary["world_size"] == 2 and summary["restored_step"] >= 8
    # The Trainer's logs (every 10 steps) continue on the global step: step 10 logged once, by phase 3.
    history = read_metrics(tmp_path / "ckpt" / "metrics.jsonl")
    assert [step for step, _ in history.series("loss")] == [10]
    assert len(history.segments) == 3
    state = json.loads((tmp_path / "ckpt" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [10]
