"""Done-when of issue 8: a T5 fine-tune with DeepSpeed ZeRO-2 on CPU survives 2 -> 1 -> 2 under elastrain-run.

Each phase is killed with SIGKILL (agent and workers) once a checkpoint is committed, and the next
phase starts at the other world size from the same checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, kill_tree, reaped, run, spawn, wait_for

from elastrain.metrics import read_metrics

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]
SCRIPT = str(REPO / "examples" / "t5" / "train_deepspeed.py")
CONFIG = str(REPO / "examples" / "t5" / "ds_zero2.json")


def cmd(nproc: int, tmp: Path) -> list[str]:
    return elastrain_cmd(
        "--standalone", f"--nproc-per-node={nproc}", f"--checkpoint-dir={tmp / 'ckpt'}", SCRIPT,
        f"--deepspeed={CONFIG}", f"--output-dir={tmp / 'out'}", "--max-steps=12", "--save-every=4",
        "--train-limit=160", "--eval-size=16", "--warmup-steps=2",
    )  # fmt: skip


def committed(tmp: Path, step: int) -> bool:
    return (tmp / "ckpt" / f"step-{step:010d}" / "elastrain-commit.json").exists()


def run_until_committed(nproc: int, tmp: Path, step: int) -> None:
    log = tmp / f"phase-{nproc}-{step}.log"
    proc = spawn(cmd(nproc, tmp), log, env={"TORCH_EXTENSIONS_DIR": str(tmp / "ext")})
    with reaped(proc):
        wait_for(lambda: committed(tmp, step) or proc.poll() is not None, timeout=240, what=f"step {step}")
        assert committed(tmp, step), log.read_text()
        kill_tree(proc.pid)  # a preemption: every process of the job dies at once


def test_t5_zero2_survives_2_1_2(tmp_path: Path) -> None:
    run_until_committed(2, tmp_path, 4)
    run_until_committed(1, tmp_path, 8)
    proc = run(cmd(2, tmp_path), timeout=240, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["step"] == 12 and summary["world_size"] == 2 and summary["restored_step"] >= 8
    assert summary["samples"] == 12 * 16  # the global batch stayed 16 at every world size
    history = read_metrics(tmp_path / "out" / "metrics.jsonl")
    series = history.series("world_size")
    assert [step for step, _ in series] == list(range(1, 13))  # one point per step, none missing
    sizes = {ws for _, ws in series}
    assert sizes == {1, 2}
    assert len(history.segments) == 3
