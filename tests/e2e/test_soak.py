"""The soak, short and seeded: the ledger job on 3 local nodes plus 2 spares under 10 churn events.

Seed 311's trace has every kind of event (tests/unit/test_chaos_trace.py checks that): SIGKILL, SIGKILL of one worker
(its agent starts it again), SIGTERM with a notice, SIGSTOP then SIGCONT, node 0 (the first store host) down, a
whole-job kill and restart with the same command, nodes returning at the original endpoint, spares beyond MAX. The soak
passes only if the job ends at its last step with the exact samples, every sample id is used exactly once per epoch, no
two worlds train at the same time, every committed checkpoint verifies, no process outlives its node, and no membership
event leads to more than one rendezvous round. ``python bench/soak.py --seed N --events 50`` is the long version.

The Trainer soak: examples/hf/run_clm.py, unchanged, on a tiny GPT-2, 2 local nodes plus a spare, in the default mode
with ``--checkpoint-dir``, under seed 1897's 4 events: a spare started while the job is full, the worker of node 0
(the store host) SIGKILLed alone (its agent starts it again, and it joins the live world), a member SIGTERMed with a
notice (the spare takes its place), the spare SIGKILLed. (No start comes late in the trace: a node still warming up
when the job ends waits for the store its job published until it gives up, longer than the harness's drain.) It passes
only if the job ends at max_steps, every sample is used once per epoch (the ledger the script writes for the bench,
read from outside), no step is computed twice beyond one per SIGKILL, no process outlives its node and no event leads
to more than one rendezvous round.
"""

from __future__ import annotations

import json

import pytest
from support.processes import PYTHON, REPO, free_port, run

pytestmark = pytest.mark.slow

SEED = 311
EVENTS = 10
SOAK_TIMEOUT_S = 600
TRAINER_SEED = 1897
TRAINER_EVENTS = 4
TRAINER_TIMEOUT_S = 300


@pytest.mark.timeout(SOAK_TIMEOUT_S + 120)
def test_short_seeded_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak"
    cmd = [PYTHON, str(REPO / "bench" / "soak.py"), "--job", "ledger", "--seed", str(SEED), "--events", str(EVENTS),
           "--port", str(free_port()), "--timeout", str(SOAK_TIMEOUT_S), "--output-dir", str(out)]  # fmt: skip
    res = run(cmd, timeout=SOAK_TIMEOUT_S + 60, cwd=REPO)
    report = json.loads((out / "soak.json").read_text())
    table = res.stdout[-6000:]
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "job finished, trace ran",
        "final step and samples_seen",
        "every sample once per epoch",
        "one world at a time",
        "committed checkpoints load",
        "no orphan processes",
        "bounded rounds",
    ]
    assert report["figures"]["events_fired"] == EVENTS, table
    assert res.returncode == 0 and report["ok"], table + res.stderr[-3000:]
    assert "FAIL" not in table


@pytest.mark.timeout(TRAINER_TIMEOUT_S + 420)
def test_short_seeded_trainer_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak"
    cmd = [PYTHON, str(REPO / "bench" / "soak.py"), "--job", "trainer", "--seed", str(TRAINER_SEED),
           "--events", str(TRAINER_EVENTS), "--max-nodes", "2", "--spares", "1",
           "--port", str(free_port()), "--timeout", str(TRAINER_TIMEOUT_S), "--data-dir", str(tmp_path / "assets"),
           "--output-dir", str(out)]  # fmt: skip
    res = run(cmd, timeout=TRAINER_TIMEOUT_S + 360, cwd=REPO)  # + building the tiny assets
    assert (out / "soak.json").exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    table = res.stdout[-6000:]
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "job finished, trace ran",
        "final step",
        "every sample once per epoch",
        "every evaluation once",
        "steps computed twice",
        "no orphan processes",
        "bounded rounds",
    ]
    assert report["figures"]["events_fired"] == TRAINER_EVENTS, table
    assert res.returncode == 0 and report["ok"], table + res.stderr[-3000:]
    assert "FAIL" not in table
