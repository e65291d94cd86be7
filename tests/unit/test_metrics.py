from __future__ import annotations

from pathlib import Path

import pytest

from elastrain.metrics import (
    EventsFile,
    MetricsWriter,
    TensorBoardWriter,
    read_events,
    read_metrics,
    tensorboard_available,
)


def test_restart_supersedes_points_after_the_restored_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    a = MetricsWriter(path, "a")
    for step in range(1, 8):
        a.log(step, loss=10.0 - step)
    # Restart from a checkpoint at step 5: steps 6 and 7 are re-run.
    b = MetricsWriter(path, "b", restored_step=5)
    for step in range(6, 10):
        b.log(step, loss=100.0 + step)
    # A second process of segment b appends points without a header.
    MetricsWriter(path, "b", open_segment=False).log(9, grad_norm=1.0)
    # A restart from step 8, and a torn last line from a kill.
    c = MetricsWriter(path, "c", restored_step=8)
    c.log(9, loss=1.0)
    with open(path, "a") as fh:
        fh.write('{"kind": "point", "segm')

    h = read_metrics(path)
    assert h.segments == ["a", "b", "c"]
    assert h.series("loss") == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 6.0),
        (5, 5.0),
        (6, 106.0),
        (7, 107.0),
        (8, 108.0),
        (9, 1.0),
    ]
    assert sorted((p.segment, p.step) for p in h.superseded) == [("a", 6), ("a", 7), ("b", 9), ("b", 9)]
    assert h.series("grad_norm") == []


def test_an_earlier_restart_point_bounds_every_earlier_segment(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    MetricsWriter(path, "a").log(10, x=1)
    MetricsWriter(path, "b", restored_step=12).log(13, x=2)
    MetricsWriter(path, "c", restored_step=8)
    h = read_metrics(path)
    assert h.active == []
    assert len(h.superseded) == 2


def test_events_file(tmp_path: Path) -> None:
    ev = EventsFile(tmp_path / "sub" / "events.jsonl", run_id="r1")
    ev.record("start", world_size=2, restored_step=None)
    ev.record("rescale", old=2, new=1)
    EventsFile(None).record("ignored")
    events = read_events(tmp_path / "sub" / "events.jsonl")
    assert [e["event"] for e in events] == ["start", "rescale"]
    assert events[0]["run_id"] == "r1" and "restored_step" not in events[0]
    assert read_events(tmp_path / "sub" / "events.jsonl", "rescale")[0]["new"] == 1


@pytest.mark.skipif(not tensorboard_available(), reason="tensorboard is not installed")
def test_tensorboard_writer(tmp_path: Path) -> None:
    w = TensorBoardWriter(tmp_path, restored_step=3)
    w.log(4, loss=1.0)
    w.close()
    assert any(tmp_path.iterdir())
