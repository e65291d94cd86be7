"""The launcher's save request is honoured at the next step boundary by all ranks: no step is lost.

Then a rank killed in the middle of writing its shard leaves a step that never commits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, kill_tree, reaped, run, spawn, wait_for

from elastrain.checkpoint import layout
from elastrain.control import ControlChannel, SaveCause

WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
pytestmark = pytest.mark.slow


def steps_seen(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^STEP (\d+) (\w+)$", text, re.M)}


def test_save_on_request_loses_no_step_then_a_rank_dies_mid_save(tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "run1.log"
    cmd = elastrain_cmd("--nproc-per-node=2", f"--checkpoint-dir={ckpt}", WORKER, "--steps=100000", "--sleep=0.05")
    agent = spawn(cmd, log)
    with reaped(agent):
        wait_for(lambda: len(steps_seen(log.read_text())) >= 3, timeout=120, what="training steps")
        control = re.search(r"^CONTROL (\S+)$", log.read_text(), re.M)
        assert control, log.read_text()
        channel = ControlChannel(control.group(1))  # what the agent does on SIGTERM or a joining node
        before = max(steps_seen(log.read_text()))
        request = channel.request_save(SaveCause.SCALE_UP, "test")
        ack = channel.wait_ack(request.request_id, timeout_s=60)
        assert ack is not None, log.read_text()
        kill_tree(agent.pid)  # the agent restarts (here: kills) the workers once the save committed
    seen = steps_seen(log.read_text())
    assert before <= ack.step <= before + 5  # honoured at a step boundary soon after the request
    assert ack.checkpoint == str(ckpt / layout.step_dir_name(ack.step))
    layout.verify_step(ack.checkpoint)

    # Resume: the parameters are exactly those of step ack.step. Then rank 1 dies while writing
    # its shard of the next save: that step never commits and the newest complete one stays.
    kill_step = ack.step + 2
    proc = run(
        elastrain_cmd(
            "--nproc-per-node=2",
            f"--checkpoint-dir={ckpt}",
            WORKER,
            f"--steps={ack.step + 4}",
            "--interval=1",
            "--kill=mid_write",
            f"--kill-step={kill_step}",
            "--kill-rank=1",
        ),
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    info = json.loads(re.search(r"^RESTORED (.*)$", out, re.M).group(1))  # type: ignore[union-attr]
    assert info["step"] == ack.step
    assert re.search(r"^DIGEST (\w+)$", out, re.M).group(1) == seen[ack.step]  # type: ignore[union-attr]
    assert "KILLING rank 1" in out
    assert not (ckpt / layout.step_dir_name(kill_step) / layout.MARKER).exists()
    found = layout.newest_complete(str(ckpt))
    assert found is not None and found[0].step == kill_step - 1
