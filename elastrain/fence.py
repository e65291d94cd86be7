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

Without the launcher's fence (``elastrain-run`` without ``--checkpoint-dir``, or a script that writes
elsewhere) the workers fence the root they write into themselves, by the same claims
(:func:`worker_world`, claimed by :class:`elastrain.checkpoint.commit.Commit` before its first restore
or save): a world of fresh workers claims ``newest + 1``, a world whose workers went on from an
earlier one in place (``--live``) claims ``parent + 1``, and a world that finds a newer claim at a
commit is superseded: its workers exit with ``EX_CONFIG`` (78), so that elastrain-run ends its nodes
rather than restarting workers that would claim the root back.

The guarantee needs a checkpoint root that every node of the job reaches (a shared filesystem or an
object store with conditional puts); with etcd the rendezvous itself is linearizable and the fence is
a second line of defence.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError, StaleGenerationError
from elastrain.log import lifecycle
from elastrain.storage import (
    FsspecStorage,
    LocalStorage,
    ProbeGroup,
    Storage,
    fsync_dir,
    is_url,
    local_path,
    storage_for,
)

FENCE_DIR = "elastrain-fence"
_PREFIX = "gen-"
_CLOSED_PREFIX = "closed-"
_VACATED_PREFIX = "vacated-"
_SUFFIX = ".json"
KEEP_CLAIMS = 64
"""Claims kept in the fence folder; older ones are pruned by the claimant (only the newest matters)."""
_Mark = TypeVar("_Mark", bound="Closed")


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


@dataclass(frozen=True)
class Closed:
    """The end of a job, recorded beside its claims: the world of ``generation`` finished and closed its
    rendezvous. A node that came to join that job and whose store fell silent before it joined a round learns
    here that the job is over (its store's host left with the close), not that the job died with its store."""

    generation: int
    run_id: str
    closed_at: float = 0.0
    mac: str = ""
    """The signature of the close with the job's rendezvous secret ("" without one)."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls: type[_Mark], data: bytes) -> _Mark:
        raw = json.loads(data)
        closed_at, mac = float(raw.get("closed_at", 0.0)), str(raw.get("mac", ""))
        return cls(int(raw["generation"]), str(raw["run_id"]), closed_at, mac)


@dataclass(frozen=True)
class Vacated(Closed):
    """The end of a world, recorded beside its claims: the last node of the world of ``generation`` left it (a
    notice, a stop) and the world's store, which that node hosted, left with it (``closed_at``: when). A node that
    came to join and whose store then fell silent learns here that no world of the job runs any more, and starts
    the job over at once instead of waiting ``refound_after`` for one."""


def _name(generation: int, prefix: str = _PREFIX) -> str:
    return f"{prefix}{generation:012d}{_SUFFIX}"


def _parse(name: str, prefix: str = _PREFIX) -> int | None:
    if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
        return None
    digits = name[len(prefix) : -len(_SUFFIX)]
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
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
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
        path = local_path(path)
        directory = os.path.dirname(path)
        storage.makedirs(directory)
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
        top = read_claim(root, gens[-1], storage)
        who = ""
        if top is not None and top.run_id:
            hosts = f", on {', '.join(top.members[:4])}" if top.members else ""
            who = f" (run {top.run_id!r}, round {top.round}{hosts})"
        raise StaleGenerationError(
            f"generation {generation} of {root} was superseded by generation {gens[-1]}{who}: another world of this "
            "job took over the checkpoint directory; this world stops and never commits again"
        )


def mark_closed(root: str, mark: Closed, storage: Storage | None = None) -> bool:
    """Record that the world of ``mark.generation`` finished the job (a :class:`Closed`), or that its last node left
    it (a :class:`Vacated`); False if a node of that world already did."""
    storage = storage or storage_for(root)
    prefix = _VACATED_PREFIX if isinstance(mark, Vacated) else _CLOSED_PREFIX
    return _create_exclusive(storage.join(fence_dir(root, storage), _name(mark.generation, prefix)), mark.to_json(),
                             storage)  # fmt: skip


def vacated(root: str, generation: int, storage: Storage | None = None) -> Vacated | None:
    """The mark that the world of ``generation`` was left by its last node (``None``: none, or unreadable)."""
    storage = storage or storage_for(root)
    try:
        return Vacated.from_json(
            storage.read_bytes(storage.join(fence_dir(root, storage), _name(generation, _VACATED_PREFIX)))
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # torn by a crash mid-write: not a mark
        lifecycle("fence_vacated_unreadable", level=logging.WARNING, generation=generation, error=repr(exc)[:200])
        return None


def newest_closed(root: str, storage: Storage | None = None) -> Closed | None:
    """The newest readable close in ``root`` (``None`` before the first end of the job there)."""
    storage = storage or storage_for(root)
    directory = fence_dir(root, storage)
    found = (_parse(n, _CLOSED_PREFIX) for n in storage.listdir(directory))
    for g in sorted((g for g in found if g is not None), reverse=True):
        try:
            return Closed.from_json(storage.read_bytes(storage.join(directory, _name(g, _CLOSED_PREFIX))))
        except FileNotFoundError:  # pruned meanwhile
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # torn by a crash mid-write: not a close
            lifecycle("fence_close_unreadable", level=logging.WARNING, generation=g, error=repr(exc)[:200])
    return None


def claim_times(root: str, storage: Storage | None = None) -> dict[int, float | None]:
    """When each claim in ``root`` was made, by the storage's clock (``None`` where the storage does not say)."""
    storage = storage or storage_for(root)
    out: dict[int, float | None] = {}
    for g in generations(root, storage):
        try:
            out[g] = storage.mtime(storage.join(fence_dir(root, storage), _name(g)))
        except FileNotFoundError:  # pruned meanwhile
            continue
    return out


@dataclass(frozen=True)
class World:
    """Who a world of workers is when it claims its checkpoint root itself (the launcher claimed nothing there)."""

    run_id: str
    round: int


def worker_world(env: WorkerEnv, root: str) -> World | None:
    """The identity to claim ``root`` as, when the workers must fence it themselves; ``None`` when they need not.

    Under elastrain-run, workers fence their root unless the launcher did: it claims its
    ``--checkpoint-dir`` (``env.generation``), so a root elsewhere, or no ``--checkpoint-dir`` at all,
    is the workers' to claim. Outside elastrain-run (plain torchrun, a notebook, an evaluation script
    that only restores) nothing is claimed: a reader never supersedes the job that writes.
    """
    if not env.under_elastrain:
        return None
    if env.generation is not None and env.checkpoint_dir is not None and _same(env.checkpoint_dir, root):
        return None
    return World(env.run_id, env.round)


_HELD: dict[str, int] = {}
"""The generation this process's last world claimed in each root: a world whose workers go on in place
(``--live``) descends from it, and claims the next one only if no other world took it first."""


def disown_claims() -> None:
    """This process's state in memory was dropped (its node was left behind: the job trained on in worlds it
    was not in): its next world descends from none of its earlier ones, and claims afresh, as new workers do."""
    _HELD.clear()


@dataclass(frozen=True)
class WorkerClaim:
    """A world of workers claiming its checkpoint root (the workers' own fence)."""

    root: str
    world: World
    storage: Storage

    def claim(self, group: ProbeGroup) -> int:
        """Collective (rank 0 claims, every rank gets the verdict): this world's generation.

        A world whose workers went on in place from an earlier world of this process claims the
        generation after that world's (:func:`claim_after`), and raises :class:`StaleGenerationError`
        if another world took it first. A world of fresh workers claims the next free one
        (:func:`claim_fresh`). Raises :class:`CheckpointSaveError` on every rank when no claim can be written.
        """
        key = self.root if is_url(self.root) else os.path.abspath(local_path(self.root))
        gathered = group.all_gather([_HELD.get(key), socket.gethostname()])
        parents = [int(p) for p, _ in gathered if p is not None]
        hosts = tuple(sorted({str(h) for _, h in gathered}))
        verdict: list[Any] | None = None
        if group.rank == 0:
            try:
                verdict = ["ok", self._on_leader(max(parents) if parents else None, hosts)]
            except StaleGenerationError as e:
                verdict = ["stale", str(e)]
            except OSError as e:
                verdict = ["error", f"{type(e).__name__}: {e}"]
        kind, value = group.broadcast(verdict)
        if kind == "stale":
            raise StaleGenerationError(value)
        if kind == "error":
            raise CheckpointSaveError(
                f"cannot claim this world's fencing generation in {self.root} ({value}): the checkpoint root must "
                "be a directory (or URL) that every node can write"
            )
        _HELD[key] = int(value)
        return int(value)

    def _on_leader(self, parent: int | None, hosts: tuple[str, ...]) -> int:
        w = self.world
        if parent is None:
            return claim_fresh(self.root, w.run_id, w.round, "", hosts, self.storage).generation
        got = claim_after(self.root, w.run_id, w.round, "", hosts, parent, self.storage)
        if got is None:
            check(self.root, parent, self.storage)  # raises, naming the world that took the next generation
            raise StaleGenerationError(f"generation {parent + 1} of {self.root} was claimed by another world")
        return got.generation


def _same(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(local_path(a)) == os.path.abspath(local_path(b))


def _prune(root: str, latest: int, storage: Storage) -> None:
    directory = fence_dir(root, storage)
    names = storage.listdir(directory)
    kept = sorted(g for g in (_parse(n) for n in names) if g is not None)[-KEEP_CLAIMS:]
    oldest = min([*kept, latest])
    for prefix in (_PREFIX, _CLOSED_PREFIX, _VACATED_PREFIX):
        for g in (_parse(n, prefix) for n in names):
            if g is not None and g < oldest:
                storage.remove(storage.join(directory, _name(g, prefix)))
