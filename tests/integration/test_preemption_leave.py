"""A preemption notice served to one of two nodes: it checkpoints, leaves, and no committed step is lost.

Two elastrain-run agents on 127.0.0.1 (``--nnodes 1:2``), each watching its own fake Azure metadata
server. Once both train in one world, node B's server announces a ``Preempt``. Expected: B logs the
notice (notice time, time left), asks its workers for a checkpoint (a collective save with A's), leaves
the rendezvous and exits 0; Azure gets the ``StartRequests`` acknowledgement; A goes on alone from
exactly the step B committed. Then the platform restarts the job from scratch through the AzureML
entrypoint (same run id, same checkpoint folder) and it resumes from the last checkpoint with no flag.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.fake_metadata import azure_preempt_event, fake_metadata_server
from support.processes import PYTHON, elastrain_cmd, free_port, reaped, run, spawn, wait_for

from elastrain.log import parse_event_line

pytestmark = pytest.mark.slow

TOTAL_STEPS = 30
STEP_S = 0.1

WORKER = r"""
import json, os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain import WorkerEnv
from elastrain.checkpoint import Checkpointer

total, step_s, ledger = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
env = WorkerEnv.from_environ()
dist.init_process_group("gloo", timeout=timedelta(seconds=env.collective_timeout_s or 30))
ws, rank = dist.get_world_size(), dist.get_rank()


def record(**fields):
    if rank == 0:
        line = json.dumps({"pid": os.getpid(), "world_size": ws, "t": time.time(), **fields}) + "\n"
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, line.encode())
        os.close(fd)


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = Checkpointer(async_save=False)  # no interval: only the launcher's requests and the final save
ckpt.register(model=model, optimizer=opt)
info = ckpt.restore()
record(event="start", restored=info.step if info else None, reason=env.start_reason.value, run_id=env.run_id)
step = info.step if info else -1
for step in range(step + 1, total):
    loss = model(torch.full((8, 4), float(step % 7))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ws
    opt.step()
    record(event="step", step=step)
    if ckpt.maybe_save(step):
        record(event="saved", step=step)
    time.sleep(step_s)
if step >= 0:
    ckpt.save(step, blocking=True, reason="final")
ckpt.close()
record(event="done", step=step)
dist.destroy_process_group()
"""


def ledger_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(log: Path, name: str) -> list[dict[str, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        ev = parse_event_line(line)
        if ev is not None and ev.get("event") == name:
            out.append(ev)
    return out


def test_notice_checkpoints_leaves_and_the_survivor_resumes_from_the_committed_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    ledger = tmp_path / "ledger.jsonl"
    ckpt_dir = tmp_path / "ckpt"
    port = free_port()
    run_id = "preempt-e2e"

    def agent_cmd(endpoint: str, hosts_store: bool) -> list[str]:
        rdzv_conf = f"is_host={str(hosts_store).lower()},last_call_timeout=60"
        return elastrain_cmd(
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", rdzv_conf,
            "--rdzv-id", run_id, "--max-restarts", "2",
            "--checkpoint-dir", str(ckpt_dir), "--save-timeout", "20",
            "--preemption-watchers", "azure", "--metadata-endpoint", endpoint,
            str(script), str(TOTAL_STEPS), str(STEP_S), str(ledger),
        )  # fmt: skip

    with fake_metadata_server() as meta_a, fake_metadata_server() as meta_b:
        log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
        a = spawn(agent_cmd(meta_a.endpoint, hosts_store=True), log_a)
        with reaped(a):
            # A hosts the c10d store; B is the node that will be preempted. The first round waits for both.
            wait_for(lambda: events(log_a, "agent_started") != [], 60, what="agent A to start")
            b = spawn(agent_cmd(meta_b.endpoint, hosts_store=False), log_b)
            with reaped(b):
                wait_for(
                    lambda: sum(r.get("world_size") == 2 and r["event"] == "step" for r in ledger_rows(ledger)) >= 3,
                    90,
                    what="both nodes training in one world",
                )
                event_id = "EV-PREEMPT-B"
                meta_b.state.azure_events = [azure_preempt_event(time.time() + 30, event_id=event_id)]
                assert b.wait(timeout=60) == 0, log_b.read_text()[-3000:]
                wait_for(lambda: any(r["event"] == "done" for r in ledger_rows(ledger)), 90, what="A to finish")
                assert a.wait(timeout=60) == 0, log_a.read_text()[-3000:]

        # B: one notice line with the notice time and the time left, a checkpoint, a leave.
        (notice,) = events(log_b, "preemption_notice")
        assert notice["source"] == "azure" and notice["kind"] == "Preempt" and notice["event_id"] == event_id
        assert notice["notice_time"].endswith("Z") and 25 < float(notice["time_left_s"]) <= 31
        (acked,) = events(log_b, "checkpoint_acked")
        committed = int(acked["step"])
        assert events(log_b, "agent_left")
        assert meta_b.state.azure_acks == [event_id]  # acknowledged once the node had left
        assert events(log_a, "preemption_notice") == [] and meta_a.state.azure_acks == []

    rows = ledger_rows(ledger)
    starts = [r for r in rows if r["event"] == "start"]
    alone = [r for r in starts if r["world_size"] == 1 and r["restored"] is not None]
    assert alone, starts
    # The survivor resumed from exactly the step the leaving node committed: no committed step lost.
    assert alone[0]["restored"] == committed
    resumed_at = rows.index(alone[0])
    steps_alone = [r["step"] for r in rows[resumed_at:] if r["event"] == "step"]
    assert steps_alone == list(range(committed + 1, TOTAL_STEPS))
    steps_before = [r["step"] for r in rows[:resumed_at] if r["event"] == "step"]
    assert set(steps_before) == set(range(0, max(steps_before) + 1))  # contiguous, whatever the worlds
    redone = max(steps_before) - committed
    # The workers held after the requested save until they were restarted: no step ran past it.
    assert redone == 0, (committed, max(steps_before))
    left_at = float(events(log_b, "node_left")[0]["t"])
    first_alone = next(r["t"] for r in rows[resumed_at:] if r["event"] == "step")
    print(
        f"\npreemption e2e: notice -> left {left_at - float(notice['t']):.3f} s, committed step {committed}, "
        f"steps redone {redone}, leave -> survivor's first step {first_alone - left_at:.1f} s"
    )

    # The platform restarts the job from scratch (AzureML entrypoint, same run id and folder): auto-resume.
    aml_env = {
        "AZUREML_RUN_ID": run_id,
        "AZUREML_NODE_COUNT": "1",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    more = TOTAL_STEPS + 3
    proc = run(
        [
            PYTHON, "-m", "elastrain.platforms.azureml.entrypoint", "--checkpoint-dir", str(ckpt_dir),
            "--preemption-watchers", "none", "--", str(script), str(more), str(STEP_S), str(ledger),
        ],
        timeout=90,
        env=aml_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    restart = [r for r in ledger_rows(ledger) if r["event"] == "start"][-1]
    assert restart == {**restart, "restored": TOTAL_STEPS - 1, "run_id": run_id, "reason": "first_start"}
    final_steps = [r["step"] for r in ledger_rows(ledger)[len(rows) :] if r["event"] == "step"]
    assert final_steps == list(range(TOTAL_STEPS, more))
