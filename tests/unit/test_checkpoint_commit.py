"""The commit protocol in one process: prepare, commit, verify, agree; leftovers and generations."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

from elastrain import fence as fence_mod
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
from elastrain.checkpoint.layout import Candidate, Chunk, CommitMarker, FileEntry, StepDir, restore_order
from elastrain.errors import CheckpointDurabilityError, CheckpointSaveError, StaleGenerationError
from elastrain.storage import LocalStorage, fsync_dir


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
    """Stands in for elastrain.fence (the lead's module): records calls, raises when told to."""

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


def test_the_fence_is_checked_at_prepare_and_around_the_marker_and_a_stale_world_never_commits(
    tmp_path: Path,
) -> None:
    fence = Fence()
    c, _ = proto(tmp_path, generation=3, fence=fence)
    write(c, 1, {"a": b"a"})
    assert fence.calls == [(str(tmp_path), 3)] * 3  # prepare, before the marker, after it
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


class LateClaim(Fence):
    """A newer world claims the root between the check before the marker and the marker's rename."""

    def __call__(self, root: str, generation: int | None, storage: object) -> None:
        if len(self.calls) == 2:  # prepare and the check before the marker passed: the claim lands now
            self.newer = (generation or 0) + 1
        super().__call__(root, generation, storage)


def test_a_commit_that_raced_a_newer_claim_is_withdrawn_and_raises(tmp_path: Path) -> None:
    c, _ = proto(tmp_path, generation=3, fence=LateClaim())
    with pytest.raises(StaleGenerationError, match="raced the claim: its marker was withdrawn"):
        write(c, 1, {"a": b"a"})
    d = layout.list_step_dirs(str(tmp_path))
    assert [(x.step, x.committed) for x in d] == [(1, False)]  # written, never committed


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths this process fsyncs from now on, in order."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_the_step_directory_is_durable_before_the_marker_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, _ = proto(tmp_path)
    path = c.prepare(1)
    assert path is not None
    (Path(path) / "sub").mkdir()
    (Path(path) / "sub" / "a").write_bytes(b"a")
    report = {"sub/a": fsync_and_checksum(str(Path(path) / "sub" / "a"))}
    seen = record_fsyncs(monkeypatch)
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        seen.append(f"rename {os.path.basename(dst)}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    c.commit(1, path, report, expected=["sub/a"])
    marker_at = seen.index(f"rename {layout.MARKER}")
    assert path in seen[:marker_at] and str(Path(path) / "sub") in seen[:marker_at], seen


def fail_fsync(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """From now on every fsync of this process fails with ``code``."""

    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failed_directory_fsync_raises_and_fails_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c, _ = proto(tmp_path / "root")
    path = c.prepare(1)
    assert path is not None
    fail_fsync(monkeypatch, errno.EIO)
    with pytest.raises(CheckpointDurabilityError, match=f"fsync of directory {tmp_path} failed"):
        fsync_dir(str(tmp_path))
    with pytest.raises(CheckpointSaveError, match="cannot write the commit marker: CheckpointDurabilityError"):
        c.commit(1, path, {})
    assert not (Path(path) / layout.MARKER).exists()
    with pytest.raises(CheckpointDurabilityError, match="cannot open directory"):
        fsync_dir(str(tmp_path / "missing"))


def test_a_filesystem_that_cannot_fsync_directories_is_named_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fail_fsync(monkeypatch, errno.EINVAL)
    with caplog.at_level(logging.WARNING, logger="elastrain"):
        fsync_dir(str(tmp_path))
        fsync_dir(str(tmp_path))
    unsupported = [r.getMessage() for r in caplog.records if "event=fsync_dir_unsupported" in r.getMessage()]
    assert len(unsupported) == 1 and "cannot fsync a directory" in unsupported[0], caplog.text


def test_a_new_root_is_made_durable_in_its_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = record_fsyncs(monkeypatch)
    LocalStorage().makedirs(str(tmp_path / "a" / "root"))
    assert synced == [str(tmp_path), str(tmp_path / "a")]


def c_at(step: int, generation: int | None, at: float | None) -> Candidate:
    return Candidate(StepDir(step, f"/r/step-{step}", True), generation, at)


@pytest.mark.parametrize(
    ("candidates", "claims", "order", "skipped"),
    [
        # generation and step agree: newest step first
        ([c_at(1, 0, 1.0), c_at(2, 0, 2.0), c_at(3, 1, 5.0)], {0: 0.0, 1: 4.0}, [3, 2, 1], []),
        # a stale world (generation 0) went on past the newer world's restore point: the newer world's steps first
        ([c_at(10, 0, 1.0), c_at(12, 0, 2.0), c_at(11, 1, 9.0)], {0: 0.0, 1: 1.5}, [11, 12, 10], [12]),
        # ... and a stale step committed after the claim is skipped even when the newer world has none yet
        ([c_at(10, 0, 1.0), c_at(12, 0, 2.0)], {0: 0.0, 1: 1.5}, [12, 10], [12]),
        # unfenced (older) markers come last; markers whose time is unknown are never skipped
        ([c_at(9, None, 9.0), c_at(2, 1, None), c_at(1, 0, 1.0)], {0: 0.0, 1: 0.5}, [2, 1, 9], [1]),
        # a claim whose time the storage does not give skips nothing
        ([c_at(5, 0, 3.0)], {0: 0.0, 1: None}, [5], []),
    ],
)
def test_restore_order(
    candidates: list[Candidate], claims: dict[int, float | None], order: list[int], skipped: list[int]
) -> None:
    got = restore_order(candidates, claims)
    assert [d.step for d, _ in got] == order
    assert [d.step for d, why in got if why is not None] == skipped
    assert all("after generation 1 claimed the root" in why for _, why in got if why is not None)


def test_restore_prefers_the_newest_generation_and_skips_a_stale_commit(tmp_path: Path) -> None:
    root = str(tmp_path)
    old, _ = proto(tmp_path, generation=0, keep_last=9)
    for step in (10, 12):
        write(old, step, {"a": bytes([step])})
    new, events = proto(tmp_path, generation=1, keep_last=9)
    write(new, 11, {"a": b"n"})  # the newer world restored step 10 and went on
    for _ in range(2):  # the two worlds' claims, whose times restore compares with the markers'
        fence_mod.claim_fresh(root, "job", 0, "", ())
    claim_1 = tmp_path / fence_mod.FENCE_DIR / "gen-000000000001.json"
    t = claim_1.stat().st_mtime
    os.utime(tmp_path / fence_mod.FENCE_DIR / "gen-000000000000.json", (t - 100, t - 100))
    for step, when in ((10, t - 50), (12, t + 5), (11, t + 10)):  # the stale world committed 12 after claim 1
        marker = tmp_path / layout.step_dir_name(step) / layout.MARKER
        os.utime(marker, (when, when))
    loaded: list[int] = []

    def load(d: StepDir, marker: CommitMarker) -> int:
        loaded.append(d.step)
        return marker.step

    assert new.restore(load) == 11 and loaded == [11]
    new.bad_steps.clear()
    (tmp_path / layout.step_dir_name(11) / "a").write_bytes(b"X")  # the newer world's step breaks
    assert new.restore(load) == 10  # not 12: the stale world committed it after the newer world's claim
    reasons = [k["reason"] for e, k in events if e == "checkpoint_fallback"]
    assert any("committed by generation 0 after generation 1 claimed the root" in r for r in reasons), reasons
