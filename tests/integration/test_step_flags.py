"""Restart mode (--live false): the save decision rides on the step's gradient all-reduce, no all-reduce of its own.

Two nodes through the real elastrain-run (c10d, gloo): a save asked for on one node's control channel
only is made by every rank at the same step, the checkpointer's own agreement all-reduce is never run
while steps sync gradients, and the trained model is the same as without any checkpointer (DDP's own
all-reduce): the flags do not touch the gradients. The step's loss rides along too: ``step.mean_loss()``
makes no collective of its own when the step synced, and gives what the all-reduce of its own gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, free_port, reaped, spawn, wait_logged

WORKER = str(REPO / "tests" / "workers" / "step_flags_worker.py")
BOUND = 120.0


def _job(tmp: Path, env: dict[str, str], checkpoint_dir: Path | None) -> list[dict[str, str]]:
    port = free_port()
    extra = ("--checkpoint-dir", str(checkpoint_dir)) if checkpoint_dir else ()
    procs = []
    for node in range(2):
        log = tmp / f"node{node}.log"
        cmd = elastrain_cmd(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "flags", "--max-restarts", "0", "--live", "false", *extra, WORKER,
        )  # fmt: skip
        procs.append((spawn(cmd, log, env=env), log))
    with reaped(*(p for p, _ in procs)):
        codes = wait_logged(procs, BOUND)
    texts = [log.read_text(errors="replace") for _, log in procs]
    assert codes == [0, 0], "\n".join(texts)
    done = [line for text in texts for line in text.splitlines() if line.startswith("SF_DONE ")]
    assert len(done) == 2, "\n".join(texts)
    return [dict(p.split("=", 1) for p in line.split()[1:]) for line in done]


def test_a_save_one_rank_was_asked_for_is_agreed_through_the_gradient_sync(tmp_path: Path) -> None:
    (tmp_path / "flags").mkdir()
    (tmp_path / "plain").mkdir()
    ckpt = tmp_path / "ckpt"
    flagged = _job(tmp_path / "flags", {"SF_REQUEST_AT": "5"}, ckpt)
    # No checkpointer: DDP's own all-reduce, nothing to agree on.
    plain = _job(tmp_path / "plain", {}, None)
    # The checkpointer's per-step agreement never ran: every step synced gradients and carried the flags.
    assert all(d["agree_calls"] == "0" for d in flagged), flagged
    # The step's loss rode on the sync: no collective of its own, the same values as the plain run's all-reduce
    # (float32 bucket vs float64 all-reduce).
    assert all(d["loss_calls"] == "0" for d in flagged) and all(d["loss_calls"] == "12" for d in plain)
    for d in flagged + plain:
        want = [float(v) for v in plain[0]["losses"].split(",")]
        assert [float(v) for v in d["losses"].split(",")] == pytest.approx(want, rel=1e-6)
    # The flags leave the gradients alone: the same model on every rank, equal to the run without them.
    assert len({d["hash"] for d in flagged + plain}) == 1, (flagged, plain)
    # Rank 0 saw no request of its own, yet saved step 5 for node 1's: the ranks agreed.
    events = [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "checkpoint"] == [5, 12], events  # 12: the final save
    logs = "".join(log.read_text(errors="replace") for log in sorted((tmp_path / "flags").glob("node*.log")))
    started = [line for line in logs.splitlines() if "event=checkpoint_save_started rank=0 step=5 " in line]
    assert len(started) == 1 and "reason=request" in started[0], logs
