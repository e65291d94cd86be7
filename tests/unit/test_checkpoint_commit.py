"""The commit protocol in one process: prepare, commit, verify, agree; leftovers and generations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import (
    OWNER,
    Commit,
    entry_of,
    fsync_and_checksum,
    may_remove_leftover,
    merge_reports,
)
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.layout import Chunk, CommitMarker, FileEntry, StepDir
from elastrain.checkpoint.storage import LocalStorage
from elastrain.errors import CheckpointSaveError, StaleGenerationError


@pytest.mark.parametrize(
    ("owner", "mine", "allowed"),
    [
        (None, None, True),  # unfenced world, unowned leftover
        (None, 3, True),  # written before generations existed
        (3, None, True),  # an unfenced world removes any leftover
        (2, 3, True),  # an older generation's leftover
        (3, 3, True),  # our own (a save of ours that was interrupted)
        (4, 3, False),  # a newer world is writing there: we are stale
    ],
)
def test_may_remove_leftover(owner: int | None, mine: int | None, allowed: bool) -> None:
    assert may_remove_leftover(owner, mine) is allowed


A, B = FileEntry(1, 10), FileEntry(2, 20)


@pytest.mark.parametrize(
    ("reports", "expected", "merged", "problem"),
    [
        ([{"a": A}, {"b": B}], ["a", "b"], {"a": A, "b": B}, None),
        ([{"a": A}, {"a": A}], None, {"a": A}, None),  # the same file reported twice, identically
        ([{"a": A}, {"a": B}], None, {"a": B}, "reported by two ranks"),
        ([{"a": A}, {}], ["a", "b"], {"a": A}, "no rank reported writing b"),
        ([{}, {}], None, {}, None),
    ],
)
def test_merge_reports(
    reports: list[dict[str, FileEntry]], expected: list[str] | None, merged: dict[str, FileEntry], problem: str | None
) -> None:
    entries, problems = merge_reports(reports, expected)
    assert entries == merged
    assert (problem is None and not problems) or (problem is not None and problem in "; ".join(problems))


class Fence:
    """Stands in for elastrain.checkpoint.fence (the lead's module): records calls, raises when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.newer: int | None = None

    def __call__(self, root: str, generation: int | None, storage: object) -> None:
        self.calls.append((root, generation))
        if generation is not None and self.newer is not None and self.newer > generation:
            raise StaleGenerationError(f"{root}: generation {self.newer} claimed it")


def proto(
    root: Path, generation: int | None = None, keep_last: int = 2, fence: Fence | None = None
) -> tuple[Commit, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    log = lambda event, *a, **k: events.append((event, k))  # noqa: E731
    c = Commit(
        str(root),
        LocalStorage(),
        Group(),
        kind="test",
        generation=generation,
        keep_last=keep_last,
        log=log,
        fence=fence or Fence(),
    )
    return c, events


def write(c: Commit, step: int, files: dict[str, bytes]) -> CommitMarker:
    path = c.prepare(step)
    assert path is not None
    report = {}
    for name, data in files.items():
        (Path(path) / name).write_bytes(data)
        report[name] = fsync_and_checksum(str(Path(path) / name))
    return c.commit(step, path, report, expected=list(files))


def test_prepare_commit_and_never_overwrite(tmp_path: Path) -> None:
    c, events = proto(tmp_path, generation=7)
    marker = write(c, 5, {"a.bin": b"x" * 10})
    path = tmp_path / layout.step_dir_name(5)
    assert json.loads((path / OWNER).read_text())["generation"] == 7
    assert marker.generation == 7 and layout.read_commit_marker(str(path)).generation == 7
    assert marker.files["a.bin"] == entry_of(b"x" * 10)
    assert c.prepare(5) is None  # committed: never overwritten
    assert events[-1][0] == "checkpoint_save_skipped"


def test_the_fence_is_checked_right_before_the_marker_and_a_stale_world_never_commits(tmp_path: Path) -> None:
    fence = Fence()
    c, _ = proto(tmp_path, generation=3, fence=fence)
    write(c, 1, {"a": b"a"})
    assert fence.calls == [(str(tmp_path), 3)]
    fence.newer = 4
    with pytest.raises(StaleGenerationError, match="generation 4 claimed it"):
        write(c, 2, {"a": b"a"})
    assert not (tmp_path / layout.step_dir_name(2) / layout.MARKER).exists()


def test_a_rank_error_or_a_missing_file_fails_the_commit_naming_path_and_cause(tmp_path: Path) -> None:
    c, _ = proto(tmp_path)
    path = c.prepare(1)
    assert path is not None
    with pytest.raises(CheckpointSaveError, match=rf"step 1 in {path} failed: rank 0: OSError: disk full"):
        c.commit(1, path, None, "OSError: disk full")
    with pytest.raises(CheckpointSaveError, match=r"no rank reported writing b\.bin"):
        c.commit(1, path, {"a.bin": A}, expected=["a.bin", "b.bin"])
    assert not (Path(path) / layout.MARKER).exists()


def test_an_unwritable_root_fails_prepare(tmp_path: Path) -> None:
    c, _ = proto(tmp_path / "root")
    (tmp_path / "root").write_text("not a directory")
    with pytest.raises(CheckpointSaveError, match="cannot create the step directory"):
        c.prepare(3)


@pytest.mark.parametrize(("owner", "mine", "removed"), [(2, 3, True), (3, 3, True), (None, 3, True), (4, 3, False)])
def test_leftovers_of_newer_generations_are_never_removed(
    tmp_path: Path, owner: int | None, mine: int, removed: bool
) -> None:
    writer, _ = proto(tmp_path, generation=owner)
    left = writer.prepare(9)  # a save that never committed
    assert left is not None
    (Path(left) / "part.bin").write_bytes(b"p")
    c, events = proto(tmp_path, generation=mine)
    if removed:
        assert c.prepare(9) == left and not (Path(left) / "part.bin").exists()
        assert events[0][0] == "checkpoint_purged" and events[0][1]["owner_generation"] == owner
    else:
        with pytest.raises(StaleGenerationError, match="generation 4, newer than this world's 3"):
            c.prepare(9)
        assert (Path(left) / "part.bin").exists()


def test_retention_keeps_in_progress_directories_of_newer_generations(tmp_path: Path) -> None:
    new, _ = proto(tmp_path, generation=5)
    assert new.prepare(1) is not None  # the newer world's save in progress, at a lower step
    old, _ = proto(tmp_path, generation=4, keep_last=1)
    for step in (2, 3):
        write(old, step, {"a": b"a"})
    assert [(d.step, d.committed) for d in layout.list_step_dirs(str(tmp_path))] == [(1, False), (3, True)]


def test_old_markers_without_generation_or_chunks_still_load() -> None:
    old = {"format": 1, "step": 2, "world_size": 1, "kind": "dcp", "files": {"a": {"size": 1, "crc32": 5}}}
    m = CommitMarker.from_json(json.dumps(old).encode(), "x")
    assert m.generation is None and m.files["a"] == FileEntry(1, 5)
    chunked = CommitMarker(1, 1, {"a": FileEntry(4, 1, (Chunk(0, 2, 7), Chunk(2, 2, 8)))}, generation=3)
    assert CommitMarker.from_json(chunked.to_json(), "x") == chunked


def test_restore_takes_the_newest_step_that_verifies_and_loads(tmp_path: Path) -> None:
    c, events = proto(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        write(c, step, {"a.bin": bytes([step]) * 8})
    assert c.prepare(4) is not None  # never committed
    (tmp_path / layout.step_dir_name(3) / "a.bin").write_bytes(b"\0" * 8)  # same length, other bytes
    loaded: list[int] = []

    def load(d: StepDir, marker: CommitMarker) -> int | None:
        loaded.append(d.step)
        if d.step == 2:  # the format's own load fails on step 2
            c.reject(d, "unloadable")
            return None
        return marker.step

    assert c.restore(load) == 1
    assert loaded == [2, 1]
    reasons = [k["reason"] for e, k in events if e == "checkpoint_fallback"]
    assert "no commit marker" in reasons[0] and "CRC-32" in reasons[1] and reasons[2] == "unloadable"
    assert c.bad_steps == {2, 3, 4}


def test_verify_reads_only_what_the_format_cannot_check_while_loading(tmp_path: Path) -> None:
    c, _ = proto(tmp_path)
    write(c, 1, {"a.bin": b"a" * 8, "b.bin": b"b" * 8})
    (tmp_path / layout.step_dir_name(1) / "b.bin").write_bytes(b"B" * 8)
    d = layout.list_step_dirs(str(tmp_path))[0]
    assert isinstance(c.verify(d, lambda name, entry: name == "a.bin"), CommitMarker)  # b.bin: checked on load
    problem = c.verify(d, lambda name, entry: True)
    assert isinstance(problem, str) and "b.bin fails its CRC-32 check" in problem
