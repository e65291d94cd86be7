"""metrics.jsonl and events.jsonl on an fsspec URL (``memory://``): parts put whole, read back in order.

The same code runs against real S3-compatible and Azure servers in tests/integration/test_object_storage.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from elastrain.metrics import EventsFile, MetricsWriter, read_events, read_metrics
from elastrain.metrics.lines import LineLog, compact, read_json_lines
from elastrain.storage import join_path


@pytest.fixture
def root() -> Iterator[str]:
    url = f"memory://elastrain-test-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_join_path_keeps_url_schemes_and_local_paths() -> None:
    assert join_path("s3://bucket/run/", "metrics.jsonl") == "s3://bucket/run/metrics.jsonl"
    assert join_path("az://c/run", "ckpt", "events.jsonl") == "az://c/run/ckpt/events.jsonl"
    assert join_path("/mnt/out", "metrics.jsonl") == "/mnt/out/metrics.jsonl"
    assert join_path(Path("rel"), "x") == "rel/x"


def test_restarts_on_a_url_supersede_like_on_a_file(root: str) -> None:
    path = join_path(root, "metrics.jsonl")
    a = MetricsWriter(path, "a", flush_every_s=3600)
    for step in range(1, 8):
        a.log(step, loss=10.0 - step)
    a.flush()
    b = MetricsWriter(path, "b", restored_step=5, flush_every_s=3600)
    for step in range(6, 10):
        b.log(step, loss=100.0 + step)
    other = MetricsWriter(path, "b", open_segment=False, flush_every_s=0)  # another rank: points only
    other.log(9, grad_norm=1.0)
    b.close()
    h = read_metrics(path)
    assert h.segments == ["a", "b"]
    assert h.series("loss") == [(s, 10.0 - s) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 10)]
    assert sorted((p.segment, p.step) for p in h.superseded) == [("a", 6), ("a", 7)]
    assert h.series("grad_norm") == [(9, 1.0)]
    # Nothing was appended to an object: each flush is a new part; the path is their folder. Opening
    # segment b merged a's parts into one, in the background, with whatever else was stored by the time that merge
    # listed the folder (b's header, b's and the other rank's points: on a loaded machine, all of them).
    parts = [str(p) for p in fsspec.filesystem("memory").ls(path, detail=False)]
    assert 1 <= len(parts) <= 4 and all(p.endswith(".jsonl") for p in parts), parts
    assert sum(bool(re.search(r"-compacted-[0-9a-f]+\.jsonl$", p)) for p in parts) == 1, parts


def test_points_wait_for_a_flush_and_a_header_is_stored_at_once(root: str) -> None:
    path = join_path(root, "metrics.jsonl")
    w = MetricsWriter(path, "seg", restored_step=3, flush_every_s=3600)
    w.log(4, loss=1.0)
    h = read_metrics(path)
    assert h.segments == ["seg"] and h.restored_steps == {"seg": 3} and h.active == []
    w.flush()
    assert read_metrics(path).series("loss") == [(4, 1.0)]
    w.flush()  # nothing buffered: no empty part
    assert len(fsspec.filesystem("memory").ls(path, detail=False)) == 2
    assert compact(path) == 2 and len(fsspec.filesystem("memory").ls(path, detail=False)) == 1
    assert read_metrics(path).series("loss") == [(4, 1.0)]
    assert compact(path) == 0


def test_events_are_put_one_by_one(root: str) -> None:
    path = join_path(root, "events.jsonl")
    events = EventsFile(path, run_id="r", segment="s")
    events.record("start", world_size=2)
    events.record("checkpoint", step=4, requested=None)
    assert [e["event"] for e in read_events(path)] == ["start", "checkpoint"]
    assert read_events(path, "checkpoint")[0]["step"] == 4 and "requested" not in read_events(path)[1]
    assert EventsFile(None).path is None


def test_a_missing_log_reads_empty(root: str, tmp_path: Path) -> None:
    assert read_metrics(join_path(root, "nothing.jsonl")).segments == []
    assert read_events(tmp_path / "nothing.jsonl") == []


def test_a_local_folder_of_parts_reads_like_its_url(root: str, tmp_path: Path) -> None:
    path = join_path(root, "events.jsonl")
    log = LineLog(path)
    for i in range(3):
        log.append({"event": "e", "i": i})
    fsspec.filesystem("memory").get(path, str(tmp_path / "events.jsonl"), recursive=True)
    assert [r["i"] for r in read_json_lines(tmp_path / "events.jsonl")] == [0, 1, 2]
    assert [r["i"] for r in read_json_lines(path)] == [0, 1, 2]


def test_a_failed_put_keeps_the_records_for_the_next_flush(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = join_path(root, "metrics.jsonl")
    w = MetricsWriter(path, "seg", flush_every_s=3600)
    w.log(1, loss=1.0)
    fs = w._log._fs
    real = fs.pipe_file

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("denied")

    monkeypatch.setattr(fs, "pipe_file", refuse)
    w.flush()
    monkeypatch.setattr(fs, "pipe_file", real)
    w.log(2, loss=2.0)
    w.flush()
    assert read_metrics(path).series("loss") == [(1, 1.0), (2, 2.0)]


def test_a_checkpointed_step_stores_its_points_when_they_are_logged(root: str) -> None:
    path = join_path(root, "metrics.jsonl")
    w = MetricsWriter(path, "seg", flush_every_s=3600)
    for step in (1, 2):
        w.log(step, loss=float(step))
    w.checkpointed(3)  # the save of step 3 starts before step 3 logs its loss
    assert [s for s, _ in read_metrics(path).series("loss")] == [1, 2]
    w.log(3, loss=3.0)
    assert [s for s, _ in read_metrics(path).series("loss")] == [1, 2, 3]
    w.log(4, loss=4.0)  # buffered again until the next flush
    assert [s for s, _ in read_metrics(path).series("loss")] == [1, 2, 3]


def test_probe_messages_name_rank_ranges() -> None:
    from elastrain.storage import _ranges

    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _ranges([3]) == "3"


def test_a_compaction_cut_short_reads_each_record_once(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = join_path(root, "events.jsonl")
    events = EventsFile(path)
    for name in ("start", "checkpoint", "restore"):
        events.record(name)
    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(type(fs), "rm", lambda self, *a, **k: None)  # killed after the put, before deleting
    assert compact(path) == 3
    assert len(fs.ls(path, detail=False)) == 4
    assert [e["event"] for e in read_events(path)] == ["start", "checkpoint", "restore"]
    monkeypatch.undo()
    events.record("finish")
    assert compact(path) == 5  # the merged copy is replaced, not merged into itself
    assert [e["event"] for e in read_events(path)] == ["start", "checkpoint", "restore", "finish"]
    assert len(fs.ls(path, detail=False)) == 1


def test_the_segment_writer_merges_parts_every_so_many_flushes(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain.metrics import series

    monkeypatch.setattr(series, "COMPACT_EVERY", 4)
    path = join_path(root, "metrics.jsonl")
    w = MetricsWriter(path, "seg", flush_every_s=0)
    for step in range(1, 11):
        w.log(step, loss=float(step))
        merging = w._log._compactor
        if merging is not None:
            merging.join(10)  # deterministic here; a merge still running is skipped, never doubled
    w.close()
    parts = fsspec.filesystem("memory").ls(path, detail=False)
    assert len(parts) < 6, parts  # 11 parts were put
    assert [s for s, _ in read_metrics(path).series("loss")] == list(range(1, 11))
