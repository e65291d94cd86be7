"""A Hugging Face Trainer through world sizes 2 -> 3 under elastrain-run: exact sample ledger, continuous steps.

(2 -> 1 -> 2 with SIGKILLs is covered by the T5 Trainer test in test_hf_trainer_t5.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.processes import REPO, elastrain_cmd, run

from elastrain.data import epoch_order
from elastrain.log import parse_event_line
from elastrain.metrics import read_metrics

pytest.importorskip("accelerate")
WORKER = str(REPO / "tests" / "workers" / "hf_trainer_worker.py")
pytestmark = pytest.mark.slow
GLOBAL_BATCH, N, SEED = 12, 50, 3  # as in the worker


def launch(nproc: int, ckpt: Path, ledger: Path, max_steps: int) -> str:
    cmd = elastrain_cmd(
        "--standalone", f"--nproc-per-node={nproc}", f"--checkpoint-dir={ckpt}", WORKER,
        f"--ledger={ledger}", f"--max-steps={max_steps}",
    )  # fmt: skip
    proc = run(cmd, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def restored(out: str) -> dict[str, str]:
    parsed = (parse_event_line(line) for line in out.splitlines())
    return next(e for e in parsed if e is not None and e.get("event") == "checkpoint_restored")


def test_trainer_keeps_the_sample_ledger_and_the_step_count_through_world_size_changes(tmp_path: Path) -> None:
    ckpt, ledger = tmp_path / "out", tmp_path / "ledger.jsonl"
    launch(2, ckpt, ledger, max_steps=4)
    out = launch(3, ckpt, ledger, max_steps=9)  # 12 samples as 3 ranks x 2 micro-batches of 2
    assert restored(out)["step"] == "4" and restored(out)["world_size"] == "2->3"

    rows: list[dict[str, Any]] = [json.loads(line) for line in ledger.read_text().splitlines()]
    by_step: dict[int, list[int]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).extend(r["ids"])
    # Steps continue 1..9 with no repeat, and step s used exactly stream positions [(s-1)G, sG):
    # the same samples an uninterrupted run at any world size would use (epochs cross at 50).
    assert sorted(by_step) == list(range(1, 10))
    stream = [int(epoch_order(N, SEED, p // N)[p % N]) for p in range(9 * GLOBAL_BATCH)]
    for step, ids in by_step.items():
        assert sorted(ids) == sorted(stream[(step - 1) * GLOBAL_BATCH : step * GLOBAL_BATCH]), step
    assert {r["world_size"] for r in rows if r["step"] <= 4} == {2}
    assert {r["world_size"] for r in rows if r["step"] >= 5} == {3}
    # The Trainer's epoch is the true dataset epoch.
    assert next(r["epoch"] for r in rows if r["step"] == 9) == pytest.approx(9 * GLOBAL_BATCH / N)

    # Metrics: one loss per global step 1..9 across the two runs.
    history = read_metrics(ckpt / "metrics.jsonl")
    assert [step for step, _ in history.series("loss")] == list(range(1, 10))
