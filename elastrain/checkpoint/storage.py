"""Where checkpoint files live: a local/shared filesystem path, or any fsspec URL.

The layout code (:mod:`elastrain.checkpoint.layout`) goes through this small interface so that it
works the same on ``/mnt/outputs/ckpt`` and on ``s3://bucket/ckpt``. Local writes are fsynced
(files and their directory); object stores make a completed ``put`` durable on their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import zlib
from collections.abc import Iterator
from typing import Any, Protocol

_CHUNK = 8 << 20


def is_url(path: str) -> bool:
    """Whether ``path`` names an fsspec location (``s3://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


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


class LocalStorage:
    """A local or shared (NFS, blobfuse, Lustre) filesystem path."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write to a temporary name, fsync, rename over ``path``, fsync the directory."""
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
            os.remove(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def walk_files(self, path: str) -> Iterator[str]:
        """Every regular file under ``path``, as a path relative to it (``/``-separated), sorted."""
        found: list[str] = []
        for root, _dirs, files in os.walk(path):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), path)
                found.append(rel.replace(os.sep, "/"))
        yield from sorted(found)

    def crc32(self, path: str) -> int:
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc


class FsspecStorage:
    """Any fsspec filesystem (``s3://``, ``gs://``, ``abfs://``, ``memory://``)."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs

        self.fs, _ = url_to_fs(url, **storage_options)
        self._protocol = url.split("://", 1)[0]

    def _url(self, path: str) -> str:
        return path if "://" in path else f"{self._protocol}://{path}"

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def write_atomic(self, path: str, data: bytes) -> None:
        # A single put is atomic on object stores; elsewhere write then move.
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
        base = self.fs._strip_protocol(path).rstrip("/")
        found = [str(f)[len(base) + 1 :] for f in self.fs.find(path)]
        yield from sorted(found)

    def crc32(self, path: str) -> int:
        crc = 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc


def storage_for(path: str) -> Storage:
    """The storage that serves ``path``: fsspec for URLs, the local filesystem otherwise."""
    if is_url(path):
        return FsspecStorage(path)
    return LocalStorage()


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
