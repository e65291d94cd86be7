"""Loading a DCP checkpoint into the registered state, at any world size.

The commit protocol (:mod:`elastrain.checkpoint.commit`) offers the committed step directories newest
first; for each one every rank reads and checks DCP's metadata (no pickled bytes, files that fit), the
ranks agree, DCP loads the tensors (CRC-32s checked as the bytes are read, :mod:`elastrain.checkpoint.dcp_io`),
the ranks agree again, and the plain state and this rank's RNG come from the sidecars. A checkpoint that
does not load is set aside (``checkpoint_fallback``) and the next older one is tried.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from elastrain.checkpoint import layout
from elastrain.checkpoint.commit import Commit
from elastrain.checkpoint.dcp_io import (
    METADATA,
    check_crc,
    check_fits,
    is_tampering,
    load_planner,
    metadata_problems,
    read_metadata,
    reader_for,
    root_cause,
)
from elastrain.checkpoint.group import Group
from elastrain.checkpoint.rng import restore_rng
from elastrain.checkpoint.state import Registry
from elastrain.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointTamperedError
from elastrain.storage import Storage

SIDECAR = "elastrain-rank-{rank:05d}.json"


def sidecar_name(rank: int) -> str:
    """The file beside DCP's where ``rank`` saves its plain state and RNG."""
    return SIDECAR.format(rank=rank)


@dataclass(frozen=True)
class RestoreInfo:
    """The checkpoint that :meth:`Checkpointer.restore <elastrain.checkpoint.Checkpointer.restore>` loaded."""

    step: int
    path: str
    world_size: int  # the world size it was saved at


class DcpLoader:
    """Loads the newest committed DCP checkpoint that loads into ``registry`` (collective)."""

    def __init__(
        self,
        root: str,
        storage: Storage,
        registry: Registry,
        commit: Commit,
        io: Group,
        verify_checksums: Callable[[], bool],
    ) -> None:
        self.root = root
        self.storage = storage
        self.registry = registry
        self.commit = commit
        self.io = io
        self.rank = io.rank
        self._verify = verify_checksums
        self.dirty = False
        """A failed load may have overwritten part of the registered state."""

    @property
    def verify_checksums(self) -> bool:
        return self._verify()

    def load_newest(self) -> RestoreInfo | None:
        """The checkpoint loaded (``None``: none is committed); :class:`CheckpointCorruptError` when one failed
        part-way and no older one loads."""
        info = self.commit.restore(self._load, read_crc=self._read_crc)
        if info is None and self.dirty:
            raise CheckpointCorruptError(
                f"{self.root}: a checkpoint failed while loading and no older one loads, so the model holds "
                "part of a damaged checkpoint: move the step directories named in the checkpoint_fallback "
                "events away and start again"
            )
        return info

    def _read_crc(self, name: str, entry: layout.FileEntry) -> bool:
        """Which files verification reads for their CRC-32: those DCP cannot check as it loads them."""
        if not self.verify_checksums:
            return False
        if name == METADATA or name.startswith("elastrain-rank-"):
            return False  # read once, and checked, by _load
        return not entry.chunks

    def _load(self, d: layout.StepDir, marker: layout.CommitMarker) -> RestoreInfo | None:
        entries = marker.files if self.verify_checksums else None
        problem: list[Any] | None = None  # [why, tampered]
        try:
            md = read_metadata(d.path, self.storage, entries.get(METADATA) if entries else None)
            pickled = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
            if pickled:  # elastrain gives DCP tensors only: bytes (unpickled by DCP) were put there by hand
                raise CheckpointTamperedError(
                    f"{d.path}/{METADATA} stores {', '.join(sorted(pickled)[:3])} as pickled bytes, which elastrain "
                    "never writes"
                )
            if self.rank == 0:
                issues = metadata_problems(d.path, md, self.storage)
                if issues:
                    problem = [f"{d.path}: " + "; ".join(issues), False]
        except (CheckpointCorruptError, OSError) as e:
            problem = [str(e), isinstance(e, CheckpointTamperedError)]
        agreed = self.commit.agree(problem)
        if agreed is not None:
            self.commit.reject(d, str(agreed[0]), tampered=bool(agreed[1]))
            return None
        tensors, _ = self.registry.collect()
        names = set(self.registry.names)
        saved_keys = {k for k in md.state_dict_metadata if k.split("/", 1)[0] in names}
        md.state_dict_metadata = {k: md.state_dict_metadata[k] for k in saved_keys}
        check_fits(md, tensors, d.path)  # raises CheckpointMismatchError on every rank alike
        error: list[Any] | None = None  # [why, tampered]
        saved_plain: dict[str, Any] = {}
        rng: dict[str, Any] | None = None
        try:
            self.dirty = True
            dcp_load(
                tensors,
                storage_reader=reader_for(d.path, entries),
                planner=load_planner(),
                process_group=self.io.pg,
                no_dist=not self.io.distributed,
            )
            saved_plain = self._read_sidecar(d, 0, entries)["state"]
            if self.rank < marker.world_size:
                rng = self._read_sidecar(d, self.rank, entries)["rng"]
        except (Exception, CheckpointException) as e:
            error = [f"{d.path}: load failed: {root_cause(e)}", is_tampering(e)]
        agreed = self.commit.agree(error)
        if agreed is not None:
            self.commit.reject(d, str(agreed[0]), tampered=bool(agreed[1]))
            return None
        try:
            self.registry.apply(saved_plain, tensors, d.path)
        except CheckpointMismatchError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatchError(f"{d.path}: saved state does not fit the registered objects: {e}") from e
        self.dirty = False
        if rng is not None:
            restore_rng(rng)
        return RestoreInfo(step=marker.step, path=d.path, world_size=marker.world_size)

    def _read_sidecar(self, d: layout.StepDir, rank: int, entries: Any) -> dict[str, Any]:
        name = sidecar_name(rank)
        data = self.storage.read_bytes(self.storage.join(d.path, name))
        check_crc(data, entries.get(name) if entries else None, f"{d.path}/{name}")
        sidecar: dict[str, Any] = json.loads(data)
        return sidecar
