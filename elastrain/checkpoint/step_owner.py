"""Which generation wrote a step directory: the owner file a commit's prepare writes first, and whether a world
may remove a leftover another generation wrote (:mod:`elastrain.checkpoint.commit`, steps 1 and retention).

``<step dir>/elastrain-owner.json`` holds ``{"generation", "created_at", "kind"}``; a directory without one was
written before generations existed, or by an unfenced world.
"""

from __future__ import annotations

import json
import time

from elastrain.storage import Storage

OWNER = "elastrain-owner.json"


def may_remove_leftover(owner_generation: int | None, generation: int | None) -> bool:
    """Whether a world of ``generation`` may delete an uncommitted step directory ``owner_generation`` wrote.

    Pure. Only leftovers of older generations, or of its own, are removed; an unfenced world (or an
    unowned leftover, written before generations existed) removes any.
    """
    if generation is None or owner_generation is None:
        return True
    return owner_generation <= generation


def write_owner(path: str, generation: int | None, kind: str, storage: Storage) -> None:
    """Record in step directory ``path`` that ``generation`` writes it (atomically)."""
    owner_data = {"generation": generation, "created_at": time.time(), "kind": kind}
    storage.write_atomic(storage.join(path, OWNER), json.dumps(owner_data).encode())


def read_owner(path: str, storage: Storage) -> int | None:
    """The generation that created step directory ``path`` (``None``: unknown or unfenced)."""
    try:
        raw = json.loads(storage.read_bytes(storage.join(path, OWNER)))
        value = raw.get("generation")
        return None if value is None else int(value)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
