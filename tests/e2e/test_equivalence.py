"""The constant policy through world-size changes and kills ends where an uninterrupted run ends."""

from __future__ import annotations

import pytest
from ledger_chain import MAX_STEPS, elastic_chain, uninterrupted

from elastrain.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_constant_policy_matches_the_uninterrupted_run() -> None:
    elastic, reference = elastic_chain(), uninterrupted()
    assert elastic.result()["step"] == reference.result()["step"] == MAX_STEPS
    assert elastic.result()["final_loss"] == pytest.approx(reference.result()["final_loss"], rel=1e-4)
    # Not only the end: every step's loss matches (the steps re-run after a kill replace the cut-off ones).
    got = read_metrics(elastic.ckpt / "metrics.jsonl").series("loss")
    want = read_metrics(reference.ckpt / "metrics.jsonl").series("loss")
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4)
