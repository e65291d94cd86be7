"""Real DeepSpeed ZeRO on CPU through elastrain-run: save at world size 2, resume at 1 and 3, survive kills.

The reference for "optimizer state restored" is a resume at the same world size (exact in DeepSpeed):
the losses of the steps after the restored one (which depend on the Adam moments) must match it
within fp32 tolerance at every world size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.processes import REPO, elastrain_cmd, run, worker_env

from elastrain.integrations.ds_universal import committed_universal
from elastrain.log import parse_event_line

WORKER = str(REPO / "tests" / "workers" / "deepspeed_worker.py")
pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]
pytest.importorskip("deepspeed")


def launch_cmd(nproc: int, ckpt: Path, ledger: Path, *args: str, restarts: int = 0) -> list[str]:
    return elastrain_cmd(
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        f"--checkpoint-dir={ckpt}",
        WORKER,
        f"--ledger={ledger}",
        *args,
    )


def launch(nproc: int, ckpt: Path, ledger: Path, ext: Path, *args: str, restarts: int = 0) -> str:
    proc = run(
        launch_cmd(nproc, ckpt, ledger, *args, restarts=restarts), timeout=240, env={"TORCH_EXTENSIONS_DIR": str(ext)}
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def events(out: str, name: str) -> list[dict[str, str]]:
    parsed = (parse_event_line(line) for line in out.splitlines())
    return [e for e in parsed if e is not None and e.get("event") == name]


def rows(ledger: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def losses(ledger: Path, attempt: int | None = None) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(ledger) if attempt is None or r["attempt"] == attempt}


def assert_close(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7), (s, got, want)


def test_zero2_resume_at_1_and_3_and_survive_kills_in_save_and_conversion(tmp_path: Path) -> None:
    ckpt, ext = tmp_path / "ckpt", tmp_path / "torch_extensions"
    l2, l1, l3 = tmp_path / "ws2.jsonl", tmp_path / "ws1.jsonl", tmp_path / "ws3.jsonl"

    # World size 2: commit step 3; at step 5 rank 1 is SIGKILLed half-way through its optimizer shard.
    # The restart must ignore the partial step 5 and resume from step 3 (a same-world-size resume).
    out = launch(2, ckpt, l2, ext, "--stage=2", "--steps=6", "--save-at", "3", "--kill-save-at=5", restarts=1)
    assert [int(e["step"]) for e in events(out, "checkpoint_committed")] == [3]
    assert (ckpt / "step-0000000005").is_dir() and not (ckpt / "step-0000000005" / "elastrain-commit.json").exists()
    skipped = events(out, "checkpoint_fallback")
    assert skipped and skipped[0]["bad"].endswith("step-0000000005") and "no commit marker" in skipped[0]["reason"]
    first, resumed = losses(l2, attempt=0), losses(l2, attempt=1)
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [4, 5, 6]
    assert_close(resumed, first, [4, 5])  # same world size: exact
    reference = resumed

    # World size 1: the first attempt is SIGKILLed while converting to universal; the restart converts
    # again from scratch (the killed temporary directory is never loaded) and resumes from step 3.
    out = launch(1, ckpt, l1, ext, "--stage=2", "--steps=6", "--kill-convert", restarts=1)
    assert events(out, "workers_restarting"), out
    converted = events(out, "checkpoint_converted")
    assert [c["cached"] for c in converted] == ["False"]
    restored = events(out, "checkpoint_restored")
    assert restored[-1]["step"] == "3" and restored[-1]["universal"] == "True"
    assert {r["attempt"] for r in rows(l1)} == {1}
    assert_close(losses(l1), reference, [4, 5, 6])
    assert committed_universal(ckpt / "step-0000000003") is not None

    # World size 3: the cached conversion is reused.
    out = launch(3, ckpt, l3, ext, "--stage=2", "--steps=6")
    assert [c["cached"] for c in events(out, "checkpoint_converted")] == ["True"]
    assert_close(losses(l3), reference, [4, 5, 6])
    # Every rank's data position continued from the checkpoint's global cursor.
    assert [r["start"] for r in rows(l3)] == [[0, 36], [0, 48], [0, 60]]
    # Nothing was compiled: elastrain's init_distributed skips DeepSpeed's CPU shm op.
    assert not ext.exists() or not any(ext.iterdir())


def test_zero3_resume_at_1_and_3(tmp_path: Path) -> None:
    ckpt, ext = tmp_path / "ckpt", tmp_path / "torch_extensions"
    l2, l1, l3 = tmp_path / "ws2.jsonl", tmp_path / "ws1.jsonl", tmp_path / "ws3.jsonl"
    launch(2, ckpt, l2, ext, "--stage=3", "--steps=5", "--save-at", "3")
    reference = losses(l2)

    # Both resumes run at once, each on its own copy of the checkpoint: one checkpoint directory serves one
    # job (a second job on the same directory takes its fencing generation over, and the first one stops).
    ckpt1 = tmp_path / "ckpt-ws1"
    shutil.copytree(ckpt, ckpt1)
    env = worker_env({"TORCH_EXTENSIONS_DIR": str(ext)})
    procs = [
        subprocess.Popen(
            launch_cmd(n, directory, ledger, "--stage=3", "--steps=5"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for n, directory, ledger in ((1, ckpt1, l1), (3, ckpt, l3))
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=240)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        restored = events(out, "checkpoint_restored")
        assert restored[-1]["step"] == "3" and restored[-1]["universal"] == "True", out
    assert_close(losses(l1), reference, [4, 5])
    assert_close(losses(l3), reference, [4, 5])
