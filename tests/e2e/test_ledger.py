"""Exact-once data through world sizes 2 -> 1 -> 3 -> 2 with real SIGKILLs between the starts."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from support.ledger_chain import (
    GLOBAL_BATCH,
    MAX_STEPS,
    SAMPLES,
    WORLD_SIZES,
    assert_each_sample_once_per_epoch,
    elastic_chain,
    ledger_steps,
)

from elastrain.metrics import read_events, read_metrics

pytestmark = pytest.mark.slow


def test_every_sample_exactly_once_per_epoch() -> None:
    chain = elastic_chain()
    h = read_metrics(chain.out / "ledger.jsonl")
    assert len(h.segments) == len(WORLD_SIZES)
    # Every killed start got past a checkpoint and had steps re-run by the next start.
    restored = [h.restored_steps[s] for s in h.segments]
    assert restored[0] == 0 and restored == sorted(restored) and len(set(restored)) == len(restored)
    assert h.superseded, "the kills should have cut off steps after the last checkpoint"

    steps = ledger_steps(chain.out / "ledger.jsonl")
    assert sorted(steps.ids) == list(range(1, MAX_STEPS + 1))
    # Each step ran at one world size, and all four sizes trained some steps.
    assert all(len(w) == 1 for w in steps.worlds.values())
    assert {next(iter(w)) for w in steps.worlds.values()} == set(WORLD_SIZES)
    assert_each_sample_once_per_epoch(steps)
    # Full steps carry the global batch whatever the world size; the epoch tail is a partial step.
    last = max(steps.epochs.values())
    sizes = Counter(len(ids) for ids in steps.ids.values())
    assert sizes == {GLOBAL_BATCH: MAX_STEPS - last, SAMPLES % GLOBAL_BATCH: last}


def test_events_and_metrics_continue_across_restarts() -> None:
    chain = elastic_chain()
    events = read_events(chain.ckpt / "events.jsonl")
    starts = read_events(chain.ckpt / "events.jsonl", "start")
    assert [e["world_size"] for e in starts] == list(WORLD_SIZES)
    changes = [(e["old"], e["new"]) for e in events if e["event"] == "world_size_changed"]
    assert changes == list(itertools.pairwise(WORLD_SIZES))
    assert len([e for e in events if e["event"] == "rescale"]) == len(changes)
    assert any(e["event"] == "checkpoint" for e in events)
    restores = read_events(chain.ckpt / "events.jsonl", "restore")
    assert len(restores) == len(WORLD_SIZES) - 1
    assert all(r["steps_rerun"] >= 1 for r in restores), "each kill came after steps that were not checkpointed"
    assert events[-1]["event"] == "finish" and events[-1]["step"] == MAX_STEPS

    metrics = read_metrics(chain.ckpt / "metrics.jsonl")
    assert [s for s, _ in metrics.series("loss")] == list(range(1, MAX_STEPS + 1))
    assert metrics.superseded

    rescale_lines = [line for log in chain.logs for line in log.splitlines() if "event=rescale" in line]
    assert len(rescale_lines) == len(changes)
    assert "world_size=2->1" in rescale_lines[0] and "accumulation=4" in rescale_lines[0]
