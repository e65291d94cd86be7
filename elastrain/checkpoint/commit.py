"""The checkpoint commit protocol: one for every format (DCP, DeepSpeed folders, Trainer folders).

A save of step N, on every rank (each phase a collective on the checkpointer's I/O group, whose
timeout is ``--io-timeout``, because it waits on storage, not on a peer's compute):

0. **claim** (once, before the first restore or save; only where the workers fence the root
   themselves, :func:`elastrain.fence.worker_world`): rank 0 claims this world's
   generation in the root; a world that lost the root to a newer one exits (``WorldSupersededExit``).
1. **prepare** (:meth:`Commit.prepare`): rank 0 checks the fence and decides whether N is to be
   written. A committed step is never overwritten. A leftover of an interrupted save is removed,
   unless a newer generation wrote it (then this world is stale: :class:`StaleGenerationError`). The
   new step directory records the generation that writes it (``elastrain-owner.json``).
2. **write**: the format writes its files, and each rank reports the files *it* wrote, fsynced, with
   their lengths and CRC-32s (DCP computes them while writing, :mod:`elastrain.checkpoint.dcp_io`;
   DeepSpeed and the Trainer's ``torch.save`` files are checksummed by their writer right after).
3. **commit** (:meth:`Commit.commit`): rank 0 gathers the reports (or the ranks' errors), checks
   that every expected file was reported, checks the fence (:func:`elastrain.fence.check`:
   a newer world claimed the root), fsyncs the step directory, writes the commit marker with the
   generation, and checks the fence again: a marker that raced a newer world's claim is withdrawn.
   It broadcasts the outcome: every rank raises the same :class:`CheckpointSaveError`, naming the
   path and the cause, when the save failed. Then rank 0 applies retention.
4. **verify** (:meth:`Commit.verify`, :mod:`elastrain.checkpoint.verify`): at restore every rank checks
   its share of the marker's files: their lengths, and the CRC-32 of those the format cannot check
   while it loads them.
5. **agree** (:meth:`Commit.restore`): newest generation first, then newest step
   (:func:`elastrain.checkpoint.layout.restore_order`), every rank's verdict on verification and
   then on the format's own load; the first step all ranks accept is restored.

Everything the ranks exchange is plain data (:mod:`elastrain.wire`), never a pickle.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from elastrain import fence
from elastrain.checkpoint import layout
from elastrain.checkpoint import verify as verification
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.layout import CommitMarker, FileEntry, Naming, StepDir
from elastrain.errors import (
    CheckpointSaveError,
    StaleGenerationError,
    WorldSupersededExit,
)
from elastrain.fence import World
from elastrain.storage import Storage, check_shared

OWNER = "elastrain-owner.json"
# Files of the protocol itself: never part of a format's file list.
PROTOCOL_FILES = frozenset({layout.MARKER, OWNER})

T = TypeVar("T")
P = TypeVar("P")


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
        claim_as: World | None = None,
    ) -> None:
        """``fence(root, generation, storage)`` is called at prepare and around the marker's write
        (default :func:`check_fence`). ``claim_as``: the world claims its own generation in ``root``
        before its first restore or save (the launcher claimed none there; see
        :func:`elastrain.fence.worker_world`), and ``generation`` is then the claim's."""
        self.root = root
        self.storage = storage
        self.group = group
        self.kind = kind
        self.claim_as = claim_as
        self.generation = generation if claim_as is None else None
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

    # -- 0. claim --------------------------------------------------------------------------------
    def claim(self) -> int | None:
        """Collective, once: this world's generation in the root, claimed where the workers fence it themselves
        (:class:`elastrain.fence.WorkerClaim`); a world that lost the root raises :meth:`_stale`'s."""
        if self.claim_as is None or self.generation is not None:
            return self.generation
        try:
            self.generation = fence.WorkerClaim(self.root, self.claim_as, self.storage).claim(self.group)
        except StaleGenerationError as e:
            raise self._stale(str(e)) from None
        self._log("generation_claimed", generation=self.generation, root=self.root, by="workers")
        return self.generation

    def _stale(self, message: str) -> BaseException:
        """What a world that lost the root raises: the launcher's fence stops its workers itself; with the workers'
        own fence, the workers exit with EX_CONFIG (one line says why), so that no restart claims the root back."""
        if self.claim_as is None:
            return StaleGenerationError(message)
        if self.rank == 0:
            self._log(
                "world_superseded",
                logging.ERROR,
                root=self.root,
                generation=self.generation,
                why=message,
                action="this world stops: its workers exit with EX_CONFIG (78) and elastrain-run ends its nodes",
            )
        return WorldSupersededExit(message)

    def ensure_current(self) -> None:
        """Collective: raise (as :meth:`prepare` would) if a newer world claimed the root. For a format whose files
        are written before the commit without :meth:`prepare` (the Trainer's): a stale world writes nothing."""
        self.claim()
        verdict: str | None = None
        if self.rank == 0:
            try:
                self._fence(self.root, self.generation, self.storage)
                verdict = ""
            except StaleGenerationError as e:
                verdict = str(e)
            except OSError:
                verdict = ""  # storage trouble: the commit reports it, naming the step
        stale: str = self.group.broadcast(verdict)
        if stale:
            raise self._stale(stale)

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
            raise self._stale(message)
        if verdict == "error":
            raise save_error(path, step, message)
        return path if verdict == "go" else None

    def _prepare_on_leader(self, step: int, path: str) -> bool:
        st = self.storage
        # A stale world writes nothing: its files could land in a directory the newer world is writing.
        self._fence(self.root, self.generation, st)
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
        self.claim()
        mine = None if report is None else {name: layout.entry_to_json(e) for name, e in report.items()}
        parts: list[list[Any]] = self.group.all_gather([mine, error])
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            reports = [
                (None if rep is None else {n: layout.entry_from_json(e) for n, e in rep.items()}, err)
                for rep, err in parts
            ]
            outcome = self._commit_on_leader(step, path, reports, expected, extra)
        verdict, value = self.group.broadcast(outcome)
        if verdict == "stale":
            raise self._stale(value)
        if verdict == "error":
            raise save_error(path, step, value)
        if self.rank == 0:
            self.purge()
        return CommitMarker.from_json(str(value).encode(), path)

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
            self.storage.sync_tree(path)  # every file's directory entry durable before the marker says "complete"
            layout.write_commit_marker(path, marker, self.storage)
        except StaleGenerationError as e:
            return "stale", str(e)
        except OSError as e:
            return "error", f"cannot write the commit marker: {type(e).__name__}: {e}"
        try:
            # A newer world may have claimed the root between the check above and the marker's rename.
            self._fence(self.root, self.generation, self.storage)
        except StaleGenerationError as e:
            return "stale", f"{e} (its commit of step {step} raced the claim: {self._withdraw(path)})"
        except OSError as e:  # the marker stands; restore skips it if it raced a claim
            self._log(
                "fence_check_failed", logging.WARNING, root=self.root, step=step, error=f"{type(e).__name__}: {e}"
            )
        return "ok", marker.to_json().decode()

    def _withdraw(self, path: str) -> str:
        """Remove the marker this (stale) world just wrote; what became of it, for the error message."""
        try:
            self.storage.remove(self.storage.join(path, layout.MARKER))
            self.storage.sync_tree(path)
        except OSError as e:
            return f"its marker could not be withdrawn ({type(e).__name__}: {e}); restore skips it"
        return "its marker was withdrawn"

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
    """:func:`elastrain.fence.check`: :class:`StaleGenerationError` if a newer world claimed ``root``."""
    fence.check(root, generation, storage)
