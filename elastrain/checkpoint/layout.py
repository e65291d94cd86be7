"""Step directories, commit markers, verification and retention: the format-independent half.

A checkpoint root holds one directory per step, never overwritten::

    <root>/step-0000000100/          # written by any format: DCP, DeepSpeed, ...
    <root>/step-0000000100/elastrain-commit.json   # the commit marker, written last

A step directory counts only once its commit marker exists, and the marker is written (atomically,
by one process) only after every rank confirmed that its files are on disk. The marker lists every
file of the checkpoint with its length and CRC-32, so a loader can tell a complete checkpoint from
one that was truncated, corrupted or partly deleted. Nothing here imports torch: engineer-facing
users such as the DeepSpeed integration call these functions on their own checkpoint folders.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastrain.errors import CheckpointCorruptError
from elastrain.storage import Storage, storage_for

STEP_PREFIX = "step-"
MARKER = "elastrain-commit.json"
MARKER_FORMAT = 1


@dataclass(frozen=True)
class Naming:
    """How a format names its step directories: ``step-0000000100`` (elastrain) or ``checkpoint-100`` (Trainer)."""

    prefix: str
    pad: int

    def name(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"a checkpoint step must be >= 0, got {step}")
        return f"{self.prefix}{step:0{self.pad}d}" if self.pad else f"{self.prefix}{step}"

    def parse(self, name: str) -> int | None:
        m = re.match(rf"^{re.escape(self.prefix)}(\d+)$", name)
        return int(m.group(1)) if m else None


STEPS = Naming(STEP_PREFIX, 10)


def step_dir_name(step: int) -> str:
    """``step-0000000100``: zero-padded so that names sort like steps."""
    return STEPS.name(step)


def parse_step_dir_name(name: str) -> int | None:
    """The step of a step directory's name, or ``None`` for any other name."""
    return STEPS.parse(name)


@dataclass(frozen=True)
class Chunk:
    """One stored item inside a file (a DCP tensor shard): where it is and its CRC-32, checked as it is read."""

    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: int | None = None
    chunks: tuple[Chunk, ...] = ()


@dataclass(frozen=True)
class CommitMarker:
    """What the commit marker records about one complete checkpoint."""

    step: int
    world_size: int
    files: Mapping[str, FileEntry]
    kind: str = "dcp"
    created_at: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)
    generation: int | None = None  # the fencing token of the world that committed it (None: unfenced, or older)

    def to_json(self) -> bytes:
        payload = {
            "format": MARKER_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "kind": self.kind,
            "created_at": self.created_at,
            "generation": self.generation,
            "files": {name: entry_to_json(e) for name, e in sorted(self.files.items())},
            "extra": dict(self.extra),
        }
        return json.dumps(payload, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitMarker:
        try:
            raw = json.loads(data)
            if raw.get("format") != MARKER_FORMAT:
                raise ValueError(f"unknown marker format {raw.get('format')!r}")
            files = {str(name): entry_from_json(e) for name, e in raw["files"].items()}
            generation = raw.get("generation")
            return cls(
                step=int(raw["step"]),
                world_size=int(raw["world_size"]),
                files=files,
                kind=str(raw.get("kind", "dcp")),
                created_at=float(raw.get("created_at", 0.0)),
                extra=dict(raw.get("extra") or {}),
                generation=None if generation is None else int(generation),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: unreadable commit marker ({e})") from None


def entry_to_json(e: FileEntry) -> dict[str, Any]:
    """A file entry as plain data (in the marker, and on its way to rank 0)."""
    out: dict[str, Any] = {"size": e.size, "crc32": e.crc32}
    if e.chunks:
        out["chunks"] = [[c.offset, c.length, c.crc32] for c in e.chunks]
    return out


def entry_from_json(e: Mapping[str, Any]) -> FileEntry:
    """Inverse of :func:`entry_to_json`."""
    chunks = tuple(Chunk(int(o), int(n), int(c)) for o, n, c in e.get("chunks") or ())
    return FileEntry(size=int(e["size"]), crc32=None if e.get("crc32") is None else int(e["crc32"]), chunks=chunks)


@dataclass(frozen=True)
class StepDir:
    step: int
    path: str
    committed: bool


@dataclass(frozen=True)
class Candidate:
    """A committed step directory as restore sees it: who committed it, and when (by the storage's clock)."""

    step_dir: StepDir
    generation: int | None
    committed_at: float | None


def restore_order(
    candidates: Sequence[Candidate], claimed_at: Mapping[int, float | None]
) -> list[tuple[StepDir, str | None]]:
    """Pure: the committed step directories in the order restore tries them, each with why it is skipped (or None).

    Newest generation first, then newest step. A world restores the newest checkpoint right after its
    claim and goes forward from it, so generation and step order agree; where they disagree, the older
    generation's higher steps are a superseded world's, and the newer generation's steps come first. A
    step that generation G committed after a newer generation claimed the root (its marker written later
    than that claim, ``claimed_at``, by the storage's own clock) raced the claim: its writer would have
    withdrawn it had it lived to check the fence again, so it is skipped. Unfenced (older) markers come last.
    """
    out: list[tuple[StepDir, str | None]] = []
    ordered = sorted(
        candidates,
        key=lambda c: (c.generation if c.generation is not None else -1, c.step_dir.step),
        reverse=True,
    )
    for c in ordered:
        why: str | None = None
        if c.generation is not None and c.committed_at is not None:
            newer = [(t, g) for g, t in claimed_at.items() if g > c.generation and t is not None]
            if newer:
                at, by = min(newer)
                if c.committed_at > at:
                    why = (
                        f"{c.step_dir.path}: committed by generation {c.generation} after generation {by} claimed "
                        "the root (a superseded world's commit that raced the claim); not restored"
                    )
        out.append((c.step_dir, why))
    return out


def list_step_dirs(root: str, storage: Storage | None = None, naming: Naming = STEPS) -> list[StepDir]:
    """Every step directory under ``root``, oldest first; ``committed`` means its marker exists."""
    st = storage or storage_for(root)
    out = []
    for name in st.listdir(root):
        step = naming.parse(name)
        if step is None:
            continue
        path = st.join(root, name)
        out.append(StepDir(step=step, path=path, committed=st.exists(st.join(path, MARKER))))
    return sorted(out, key=lambda d: d.step)


def manifest(
    step_path: str, files: Iterable[str] | None = None, checksum: bool = True, storage: Storage | None = None
) -> dict[str, FileEntry]:
    """Length (and CRC-32) of ``files`` in a step directory; every file but the marker when ``None``."""
    st = storage or storage_for(step_path)
    names = list(files) if files is not None else [f for f in st.walk_files(step_path) if f != MARKER]
    out = {}
    for name in names:
        path = st.join(step_path, name)
        out[name] = FileEntry(size=st.size(path), crc32=st.crc32(path) if checksum else None)
    return out


def write_commit_marker(step_path: str, marker: CommitMarker, storage: Storage | None = None) -> str:
    """Commit a step directory. Call once, from one process, after every rank confirmed its files."""
    st = storage or storage_for(step_path)
    path = st.join(step_path, MARKER)
    st.write_atomic(path, marker.to_json())
    return path


def read_commit_marker(step_path: str, storage: Storage | None = None) -> CommitMarker:
    """The marker of a step directory; :class:`CheckpointCorruptError` if it is missing or unreadable."""
    st = storage or storage_for(step_path)
    path = st.join(step_path, MARKER)
    try:
        data = st.read_bytes(path)
    except FileNotFoundError:
        if not st.exists(step_path):
            raise CheckpointCorruptError(f"{step_path}: the directory vanished") from None
        raise CheckpointCorruptError(f"{step_path}: no commit marker {MARKER} (the save never finished)") from None
    return CommitMarker.from_json(data, step_path)


def verify_files(
    step_path: str,
    entries: Mapping[str, FileEntry],
    checksum: bool = True,
    storage: Storage | None = None,
) -> list[str]:
    """Problems found with ``entries`` (missing, wrong length, wrong CRC-32); empty when all are intact."""
    st = storage or storage_for(step_path)
    problems = []
    for name, entry in sorted(entries.items()):
        path = st.join(step_path, name)
        try:
            size = st.size(path)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != entry.size:
            problems.append(f"{name} has {size} bytes, the marker says {entry.size} (truncated or overwritten)")
            continue
        if checksum and entry.crc32 is not None and st.crc32(path) != entry.crc32:
            problems.append(f"{name} fails its CRC-32 check (corrupt)")
    return problems


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The part of ``names`` that ``rank`` verifies or checksums, so that ranks split the reading."""
    return sorted(names)[rank::world_size]


def verify_step(
    step_path: str,
    checksum: bool = True,
    rank: int = 0,
    world_size: int = 1,
    storage: Storage | None = None,
) -> CommitMarker:
    """Check a step directory against its marker; raise :class:`CheckpointCorruptError` naming the problem.

    With ``world_size > 1`` this process checks only its share of the files; the caller combines
    every rank's verdict (any rank that finds a problem rejects the checkpoint).
    """
    st = storage or storage_for(step_path)
    marker = read_commit_marker(step_path, st)
    mine = {name: marker.files[name] for name in share(list(marker.files), rank, world_size)}
    problems = verify_files(step_path, mine, checksum=checksum, storage=st)
    if problems:
        raise CheckpointCorruptError(f"{step_path}: " + "; ".join(problems))
    return marker


def newest_complete(
    root: str, checksum: bool = True, storage: Storage | None = None
) -> tuple[StepDir, CommitMarker, list[tuple[StepDir, str]]] | None:
    """Single-process helper: the newest verified step directory, and the rejected newer ones with why.

    ``None`` when no step directory verifies. Distributed loaders should use :func:`verify_step`
    with their rank's share and agree on the verdict instead.
    """
    st = storage or storage_for(root)
    rejected: list[tuple[StepDir, str]] = []
    for d in reversed(list_step_dirs(root, st)):
        try:
            marker = verify_step(d.path, checksum=checksum, storage=st)
        except CheckpointCorruptError as e:
            rejected.append((d, str(e)))
            continue
        return d, marker, rejected
    return None


def retention_plan(
    dirs: Sequence[StepDir], keep_last: int, bad_steps: Iterable[int] = (), protect: Iterable[int] = ()
) -> list[StepDir]:
    """Which step directories to delete so that ``keep_last`` complete ones remain: the newest, the ``protect`` ed
    ones (the Trainer's best model, as transformers' own rotation keeps it), then the newest others up to
    ``keep_last`` in all (more only when the protected ones are more).

    Pure. Complete = committed and not known bad. It deletes the other complete checkpoints, and incomplete
    or bad ones older than the newest complete one (leftovers of killed saves). It never deletes the newest
    complete checkpoint, nor anything newer than it (a save may be in flight there).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 so that a complete checkpoint always remains, got {keep_last}")
    bad = set(bad_steps)
    ordered = sorted(dirs, key=lambda d: d.step)
    complete = [d for d in ordered if d.committed and d.step not in bad]
    if not complete:
        return []
    newest = complete[-1].step
    kept = {newest} | ({d.step for d in complete} & set(protect))
    for d in reversed(complete):
        if len(kept) >= keep_last:
            break
        kept.add(d.step)
    return [d for d in ordered if d.step < newest and d.step not in kept]


def remove_step_dir(path: str, storage: Storage | None = None) -> None:
    """Delete a step directory, its marker first so that a half-deleted one never looks complete."""
    st = storage or storage_for(path)
    st.remove(st.join(path, MARKER))
    st.remove_tree(path)


def purge(root: str, keep_last: int, bad_steps: Iterable[int] = (), storage: Storage | None = None) -> list[StepDir]:
    """Apply :func:`retention_plan` to ``root``; return what was deleted. Call from one process."""
    st = storage or storage_for(root)
    victims = retention_plan(list_step_dirs(root, st), keep_last, bad_steps)
    for d in victims:
        remove_step_dir(d.path, st)
    return victims
