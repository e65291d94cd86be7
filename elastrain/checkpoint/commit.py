"""The checkpoint commit protocol: one for every format (DCP, DeepSpeed folders, Trainer folders).

A save of step N, on every rank (each phase a collective on the checkpointer's I/O group, whose
timeout is ``--io-timeout``, because it waits on storage, not on a peer's compute):

0. **claim** (once, before the first restore or save; only where the workers fence the root
   themselves, :func:`elastrain.fence.worker_world`): rank 0 claims this world's
   generation in the root; a world that lost the root to a newer one exits (``WorldSupersededExit``)
   (:mod:`elastrain.checkpoint.world_fence`).
1. **prepare** (:meth:`Commit.prepare`): rank 0 checks the fence and decides whether N is to be
   written. A committed step is never overwritten. A leftover of an interrupted save is removed,
   unless a newer generation wrote it (then this world is stale: :class:`StaleGenerationError`). The
   new step directory records the generation that writes it (``elastrain-owner.json``,
   :mod:`elastrain.checkpoint.step_owner`).
2. **write**: the format writes its files, and each rank reports the files *it* wrote, fsynced, with
   their lengths and CRC-32s (DCP computes them while writing, :mod:`elastrain.checkpoint.dcp_io`;
   DeepSpeed and the Trainer's ``torch.save`` files are checksummed by their writer right after).
3. **commit** (:meth:`Commit.commit`): rank 0 gathers the reports (or the ranks' errors), checks
   that every expected file was reported, checks the fence (:func:`elastrain.fence.check`:
   a newer world claimed the root), fsyncs the step directory, writes the commit marker with the
   generation, and checks the fence again: a marker that raced a newer world's claim is withdrawn
   (:mod:`elastrain.checkpoint.marker_write`). It broadcasts the outcome: every rank raises the same
   :class:`CheckpointSaveError`, naming the path and the cause, when the save failed. Then rank 0
   applies retention.
4. **verify** (:meth:`Commit.verify`, :mod:`elastrain.checkpoint.verify`): at restore every rank checks
   its share of the marker's files: their lengths, and the CRC-32 of those the format cannot check
   while it loads them.
5. **agree** (:meth:`Commit.restore`): newest generation first, then newest step
   (:func:`elastrain.checkpoint.layout.restore_order`), every rank's verdict on verification and
   then on the format's own load; the first step all ranks accept is restored.

Everything the ranks exchange is plain data (:mod:`elastrain.wire`), never a pickle.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from elastrain.checkpoint import layout
from elastrain.checkpoint import verify as verification
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.layout import CommitMarker, FileEntry, Naming, StepDir
from elastrain.checkpoint.marker_write import merge_reports, write_marker
from elastrain.checkpoint.step_owner import OWNER, may_remove_leftover, read_owner, write_owner
from elastrain.checkpoint.world_fence import WorldFence, check_fence
from elastrain.errors import CheckpointSaveError, StaleGenerationError
from elastrain.fence import World
from elastrain.storage import Storage, check_shared

__all__ = [
    "OWNER",
    "PROTOCOL_FILES",
    "Commit",
    "check_fence",
    "entry_of",
    "fsync_and_checksum",
    "may_remove_leftover",
    "merge_reports",
    "save_error",
]

# Files of the protocol itself: never part of a format's file list.
PROTOCOL_FILES = frozenset({layout.MARKER, OWNER})

T = TypeVar("T")
P = TypeVar("P")


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
        claim_as: World | None = None,
        protect: Callable[[], Iterable[int]] = tuple,
    ) -> None:
        """``fence(root, generation, storage)`` is called at prepare and around the marker's write
        (default :func:`check_fence`). ``claim_as``: the world claims its own generation in ``root``
        before its first restore or save (the launcher claimed none there; see
        :func:`elastrain.fence.worker_world`), and ``generation`` is then the claim's. ``protect``: steps
        retention keeps besides the newest ``keep_last`` (asked at each purge)."""
        self.root = root
        self.storage = storage
        self.group = group
        self.kind = kind
        self.naming = naming
        self.keep_last = keep_last
        self.protect = protect
        self._log = log or (lambda *a, **k: None)
        self.bad_steps: set[int] = set()
        self.world_fence = WorldFence(
            root, storage, group, generation=generation, log=self._log, check=fence, claim_as=claim_as
        )
        # One location every rank sees, or a clear error now rather than at the first save (collective).
        if group.distributed:
            check_shared(root, group, storage)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def generation(self) -> int | None:
        """This world's generation in the root (``None``: unfenced, or not claimed yet)."""
        return self.world_fence.generation

    @generation.setter
    def generation(self, generation: int | None) -> None:
        self.world_fence.generation = generation

    def path(self, step: int) -> str:
        return self.storage.join(self.root, self.naming.name(step))

    # -- 0. claim (:mod:`elastrain.checkpoint.world_fence`) -------------------------------------
    def claim(self) -> int | None:
        """Collective, once: this world's generation in the root, claimed where the workers fence it themselves
        (:meth:`WorldFence.claim`)."""
        return self.world_fence.claim()

    # -- 1. prepare ------------------------------------------------------------------------------
    def prepare(self, step: int) -> str | None:
        """Collective: the directory to write ``step`` into (created, owned), or ``None`` if already committed."""
        self.claim()
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
            raise self.world_fence.stale(message)
        if verdict == "error":
            raise save_error(path, step, message)
        return path if verdict == "go" else None

    def _prepare_on_leader(self, step: int, path: str) -> bool:
        st = self.storage
        # A stale world writes nothing: its files could land in a directory the newer world is writing.
        self.world_fence.check()
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
        write_owner(path, self.generation, self.kind, st)
        return True

    def owner(self, path: str) -> int | None:
        """The generation that created step directory ``path`` (``None``: unknown or unfenced)."""
        return read_owner(path, self.storage)

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
        self.claim()
        mine = None if report is None else {name: layout.entry_to_json(e) for name, e in report.items()}
        parts: list[list[Any]] = self.group.all_gather([mine, error])
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            reports = [
                (None if rep is None else {n: layout.entry_from_json(e) for n, e in rep.items()}, err)
                for rep, err in parts
            ]
            outcome = write_marker(self.world_fence, step, path, reports, expected, extra, kind=self.kind)
        verdict, value = self.group.broadcast(outcome)
        if verdict == "stale":
            raise self.world_fence.stale(value)
        if verdict == "error":
            raise save_error(path, step, value)
        if self.rank == 0:
            self.purge()
        return CommitMarker.from_json(str(value).encode(), path)

    # -- 4. verify, 5. agree ---------------------------------------------------------------------
    def candidates(self) -> tuple[list[tuple[StepDir, str | None]], list[StepDir]]:
        """Collective: the committed step directories in restore order, and the uncommitted ones
        (:func:`elastrain.checkpoint.verify.candidates`)."""
        return verification.candidates(self.group, self.root, self.storage, self.naming)

    def verify(self, d: StepDir, read_crc: Callable[[str, FileEntry], bool]) -> CommitMarker | str:
        """Collective: the marker of ``d`` if every rank found its share intact, else the first problem
        (:func:`elastrain.checkpoint.verify.verify`)."""
        return verification.verify(self.group, self.storage, d, read_crc)

    def agree(self, problem: P | None) -> P | None:
        """Collective: the first problem any rank reports (plain data: a message, or a list), or ``None``."""
        return verification.agree(self.group, problem)

    def reject(self, d: StepDir, problem: str, *, tampered: bool = False) -> None:
        """Skip ``d`` at this restore (and let the next save of its step replace it). A checkpoint refused as
        tampered is reported loudly (``event=checkpoint_tampered``): someone may have written it on purpose."""
        self.bad_steps.add(d.step)
        if tampered:
            self._log(
                "checkpoint_tampered",
                logging.ERROR,
                step=d.step,
                bad=d.path,
                reason=problem,
                action="not loaded; an older checkpoint is restored if one loads",
                hint="find out who can write the checkpoint root, and move this step directory away to inspect it",
            )
            return
        self._log("checkpoint_fallback", logging.WARNING, bad=d.path, reason=problem)

    def restore(
        self,
        load: Callable[[StepDir, CommitMarker], T | None],
        read_crc: Callable[[str, FileEntry], bool] = lambda name, entry: True,
    ) -> T | None:
        """Collective: the first step directory (in :func:`layout.restore_order`) every rank verifies and ``load``s.

        ``load(d, marker)`` is the format's collective load; it returns ``None`` after calling
        :meth:`reject` when the ranks agree it failed (and raises on a mismatch the user must fix).
        Where the workers fence the root themselves, this world claims its generation first, so that no
        world that came before it commits after it chose what to restore.
        """
        self.claim()
        ordered, uncommitted = self.candidates()
        pending = sorted(uncommitted, key=lambda d: d.step, reverse=True)
        for d, skip in ordered:
            while pending and pending[0].step > d.step:
                self._reject_uncommitted(pending.pop(0))
            if skip is not None:
                self.reject(d, skip)
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
        for d in pending:
            self._reject_uncommitted(d)
        return None

    def _reject_uncommitted(self, d: StepDir) -> None:
        self.reject(d, f"{d.path}: no commit marker {layout.MARKER} (a save that never finished)")

    def purge(self) -> None:
        """Rank 0: retention (the newest ``keep_last`` complete checkpoints stay, and the protected); failures are
        logged."""
        try:
            dirs = layout.list_step_dirs(self.root, self.storage, self.naming)
            victims = layout.retention_plan(dirs, self.keep_last, self.bad_steps, self.protect())
            for d in victims:
                if not d.committed and not may_remove_leftover(self.owner(d.path), self.generation):
                    continue
                layout.remove_step_dir(d.path, self.storage)
                self._log("checkpoint_purged", removed=d.path, why="retention" if d.committed else "incomplete")
        except OSError as e:
            self._log("checkpoint_purge_failed", logging.WARNING, error=f"{type(e).__name__}: {e}")
