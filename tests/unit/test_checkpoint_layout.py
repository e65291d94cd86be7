"""Step directories, commit markers, verification and retention (no torch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastrain.checkpoint import layout
from elastrain.checkpoint.layout import CommitMarker, FileEntry, StepDir
from elastrain.errors import CheckpointCorruptError


def make_step(root: Path, step: int, commit: bool = True, files: dict[str, bytes] | None = None) -> Path:
    path = root / layout.step_dir_name(step)
    path.mkdir(parents=True)
    for name, data in (files or {"a.bin": b"x" * 100, "sub/b.bin": b"y" * 10}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    if commit:
        marker = CommitMarker(step=step, world_size=2, files=layout.manifest(str(path)), kind="test")
        layout.write_commit_marker(str(path), marker)
    return path


def test_step_names_sort_like_steps_and_parse_back() -> None:
    names = [layout.step_dir_name(s) for s in (3, 20, 100)]
    assert names == sorted(names)
    assert [layout.parse_step_dir_name(n) for n in names] == [3, 20, 100]
    assert layout.parse_step_dir_name("step-12.tmp") is None
    assert layout.parse_step_dir_name("latest") is None
    with pytest.raises(ValueError):
        layout.step_dir_name(-1)


def test_marker_round_trips_and_lists_every_file(tmp_path: Path) -> None:
    path = make_step(tmp_path, 7)
    marker = layout.read_commit_marker(str(path))
    assert marker.step == 7 and marker.world_size == 2 and marker.kind == "test"
    assert set(marker.files) == {"a.bin", "sub/b.bin"}
    assert marker.files["a.bin"].size == 100 and marker.files["a.bin"].crc32 is not None
    assert layout.verify_step(str(path)) == marker


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: os.truncate(p / "a.bin", 50), "truncated"),
        (lambda p: (p / "a.bin").write_bytes(b"x" * 99 + b"z"), "CRC-32"),
        (lambda p: (p / "sub" / "b.bin").unlink(), "missing"),
        (lambda p: (p / layout.MARKER).unlink(), "no commit marker"),
        (lambda p: (p / layout.MARKER).write_text("{not json"), "unreadable commit marker"),
    ],
)
def test_verify_names_the_damage(tmp_path: Path, damage: object, words: str) -> None:
    path = make_step(tmp_path, 5)
    damage(path)  # type: ignore[operator]
    with pytest.raises(CheckpointCorruptError, match=words) as err:
        layout.verify_step(str(path))
    assert str(path) in str(err.value)


def test_vanished_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointCorruptError, match="vanished"):
        layout.verify_step(str(tmp_path / layout.step_dir_name(1)))


def test_ranks_verify_disjoint_shares_that_cover_every_file() -> None:
    names = [f"f{i}" for i in range(7)]
    shares = [layout.share(names, r, 3) for r in range(3)]
    assert sorted(n for part in shares for n in part) == sorted(names)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shares) for b in shares[i + 1 :])


def test_newest_complete_skips_damaged_and_uncommitted_ones(tmp_path: Path) -> None:
    make_step(tmp_path, 1)
    make_step(tmp_path, 2)
    os.truncate(make_step(tmp_path, 3) / "a.bin", 1)
    make_step(tmp_path, 4, commit=False)
    found = layout.newest_complete(str(tmp_path))
    assert found is not None
    best, marker, rejected = found
    assert best.step == 2 and marker.step == 2
    assert [d.step for d, _ in rejected] == [4, 3]
    assert layout.newest_complete(str(tmp_path / "nothing")) is None


def d(step: int, committed: bool = True) -> StepDir:
    return StepDir(step=step, path=f"/c/{layout.step_dir_name(step)}", committed=committed)


@pytest.mark.parametrize(
    ("dirs", "keep", "bad", "deleted"),
    [
        ([d(1), d(2), d(3), d(4)], 2, (), [1, 2]),
        ([d(1), d(2)], 3, (), []),
        ([d(1)], 1, (), []),  # never the only complete one
        ([d(1), d(2, False), d(3), d(4, False)], 1, (), [1, 2]),  # 4 may be a save in flight
        ([d(1), d(2), d(3)], 1, {3}, [1]),  # 3 is bad: 2 is the newest complete and stays
        ([d(1, False), d(2, False)], 1, (), []),  # nothing complete: delete nothing
        ([d(5), d(1), d(3)], 2, (), [1]),  # order-independent
    ],
)
def test_retention_plan(dirs: list[StepDir], keep: int, bad: set[int], deleted: list[int]) -> None:
    assert [x.step for x in layout.retention_plan(dirs, keep, bad)] == deleted


@pytest.mark.parametrize(
    ("dirs", "keep", "protect", "deleted"),
    [
        ([d(1), d(2), d(3), d(4)], 2, {1}, [2, 3]),  # the best and the newest: two in all, as transformers keeps
        ([d(1), d(2), d(3), d(4)], 1, {1}, [2, 3]),  # more than keep_last only for the protected
        ([d(1), d(2), d(3), d(4)], 3, {1}, [2]),
        ([d(1), d(2), d(3), d(4)], 2, {4}, [1, 2]),  # the newest is the best
        ([d(1), d(2, False), d(3), d(4)], 1, {2}, [1, 2, 3]),  # an uncommitted folder is never protected
        ([d(1), d(2), d(3)], 1, {7}, [1, 2]),  # a step that is not there protects nothing
    ],
)
def test_retention_keeps_the_protected_steps(
    dirs: list[StepDir], keep: int, protect: set[int], deleted: list[int]
) -> None:
    assert [x.step for x in layout.retention_plan(dirs, keep, (), protect)] == deleted


def test_retention_refuses_to_keep_nothing() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        layout.retention_plan([d(1)], 0)


def test_purge_deletes_old_and_leftover_directories(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        make_step(tmp_path, s)
    make_step(tmp_path, 0, commit=False)
    removed = layout.purge(str(tmp_path), keep_last=2)
    assert [x.step for x in removed] == [0, 1]
    assert [x.step for x in layout.list_step_dirs(str(tmp_path))] == [2, 3]


def test_marker_json_is_stable() -> None:
    m = CommitMarker(step=1, world_size=1, files={"b": FileEntry(2, 3), "a": FileEntry(1)}, created_at=0.0)
    assert CommitMarker.from_json(m.to_json(), "x") == m


def test_fsspec_storage_supports_the_layout() -> None:
    pytest.importorskip("fsspec")
    from elastrain.storage import FsspecStorage

    st = FsspecStorage("memory://x")
    path = "memory://elastrain-test/ck/" + layout.step_dir_name(3)
    st.makedirs(path)
    st.write_atomic(st.join(path, "a.bin"), b"abc")
    marker = CommitMarker(step=3, world_size=1, files=layout.manifest(path, storage=st))
    layout.write_commit_marker(path, marker, st)
    assert layout.verify_step(path, storage=st).files["a.bin"].size == 3
    assert [x.step for x in layout.list_step_dirs("memory://elastrain-test/ck", st) if x.committed] == [3]
