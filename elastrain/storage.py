"""Where a job's files live (checkpoints, fencing claims, metrics): a local/shared filesystem path, or any fsspec URL.

The checkpoint layout (:mod:`elastrain.checkpoint.layout`) and the fence (:mod:`elastrain.fence`) go through this
small interface so that they work the same on ``/mnt/outputs/ckpt``, ``s3://bucket/ckpt`` and
``az://container/ckpt``. Local writes are fsynced (files and their directory); object stores make a completed
``put`` durable and atomic on their own: an object is either absent or whole, never torn. A failed fsync raises
(:class:`~elastrain.errors.CheckpointDurabilityError`): durability that is claimed is real. ``file://``
URLs name local paths (:func:`local_path`).

Credentials and endpoints come from the standard mechanisms of each fsspec backend, so elastrain
invents no option of its own: ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for MinIO and other
S3-compatible servers) or ``~/.aws`` for ``s3://``; ``AZURE_STORAGE_CONNECTION_STRING`` or
``AZURE_STORAGE_ACCOUNT_NAME`` plus a managed identity for ``az://`` / ``abfs://``; and fsspec's own
configuration (``FSSPEC_S3_ENDPOINT_URL=...``, ``FSSPEC_AZ='{"account_name": ...}'`` or a JSON file in
``~/.config/fsspec/``) for any keyword argument of a backend. Workers inherit the launcher's
environment, so setting these where ``elastrain-run`` starts reaches every rank.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import sys
import uuid
import zlib
from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from elastrain.errors import CheckpointDurabilityError, CheckpointError
from elastrain.log import lifecycle

_CHUNK = 8 << 20
# Backends where one put is atomic and a rename is a copy: write in place instead of temp + move.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2"})


def is_url(path: str) -> bool:
    """Whether ``path`` names an fsspec location (``s3://...``) rather than a local path (``file://`` is local)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str | os.PathLike[str]) -> str:
    """``path``, with a ``file://`` URL turned into the local path it names (``file:///mnt/ckpt`` → ``/mnt/ckpt``).

    A ``file://`` URL naming another host raises :class:`CheckpointError`; other paths and URLs pass unchanged.
    """
    text = os.fspath(path)
    if not text.startswith("file://"):
        return text
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise CheckpointError(
            f"{text}: a file:// URL names a path on this machine (file:///path), not on host {parts.netloc!r}"
        )
    return unquote(parts.path) or "/"


def join_path(base: str | os.PathLike[str], *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (``pathlib`` would turn ``s3://b`` into ``s3:/b``)."""
    text = local_path(base)
    if is_url(text):
        return "/".join([text.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(text, *parts)


class Storage(Protocol):
    """The operations the checkpoint layout needs; paths are strings under one root."""

    def join(self, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def size(self, path: str) -> int: ...
    def makedirs(self, path: str) -> None: ...
    def read_bytes(self, path: str) -> bytes: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def walk_files(self, path: str) -> Iterator[str]: ...
    def crc32(self, path: str) -> int: ...
    def sync_tree(self, path: str) -> None: ...
    def mtime(self, path: str) -> float | None: ...


class LocalStorage:
    """A local or shared (NFS, blobfuse, Lustre) filesystem path (``file://`` URLs too)."""

    def join(self, *parts: str) -> str:
        return os.path.join(local_path(parts[0]), *parts[1:])

    def exists(self, path: str) -> bool:
        return os.path.exists(local_path(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(local_path(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(local_path(path)))
        except FileNotFoundError:
            return []

    def size(self, path: str) -> int:
        return os.stat(local_path(path)).st_size

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its missing parents, each made durable in its parent (fsynced)."""
        target = os.path.abspath(local_path(path))
        missing = []
        cur = target
        while not os.path.isdir(cur) and os.path.dirname(cur) != cur:
            missing.append(cur)
            cur = os.path.dirname(cur)
        os.makedirs(target, exist_ok=True)
        for created in reversed(missing):
            fsync_dir(os.path.dirname(created))

    def read_bytes(self, path: str) -> bytes:
        with open(local_path(path), "rb") as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write to a temporary name, fsync, rename over ``path``, fsync the directory."""
        path = local_path(path)
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local_path(path))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(local_path(path), ignore_errors=True)

    def walk_files(self, path: str) -> Iterator[str]:
        """Every regular file under ``path``, as a path relative to it (``/``-separated), sorted."""
        path = local_path(path)
        found: list[str] = []
        for root, _dirs, files in os.walk(path):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), path)
                found.append(rel.replace(os.sep, "/"))
        yield from sorted(found)

    def crc32(self, path: str) -> int:
        crc = 0
        with open(local_path(path), "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    def sync_tree(self, path: str) -> None:
        """fsync every directory under ``path`` (and ``path`` itself): the entries of files written there, durable."""
        for root, _dirs, _files in os.walk(local_path(path)):
            fsync_dir(root)

    def mtime(self, path: str) -> float | None:
        """When ``path`` was last written, by the filesystem's clock (the one clock every writer shares)."""
        return os.stat(local_path(path)).st_mtime


class FsspecStorage:
    """Any fsspec filesystem (``s3://``, ``gs://``, ``abfs://``, ``memory://``)."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs

        self.fs, _ = url_to_fs(url, **storage_options)
        self._protocol = url.split("://", 1)[0]
        self.object_store = self._protocol in OBJECT_STORES

    def _url(self, path: str) -> str:
        return path if "://" in path else f"{self._protocol}://{path}"

    def _fresh(self) -> None:
        # Other ranks and nodes write here too: never answer from this process's cached listings.
        self.fs.invalidate_cache()

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def exists(self, path: str) -> bool:
        self._fresh()
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        self._fresh()
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        self._fresh()
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def size(self, path: str) -> int:
        self._fresh()
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.object_store:  # one put: readers see the old object, or the new one whole
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def walk_files(self, path: str) -> Iterator[str]:
        self._fresh()
        base = self.fs._strip_protocol(path).rstrip("/")
        found = [str(f)[len(base) + 1 :] for f in self.fs.find(path)]
        yield from sorted(found)

    def crc32(self, path: str) -> int:
        crc = 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    def sync_tree(self, path: str) -> None:
        """Nothing to do: a completed put is durable, and object stores have no directories to sync."""

    def mtime(self, path: str) -> float | None:
        """When ``path`` was written, by the store's clock; ``None`` where the driver does not say."""
        self._fresh()
        try:
            return float(self.fs.modified(path).timestamp())
        except (NotImplementedError, ValueError, TypeError):
            return None


def storage_for(path: str) -> Storage:
    """The storage that serves ``path``: fsspec for URLs, the local filesystem otherwise (``file://`` too)."""
    if is_url(path):
        return FsspecStorage(path)
    return LocalStorage()


class ProbeGroup(Protocol):
    """The collectives :func:`check_shared` needs (:class:`elastrain.checkpoint.group.Group` has them)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...
    def broadcast(self, obj: Any) -> Any: ...


PROBE_PREFIX = ".elastrain-shared-"


def check_shared(root: str, group: ProbeGroup, storage: Storage | None = None) -> None:
    """Raise :class:`CheckpointError` on every rank unless every rank sees the same checkpoint root.

    A multi-node job needs one checkpoint location that all nodes see (a shared filesystem or an
    object store): each rank writes a token file under ``root``, then checks that it sees every
    rank's token. A node-local directory (``/tmp/ckpt`` on each node) fails here, at start, with a
    message naming ``--checkpoint-dir``, rather than at the first save. A collective over ``group``;
    URLs and one-process worlds pass without probing.
    """
    if group.world_size <= 1 or is_url(root):
        return
    st = storage or storage_for(root)
    nonce = group.broadcast(uuid.uuid4().hex[:12] if group.rank == 0 else None)
    probe = st.join(root, f"{PROBE_PREFIX}{nonce}")
    mine = st.join(probe, f"rank-{group.rank:05d}")
    host = socket.gethostname()
    error: str | None = None
    try:
        st.makedirs(probe)
        st.write_atomic(mine, host.encode())
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    group.all_gather(error)  # every rank has written (or failed to) before anyone looks
    try:
        seen = set(st.listdir(probe))
    except OSError:
        seen = set()
    missing = [r for r in range(group.world_size) if f"rank-{r:05d}" not in seen]
    reports: list[tuple[str, list[int], str | None]] = group.all_gather((host, missing, error))
    st.remove(mine)
    group.all_gather(None)  # every rank has looked before the folder goes
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    problems = []
    for rank, (rank_host, rank_missing, rank_error) in enumerate(reports):
        if rank_error is not None:
            problems.append(f"rank {rank} on {rank_host} cannot write there ({rank_error})")
        elif rank_missing:
            whose = f"rank{'s' if len(rank_missing) > 1 else ''} {_ranges(rank_missing)}"
            problems.append(f"rank {rank} on {rank_host} does not see the probe files of {whose}")
    if problems:
        raise CheckpointError(
            f"--checkpoint-dir {root} is not one directory shared by all nodes: "
            + "; ".join(problems[:4])
            + (f"; ... ({len(problems)} ranks in all)" if len(problems) > 4 else "")
            + ". Point --checkpoint-dir at a filesystem every node mounts at the same path (NFS, Lustre, "
            "blobfuse) or at an object-store URL (s3://bucket/run, az://container/run)"
        )


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


_UNSUPPORTED_LOGGED: set[str] = set()


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable.

    Raises :class:`CheckpointDurabilityError` (an ``OSError``) when the directory cannot be opened or
    synced. Where the platform cannot fsync a directory at all (Windows; a filesystem that answers
    ``EINVAL``, ``ENOTSUP`` or ``ENOSYS``, as some FUSE mounts do) it logs
    ``event=fsync_dir_unsupported`` once per reason and returns: there, a rename is as durable as the
    filesystem makes it.
    """
    path = local_path(path) or "."
    if sys.platform == "win32":
        _unsupported(path, "directories cannot be fsynced on Windows")
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise CheckpointDurabilityError(e.errno, f"cannot open directory {path} to fsync it: {e.strerror}") from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            _unsupported(path, f"this filesystem cannot fsync a directory ({e.strerror})")
            return
        raise CheckpointDurabilityError(e.errno, f"fsync of directory {path} failed: {e.strerror}") from e
    finally:
        os.close(fd)


def _unsupported(path: str, why: str) -> None:
    if why not in _UNSUPPORTED_LOGGED:
        _UNSUPPORTED_LOGGED.add(why)
        lifecycle("fsync_dir_unsupported", level=logging.WARNING, path=path, why=why)
