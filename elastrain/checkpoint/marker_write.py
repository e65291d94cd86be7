"""Rank 0's half of step 3 of the commit protocol (:mod:`elastrain.checkpoint.commit`): the commit marker's write.

Rank 0 merges every rank's report of the files it wrote (or its error), checks that every expected file was
reported, checks the fence (:class:`elastrain.checkpoint.world_fence.WorldFence`), fsyncs the step directory,
writes the commit marker with the generation, and checks the fence again: a marker that raced a newer world's
claim is withdrawn. The outcome is plain data that rank 0 broadcasts: ``("ok", marker JSON)``, ``("error",
cause)`` or ``("stale", message)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from elastrain.checkpoint import layout
from elastrain.checkpoint.layout import CommitMarker, FileEntry
from elastrain.checkpoint.world_fence import WorldFence
from elastrain.errors import StaleGenerationError
from elastrain.storage import Storage


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


def write_marker(
    world: WorldFence,
    step: int,
    path: str,
    parts: list[tuple[dict[str, FileEntry] | None, str | None]],
    expected: Iterable[str] | None,
    extra: Mapping[str, Any] | None,
    *,
    kind: str,
) -> tuple[str, Any]:
    """Rank 0: commit ``path`` from every rank's ``(report, error)`` in ``parts``; the outcome to broadcast."""
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(parts) if err is not None]
    if errors:
        return "error", "; ".join(errors)
    entries, problems = merge_reports((rep or {} for rep, _ in parts), expected)
    if problems:
        return "error", "; ".join(problems)
    marker = CommitMarker(
        step=step,
        world_size=world.group.world_size,
        files=entries,
        kind=kind,
        extra=dict(extra or {}),
        generation=world.generation,
    )
    try:
        world.check()
        world.storage.sync_tree(path)  # every file's directory entry durable before the marker says "complete"
        layout.write_commit_marker(path, marker, world.storage)
    except StaleGenerationError as e:
        return "stale", str(e)
    except OSError as e:
        return "error", f"cannot write the commit marker: {type(e).__name__}: {e}"
    try:
        # A newer world may have claimed the root between the check above and the marker's rename.
        world.check()
    except StaleGenerationError as e:
        return "stale", f"{e} (its commit of step {step} raced the claim: {withdraw(path, world.storage)})"
    except OSError as e:  # the marker stands; restore skips it if it raced a claim
        world.log("fence_check_failed", logging.WARNING, root=world.root, step=step, error=f"{type(e).__name__}: {e}")
    return "ok", marker.to_json().decode()


def withdraw(path: str, storage: Storage) -> str:
    """Remove the marker this (stale) world just wrote; what became of it, for the error message."""
    try:
        storage.remove(storage.join(path, layout.MARKER))
        storage.sync_tree(path)
    except OSError as e:
        return f"its marker could not be withdrawn ({type(e).__name__}: {e}); restore skips it"
    return "its marker was withdrawn"
