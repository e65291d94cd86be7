"""A Trainer that cannot regroup in place (here ``auto_find_batch_size``; DeepSpeed and FSDP the same) under
elastrain-run's defaults (live mode): an unmodified HF-style script (examples/hf/run_clm.py) trains as one world of
every worker, not as one world per worker.

Live workers set up as one process until ``trainer.train()`` and join their round there; a restart-only Trainer never
regroups, so its workers join when the script first asks for a device, as under ``--live false``. Its warm workers end
before they wait for a round, and the agent starts them after the rendezvous instead."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support.processes import events_in
from support.trainer_trace import causal_lm, reference

pytestmark = pytest.mark.slow


def test_a_restart_only_trainer_trains_as_one_world_under_the_live_default(hf_assets: Path, tmp_path: Path) -> None:
    w = causal_lm(hf_assets, max_steps=12)
    w = dataclasses.replace(w, args=(*w.args, "--auto_find_batch_size"))
    run = reference(w, tmp_path / "run")  # one node of two workers, elastrain-run's defaults
    log = run.logs["ref"]
    assert events_in(log, "trainer_restart_mode"), log[-6000:]
    assert events_in(log, "warm_start_unsupported"), log[-6000:]
    assert run.ledger.last_step() == w.max_steps, log[-6000:]
    assert set(run.ledger.world_sizes()) == {2}, f"world sizes {run.ledger.world_sizes()}\n{log[-6000:]}"
    assert all(run.ledger.complete().values()), log[-6000:]
