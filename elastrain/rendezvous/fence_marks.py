"""What the job's fencing marks in the checkpoint root say about its worlds, read for the c10d store's choices.

Where a node starts (the running job's published store, or the endpoint's), whether the job finished, whether its
newest world was left by its last node: each read is logged when the root cannot be read, and a mark that is not
signed with the job's secret (when it has one) is not trusted.
"""

from __future__ import annotations

import logging

from elastrain import fence
from elastrain.log import lifecycle
from elastrain.rendezvous.auth import RendezvousAuth


def newest_close(root: str, unknown: int | None, run_id: str, auth: RendezvousAuth) -> int | None:
    """The generation of job ``run_id``'s newest close recorded in ``root`` (-1: none; ``unknown`` when unreadable)."""
    try:
        mark = fence.newest_closed(root)
    except OSError as exc:
        lifecycle("fence_read_failed", level=logging.WARNING, root=root, error=repr(exc)[:200])
        return unknown
    if mark is None or mark.run_id != run_id:
        return -1
    if auth.enabled and not auth.signed_close(mark.generation, mark.mac):
        lifecycle("fence_close_untrusted", level=logging.WARNING, generation=mark.generation,
                  why="it is not signed with the job's secret")  # fmt: skip
        return -1
    return mark.generation


def newest_claim(root: str) -> tuple[bool, fence.Claim | None]:
    """(whether ``root`` could be read, its newest claim); a failed read is logged."""
    try:
        return True, fence.newest(root)
    except OSError as exc:
        lifecycle("fence_read_failed", level=logging.WARNING, root=root, error=repr(exc)[:200])
        return False, None


def left(root: str, generation: int, run_id: str, auth: RendezvousAuth) -> bool:
    """Whether job ``run_id``'s world ``generation`` was left by its last node (a trusted mark in ``root``)."""
    try:
        mark = fence.vacated(root, generation)
    except OSError as exc:
        lifecycle("fence_read_failed", level=logging.WARNING, root=root, error=repr(exc)[:200])
        return False
    if mark is None or mark.run_id != run_id:
        return False
    if auth.enabled and not auth.signed_vacate(generation, mark.mac):
        lifecycle("fence_vacate_untrusted", level=logging.WARNING, generation=generation,
                  why="it is not signed with the job's secret")  # fmt: skip
        return False
    return True
