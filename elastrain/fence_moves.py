"""Where a world's rendezvous store moved after its claim, recorded beside the claim.

A fencing claim records the store its world formed on (:mod:`elastrain.fence`). When that store's host leaves or
dies while the world trains on, its c10d store fails over to a successor, and no new round, hence no new claim,
says so: a node on its way in would find the claimed store gone, found the job again at the original endpoint,
and fence the running world when its first round claims (seen in the e2e test of a spare that arrives after the
store's host left). So the successor that now hosts the store records its address here,
``<root>/elastrain-fence/moved-<generation>-<ns>.json``, and a node on its way in tries the newest claim's last
move before the claim's own store (:func:`stores_of`).

A move is plain data, signed with the job's secret like the claim's store (``store_mac``), and followed only where a
claim's store would be: signed, or (without a secret) naming a node of the job. Moves of older generations are
pruned by the next record; a generation keeps its newest :data:`KEEP_MOVES`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from elastrain.fence import Claim, fence_dir
from elastrain.log import lifecycle
from elastrain.storage import Storage, storage_for

_PREFIX = "moved-"
_SUFFIX = ".json"
KEEP_MOVES = 8


@dataclass(frozen=True)
class Moved:
    """The world of ``generation`` runs its rendezvous store at ``store`` since ``moved_at`` (a failover)."""

    generation: int
    run_id: str
    store: str
    store_mac: str = ""
    """The signature of ``store`` with the job's rendezvous secret ("" without one), as a claim's."""
    moved_at: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Moved:
        raw = json.loads(data)
        return cls(
            generation=int(raw["generation"]),
            run_id=str(raw["run_id"]),
            store=str(raw["store"]),
            store_mac=str(raw.get("store_mac", "")),
            moved_at=float(raw.get("moved_at", 0.0)),
        )


def _parse(name: str) -> tuple[int, int] | None:
    """(generation, ns) of a move's file name; None for any other file."""
    if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
        return None
    parts = name[len(_PREFIX) : -len(_SUFFIX)].split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _name(generation: int, ns: int) -> str:
    return f"{_PREFIX}{generation:012d}-{ns:020d}{_SUFFIX}"


def _listed(directory: str, storage: Storage) -> list[tuple[int, int]]:
    """(generation, ns) of every move in ``directory``, oldest first."""
    return sorted(p for p in (_parse(n) for n in storage.listdir(directory)) if p is not None)


def record(root: str, move: Moved, storage: Storage | None = None) -> None:
    """Record ``move`` (a new file each time: moves never overwrite one another); prune what no reader needs."""
    storage = storage or storage_for(root)
    directory = fence_dir(root, storage)
    storage.makedirs(directory)
    storage.write_atomic(storage.join(directory, _name(move.generation, time.time_ns())), move.to_json())
    found = _listed(directory, storage)
    own = [p for p in found if p[0] == move.generation]
    for g, ns in [p for p in found if p[0] < move.generation] + own[:-KEEP_MOVES]:
        storage.remove(storage.join(directory, _name(g, ns)))


def moves(root: str, generation: int, storage: Storage | None = None) -> list[Moved]:
    """The readable moves of the store of the world of ``generation``, newest first."""
    storage = storage or storage_for(root)
    directory = fence_dir(root, storage)
    out: list[Moved] = []
    for g, ns in reversed(_listed(directory, storage)):
        if g != generation:
            continue
        try:
            out.append(Moved.from_json(storage.read_bytes(storage.join(directory, _name(g, ns)))))
        except FileNotFoundError:  # pruned meanwhile
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not a move (torn, or not ours)
            lifecycle("fence_move_unreadable", level=logging.WARNING, generation=g, error=repr(exc)[:200])
    return [m for m in out if m.generation == generation]


def stores_of(root: str, claim: Claim, storage: Storage | None = None) -> list[tuple[str, str]]:
    """Where the world of ``claim`` runs its store, to try in order: where it last moved since the claim (when it
    did), then the claim's own store; (address, signature) each. The claim's store alone when ``root`` cannot be
    read (logged)."""
    try:
        last = next((m for m in moves(root, claim.generation, storage) if m.run_id == claim.run_id), None)
    except OSError as exc:
        lifecycle("fence_read_failed", level=logging.WARNING, root=root, error=repr(exc)[:200])
        last = None
    return ([(last.store, last.store_mac)] if last is not None else []) + [(claim.store, claim.store_mac)]
