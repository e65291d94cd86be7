"""The checkpoint commit protocol: one for every format (DCP, DeepSpeed folders, Trainer folders).

A save of step N, on every rank (each phase a collective on the checkpointer's I/O group, whose
timeout is ``--io-timeout``, because it waits on storage, not on a peer's compute):

1. **prepare** (:meth:`Commit.prepare`): rank 0 decides whether N is to be written. A committed
   step is never overwritten. A leftover of an interrupted save is removed, unless a newer
   generation wrote it (then this world is stale: :class:`StaleGenerationError`). The new step
   directory records the generation that writes it (``elastrain-owner.json``).
2. **write**: the format writes its files, and each rank reports the files *it* wrote, fsynced, with
   their lengths and CRC-32s (DCP computes them while writing, :mod:`elastrain.checkpoint.dcp_io`;
   DeepSpeed and the Trainer's ``torch.save`` files are checksummed by their writer right after).
3. **commit** (:meth:`Commit.commit`): rank 0 gathers the reports (or the ranks' errors), checks
   that every expected file was reported, checks the fence (:func:`elastrain.checkpoint.fence.check`:
   a newer world claimed the root), writes the commit marker with the generation, and broadcasts
   the outcome: every rank raises the same :class:`CheckpointSaveError`, naming the path and the
   cause, when the save failed. Then rank 0 applies retention.
4. **verify** (:meth:`Commit.verify`): at restore every rank checks its share of the marker's
   files: their lengths, and the CRC-32 of those the format cannot check while it loads them.
5. **agree** (:meth:`Commit.restore`): from the newest step directory down, every rank's verdict on
   verification and then on the format's own load; the first step all ranks accept is restored.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from elastrain.checkpoint import fence, layout
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.layout import CommitMarker, FileEntry, Naming, StepDir
from elastrain.checkpoint.storage import Storage, check_shared
from elastrain.errors import CheckpointCorruptError, CheckpointSaveError, StaleGenerationError

OWNER = "elastrain-owner.json"
# Files of the protocol itself: never part of a format's file list.
PROTOCOL_FILES = frozenset({layout.MARKER, OWNER})

T = TypeVar("T")


def may_remove_leftover(owner_generation: int | None, generation: int | None) -> bool:
    """Whether a world of ``generation`` may delete an uncommitted step directory ``owner_generation`` wrote.

    Pure. Only leftovers of older generations, or of its own, are removed; an unfenced world (or an
    unowned leftover, written before generations existed) removes any.
    """
    if generation is None or owner_generation is None:
        return True
    return owner_generation <= generation


def merge_reports(
    reports: Iterable[Mapping[str, FileEntry]], expected: Iterable[str] | None = None
) -> tuple[dict[str, FileEntry], list[str]]:
    """Pure: every rank's files in one map, and the problems (a file reported twice differently, one missing)."""
    entries: dict[str, FileEntry] = {}
    problems: list[str] = []
    for report in reports:
        for name, entry in report.items():
            if name in entries and entries[name] != entry:
                problems.append(f"{name} was reported by two ranks with different contents")
            entries[name] = entry
    if expected is not None:
        missing = sorted(set(expected) - set(entries))
        if missing:
            shown = ", ".join(missing[:5]) + (f" ... ({len(missing)} in all)" if len(missing) > 5 else "")
            problems.append(f"no rank reported writing {shown}")
    return entries, problems


def entry_of(data: bytes) -> FileEntry:
    """The length and CRC-32 of bytes about to be written (a small file written in one piece)."""
    return FileEntry(size=len(data), crc32=zlib.crc32(data))


def fsync_and_checksum(path: str, checksum: bool = True) -> FileEntry:
    """Make a local file this rank wrote durable and checksum it (it is still in the page cache)."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        if checksum:
            while chunk := f.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        else:
            size = os.fstat(f.fileno()).st_size
        os.fsync(f.fileno())
    return FileEntry(size=size, crc32=crc if checksum else None)


def save_error(path: str, step: int, cause: str) -> CheckpointSaveError:
    return CheckpointSaveError(f"checkpoint of step {step} in {path} failed: {cause}")


class Commit:
    """The protocol for one checkpoint root; every rank builds one over the same group."""

    def __init__(
        self,
        root: str,
        storage: Storage,
        group: Group,
        *,
        kind: str,
        generation: int | None = None,
        naming: Naming = layout.STEPS,
        keep_last: int = 3,
        log: Callable[..., None] | None = None,
        fence: Callable[[str, int | None, Storage], None] | None = None,
    ) -> None:
        """``fence(root, generation, storage)`` is called right before the marker is written
        (default :func:`check_fence`)."""
        self.root = root
        self.storage = storage
        self.group = group
        self.kind = kind
        self.generation = generation
        self.naming = naming
        self.keep_last = keep_last
        self._log = log or (lambda *a, **k: None)
        self.bad_steps: set[int] = set()
        self._fence = fence or check_fence
        # One location every rank sees, or a clear error now rather than at the first save (collective).
        if group.distributed:
            check_shared(root, group, storage)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def path(self, step: int) -> str:
        return self.storage.join(self.root, self.naming.name(step))

    # -- 1. prepare ------------------------------------------------------------------------------
    def prepare(self, step: int) -> str | None:
        """Collective: the directory to write ``step`` into (created, owned), or ``None`` if already committed."""
        path = self.path(step)
        decision: tuple[str, str] | None = None
        if self.rank == 0:
            try:
                decision = ("go", "") if self._prepare_on_leader(step, path) else ("skip", "")
            except StaleGenerationError as e:
                decision = ("stale", str(e))
            except OSError as e:
                decision = ("error", f"cannot create the step directory: {type(e).__name__}: {e}")
        verdict, message = self.group.broadcast(decision)
        if verdict == "stale":
            raise StaleGenerationError(message)
        if verdict == "error":
            raise save_error(path, step, message)
        return path if verdict == "go" else None

    def _prepare_on_leader(self, step: int, path: str) -> bool:
        st = self.storage
        if st.exists(path):
            if step not in self.bad_steps and st.exists(st.join(path, layout.MARKER)):
                self._log("checkpoint_save_skipped", step_dir=path, why="already committed; never overwritten")
                return False
            owner = self.owner(path)
            if not may_remove_leftover(owner, self.generation):
                raise StaleGenerationError(
                    f"{path} is being written by generation {owner}, newer than this world's {self.generation}: "
                    "a newer world of this run took over the checkpoint root; this one must stop"
                )
            why = "failed verification at restore; replaced" if step in self.bad_steps else "incomplete leftover"
            self._log("checkpoint_purged", removed=path, why=why, owner_generation=owner)
            layout.remove_step_dir(path, st)
            self.bad_steps.discard(step)
        st.makedirs(path)
        owner_data = {"generation": self.generation, "created_at": time.time(), "kind": self.kind}
        st.write_atomic(st.join(path, OWNER), json.dumps(owner_data).encode())
        return True

    def owner(self, path: str) -> int | None:
        """The generation that created step directory ``path`` (``None``: unknown or unfenced)."""
        try:
            raw = json.loads(self.storage.read_bytes(self.storage.join(path, OWNER)))
            value = raw.get("generation")
            return None if value is None else int(value)
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    # -- 3. commit -------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        path: str,
        report: Mapping[str, FileEntry] | None,
        error: str | None = None,
        *,
        expected: Iterable[str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CommitMarker:
        """Collective: commit ``path`` from every rank's ``report`` of the files it wrote (or its ``error``).

        ``expected`` (rank 0's) are the files that must have been reported. Raises
        :class:`CheckpointSaveError` on every rank if any rank failed or the marker could not be
        written, and :class:`StaleGenerationError` if a newer world claimed the root.
        """
        parts: list[tuple[dict[str, FileEntry] | None, str | None]] = self.group.all_gather(
            (dict(report) if report is not None else None, error)
        )
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            outcome = self._commit_on_leader(step, path, parts, expected, extra)
        verdict, value = self.group.broadcast(outcome)
        if verdict == "stale":
            raise StaleGenerationError(value)
        if verdict == "error":
            raise save_error(path, step, value)
        if self.rank == 0:
            self.purge()
        marker: CommitMarker = value
        return marker

    def _commit_on_leader(
        self,
        step: int,
        path: str,
        parts: list[tuple[dict[str, FileEntry] | None, str | None]],
        expected: Iterable[str] | None,
        extra: Mapping[str, Any] | None,
    ) -> tuple[str, Any]:
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(parts) if err is not None]
        if errors:
            return "error", "; ".join(errors)
        entries, problems = merge_reports((rep or {} for rep, _ in parts), expected)
        if problems:
            return "error", "; ".join(problems)
        marker = CommitMarker(
            step=step,
            world_size=self.world_size,
            files=entries,
            kind=self.kind,
            extra=dict(extra or {}),
            generation=self.generation,
        )
        try:
            self._fence(self.root, self.generation, self.storage)
            layout.write_commit_marker(path, marker, self.storage)
        except StaleGenerationError as e:
            return "stale", str(e)
        except OSError as e:
            return "error", f"cannot write the commit marker: {type(e).__name__}: {e}"
        return "ok", marker

    # -- 4. verify, 5. agree ---------------------------------------------------------------------
    def candidates(self) -> list[StepDir]:
        """Collective: rank 0's listing of the step directories, oldest first."""
        dirs = layout.list_step_dirs(self.root, self.storage, self.naming) if self.rank == 0 else None
        listed: list[StepDir] = self.group.broadcast(dirs)
        return listed

    def verify(self, d: StepDir, read_crc: Callable[[str, FileEntry], bool]) -> CommitMarker | str:
        """Collective: the marker of ``d`` if every rank found its share intact, else the first problem.

        Every rank checks the lengths of its share of the files, and reads those for which
        ``read_crc(name, entry)`` is true to check their CRC-32 (the format checks the rest as it loads).
        """
        found: CommitMarker | str
        if self.rank == 0:
            try:
                found = layout.read_commit_marker(d.path, self.storage)
            except CheckpointCorruptError as e:
                found = str(e)
            except OSError as e:
                found = f"{d.path}: {type(e).__name__}: {e}"
        marker: CommitMarker | str = self.group.broadcast(found if self.rank == 0 else None)
        if isinstance(marker, str):
            return marker
        problem: str | None = None
        mine = {n: marker.files[n] for n in layout.share(list(marker.files), self.rank, self.world_size)}
        try:
            sized = layout.verify_files(d.path, mine, checksum=False, storage=self.storage)
            to_read = {n: e for n, e in mine.items() if read_crc(n, e)}
            crcs = layout.verify_files(d.path, to_read, checksum=True, storage=self.storage) if not sized else []
            if sized or crcs:
                problem = f"{d.path}: " + "; ".join(sized or crcs)
        except OSError as e:
            problem = f"{d.path}: {type(e).__name__}: {e}"
        return self.agree(problem) or marker

    def agree(self, problem: str | None) -> str | None:
        """Collective: the first problem any rank reports, or ``None`` when none does."""
        return next((p for p in self.group.all_gather(problem) if p is not None), None)

    def reject(self, d: StepDir, problem: str) -> None:
        self.bad_steps.add(d.step)
        self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problem)

    def restore(
        self,
        load: Callable[[StepDir, CommitMarker], T | None],
        read_crc: Callable[[str, FileEntry], bool] = lambda name, entry: True,
    ) -> T | None:
        """Collective: the first step directory, newest first, that every rank verifies and ``load``s.

        ``load(d, marker)`` is the format's collective load; it returns ``None`` after calling
        :meth:`reject` when the ranks agree it failed (and raises on a mismatch the user must fix).
        """
        for d in reversed(self.candidates()):
            if not d.committed:
                self.reject(d, f"{d.path}: no commit marker {layout.MARKER} (a save that never finished)")
                continue
            verified = self.verify(d, read_crc)
            if isinstance(verified, str):
                self.reject(d, verified)
                continue
            result = load(d, verified)
            if result is None:
                continue
            if self.rank == 0:
                self.purge()
            return result
        return None

    def purge(self) -> None:
        """Rank 0: retention (the newest ``keep_last`` complete checkpoints stay); failures are logged."""
        try:
            dirs = layout.list_step_dirs(self.root, self.storage, self.naming)
            victims = layout.retention_plan(dirs, self.keep_last, self.bad_steps)
            for d in victims:
                if not d.committed and not may_remove_leftover(self.owner(d.path), self.generation):
                    continue
                layout.remove_step_dir(d.path, self.storage)
                self._log("checkpoint_purged", removed=d.path, why="retention" if d.committed else "incomplete")
        except OSError as e:
            self._log("checkpoint_purge_failed", logging.WARNING, error=f"{type(e).__name__}: {e}")


def check_fence(root: str, generation: int | None, storage: Storage) -> None:
    """:func:`elastrain.checkpoint.fence.check`: :class:`StaleGenerationError` if a newer world claimed ``root``."""
    fence.check(root, generation, storage)
