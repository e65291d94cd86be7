"""A Trainer's life under elastrain-run ends as under torchrun: a script that trains one Trainer after another (a
k-fold or a sweep) gets each one's memory back, and a training DataLoader's persistent workers are shut down as the
worker exits, not terminated under it (torch reports that as a failed DataLoader worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, run

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
WORKER = str(REPO / "tests" / "workers" / "hf_sequential_trainers.py")


@pytest.mark.parametrize("live", ["true", "false"])
def test_a_script_that_trains_one_trainer_after_another_gets_each_ones_memory_back(live: str, tmp_path: Path) -> None:
    cmd = elastrain_cmd(
        "--standalone", "--nproc-per-node=2", f"--live={live}", f"--checkpoint-dir={tmp_path / 'ckpt'}", WORKER,
        f"--output-dir={tmp_path / 'out'}",
    )  # fmt: skip
    proc = run(cmd, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    freed = [line.split()[1] for line in out.splitlines() if line.startswith("FOLD_FREED")]
    assert freed == ["True", "True"], f"the first fold's model outlived its Trainer: {freed}\n{out}"
    done = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("DONE"))
    assert done == [["0", "6", "6"], ["1", "6", "6"]], out
    assert "killed by signal" not in out and "Exception ignored" not in out, out
