"""The fencing generation of a job, kept in its checkpoint root: at most one world of a job commits.

Every world (a completed rendezvous round whose nodes start workers) claims a *generation* before its
workers start, by creating ``<root>/elastrain-fence/gen-<N>.json`` exclusively (``O_CREAT|O_EXCL`` on a
local or shared filesystem; ``x`` mode on object stores whose fsspec driver supports conditional puts).
Exactly one claimant gets each number, so the claim is a small consensus through the storage that
every node of the job already shares:

* a world that descends from generation ``G`` claims ``G + 1``; when two worlds descend from ``G``
  (the two sides of a partition, or a frozen side that woke up) only one gets ``G + 1``, and the
  other is *superseded*: its nodes stop and join the winner, whose store address the claim records;
* a world that knows no parent (a fresh store: a whole-job restart, or a node started again with
  the original ``--rdzv-endpoint``) first looks for the newest claim's store and joins it when it
  answers; only if it does not does it claim ``newest + 1``;
* a commit carries its world's generation and is refused (:class:`StaleGenerationError`) once a newer
  generation exists (:func:`check`), so a world that lost the race, or was paused and woke up, can
  never commit into the checkpoint directory again, and the agent stops such a world's workers.

The guarantee needs a checkpoint root that every node of the job reaches (a shared filesystem or an
object store with conditional puts); with etcd the rendezvous itself is linearizable and the fence is
a second line of defence.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from elastrain.checkpoint.storage import FsspecStorage, LocalStorage, Storage, fsync_dir, storage_for
from elastrain.errors import StaleGenerationError
from elastrain.log import lifecycle

FENCE_DIR = "elastrain-fence"
_PREFIX = "gen-"
_SUFFIX = ".json"
KEEP_CLAIMS = 64
"""Claims kept in the fence folder; older ones are pruned by the claimant (only the newest matters)."""


@dataclass(frozen=True)
class Claim:
    """One world's claim of a generation: who it is and where its rendezvous store answers."""

    generation: int
    run_id: str
    round: int
    store: str
    """``host:port`` of the world's rendezvous store (c10d), or the etcd endpoints; "" if unknown."""
    members: tuple[str, ...] = ()
    claimed_at: float = 0.0
    store_mac: str = ""
    """The signature of ``store`` with the job's rendezvous secret ("" without one): see elastrain.rendezvous.auth."""

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "members": list(self.members)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Claim:
        raw = json.loads(data)
        return cls(
            generation=int(raw["generation"]),
            run_id=str(raw["run_id"]),
            round=int(raw["round"]),
            store=str(raw.get("store", "")),
            members=tuple(str(m) for m in raw.get("members", ())),
            claimed_at=float(raw.get("claimed_at", 0.0)),
            store_mac=str(raw.get("store_mac", "")),
        )


def _name(generation: int) -> str:
    return f"{_PREFIX}{generation:012d}{_SUFFIX}"


def _parse(name: str) -> int | None:
    if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
        return None
    digits = name[len(_PREFIX) : -len(_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def fence_dir(root: str, storage: Storage) -> str:
    return storage.join(root, FENCE_DIR)


def generations(root: str, storage: Storage | None = None) -> list[int]:
    """Every claimed generation in ``root``, ascending."""
    storage = storage or storage_for(root)
    found = (_parse(n) for n in storage.listdir(fence_dir(root, storage)))
    return sorted(g for g in found if g is not None)


def read_claim(root: str, generation: int, storage: Storage | None = None) -> Claim | None:
    storage = storage or storage_for(root)
    try:
        return Claim.from_json(storage.read_bytes(storage.join(fence_dir(root, storage), _name(generation))))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        # A claim is written whole (exclusive create of a complete file) except by a crash mid-write:
        # its number is taken all the same, only its store address is unknown.
        lifecycle("fence_claim_unreadable", level=logging.WARNING, generation=generation, error=repr(exc)[:200])
        return Claim(generation=generation, run_id="", round=-1, store="")


def newest(root: str, storage: Storage | None = None) -> Claim | None:
    """The newest claim in ``root`` (``None`` before the first)."""
    storage = storage or storage_for(root)
    gens = generations(root, storage)
    return read_claim(root, gens[-1], storage) if gens else None


def _create_exclusive(path: str, data: bytes, storage: Storage) -> bool:
    """Create ``path`` with ``data`` unless it exists; True if this call created it."""
    if isinstance(storage, LocalStorage):
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(directory)
        return True
    if isinstance(storage, FsspecStorage):
        try:
            with storage.fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError) as exc:
            # The driver has no conditional create: check-then-put, which two racing claimants can both pass.
            lifecycle(
                "fence_not_atomic",
                level=logging.WARNING,
                path=path,
                why=f"{type(storage.fs).__name__} has no exclusive create ({exc!r:.80}); fencing is best effort",
            )
    if storage.exists(path):
        return False
    storage.write_atomic(path, data)
    return True


def claim(root: str, want: Claim, storage: Storage | None = None) -> bool:
    """Claim ``want.generation`` for this world; False if another world already holds that number."""
    storage = storage or storage_for(root)
    path = storage.join(fence_dir(root, storage), _name(want.generation))
    won = _create_exclusive(path, want.to_json(), storage)
    if won:
        _prune(root, want.generation, storage)
    return won


def claim_after(
    root: str,
    run_id: str,
    round_: int,
    store: str,
    members: tuple[str, ...],
    parent: int,
    storage: Storage | None = None,
    store_mac: str = "",
) -> Claim | None:
    """Claim ``parent + 1`` for a world that descends from ``parent``; ``None`` if another world got it."""
    want = Claim(parent + 1, run_id, round_, store, members, time.time(), store_mac)
    return want if claim(root, want, storage) else None


def claim_fresh(
    root: str,
    run_id: str,
    round_: int,
    store: str,
    members: tuple[str, ...],
    storage: Storage | None = None,
    store_mac: str = "",
) -> Claim:
    """Claim the next free generation for a world that knows no parent (a fresh rendezvous store).

    The caller has already made sure that the newest claim's store does not answer (else it joins it).
    """
    storage = storage or storage_for(root)
    for _ in range(100):
        top = newest(root, storage)
        want = Claim((top.generation if top else -1) + 1, run_id, round_, store, members, time.time(), store_mac)
        if claim(root, want, storage):
            return want
    raise StaleGenerationError(f"could not claim a generation in {root} after 100 tries (claims keep racing)")


def check(root: str, generation: int | None, storage: Storage | None = None) -> None:
    """Raise :class:`StaleGenerationError` if a world newer than ``generation`` claimed ``root``.

    ``None`` (no generation: plain torchrun, or a launcher without a checkpoint root) checks nothing.
    """
    if generation is None:
        return
    storage = storage or storage_for(root)
    gens = generations(root, storage)
    if gens and gens[-1] > generation:
        raise StaleGenerationError(
            f"generation {generation} of {root} was superseded by generation {gens[-1]}: another world of this "
            "job took over the checkpoint directory; this world stops and never commits again"
        )


def _prune(root: str, latest: int, storage: Storage) -> None:
    for g in generations(root, storage)[:-KEEP_CLAIMS]:
        if g < latest:
            storage.remove(storage.join(fence_dir(root, storage), _name(g)))
