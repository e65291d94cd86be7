"""Steps 4 and 5 of the commit protocol (:mod:`elastrain.checkpoint.commit`): which committed checkpoints a
restore tries, in which order, and whether every rank finds its share of one intact.

Collective over the checkpointer's I/O group: rank 0 lists the step directories and reads each marker,
every rank checks its share of the marker's files (lengths, and the CRC-32 of those the format cannot
check as it loads them), and the ranks agree on the first problem any of them found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from elastrain import fence
from elastrain.checkpoint import layout
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.layout import CommitMarker, FileEntry, Naming, StepDir
from elastrain.errors import CheckpointCorruptError
from elastrain.storage import Storage

P = TypeVar("P")


def candidates(
    group: Group, root: str, storage: Storage, naming: Naming
) -> tuple[list[tuple[StepDir, str | None]], list[StepDir]]:
    """Collective: rank 0's listing: the committed step directories in restore order (:func:`layout.restore_order`),
    each with why it is skipped (or None), and the uncommitted ones, oldest first."""
    listing: list[Any] | None = None
    if group.rank == 0:
        dirs = layout.list_step_dirs(root, storage, naming)
        committed = [_candidate(d, storage) for d in dirs if d.committed]
        order = layout.restore_order(committed, fence.claim_times(root, storage))
        listing = [
            [[d.step, d.path, why] for d, why in order],
            [[d.step, d.path] for d in dirs if not d.committed],
        ]
    ordered, uncommitted = group.broadcast(listing)
    return (
        [(StepDir(int(step), str(path), True), why) for step, path, why in ordered],
        [StepDir(int(step), str(path), False) for step, path in uncommitted],
    )


def _candidate(d: StepDir, storage: Storage) -> layout.Candidate:
    """Rank 0: a committed step directory's generation and commit time (unknown where its marker is unreadable:
    verification then rejects it)."""
    marker_path = storage.join(d.path, layout.MARKER)
    try:
        generation = layout.read_commit_marker(d.path, storage).generation
        return layout.Candidate(d, generation, storage.mtime(marker_path))
    except (CheckpointCorruptError, OSError):
        return layout.Candidate(d, None, None)


def verify(
    group: Group, storage: Storage, d: StepDir, read_crc: Callable[[str, FileEntry], bool]
) -> CommitMarker | str:
    """Collective: the marker of ``d`` if every rank found its share intact, else the first problem.

    Every rank checks the lengths of its share of the files, and reads those for which
    ``read_crc(name, entry)`` is true to check their CRC-32 (the format checks the rest as it loads).
    """
    found: dict[str, str] | None = None
    if group.rank == 0:
        try:
            found = {"marker": layout.read_commit_marker(d.path, storage).to_json().decode()}
        except CheckpointCorruptError as e:
            found = {"problem": str(e)}
        except OSError as e:
            found = {"problem": f"{d.path}: {type(e).__name__}: {e}"}
    answer: dict[str, str] = group.broadcast(found)
    if "problem" in answer:
        return answer["problem"]
    marker = CommitMarker.from_json(answer["marker"].encode(), d.path)
    problem: str | None = None
    mine = {n: marker.files[n] for n in layout.share(list(marker.files), group.rank, group.world_size)}
    try:
        sized = layout.verify_files(d.path, mine, checksum=False, storage=storage)
        to_read = {n: e for n, e in mine.items() if read_crc(n, e)}
        crcs = layout.verify_files(d.path, to_read, checksum=True, storage=storage) if not sized else []
        if sized or crcs:
            problem = f"{d.path}: " + "; ".join(sized or crcs)
    except OSError as e:
        problem = f"{d.path}: {type(e).__name__}: {e}"
    return agree(group, problem) or marker


def agree(group: Group, problem: P | None) -> P | None:
    """Collective: the first problem any rank reports (plain data: a message, or a list), or ``None``."""
    first: P | None = next((p for p in group.all_gather(problem) if p is not None), None)
    return first
