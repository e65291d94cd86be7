"""torch.distributed.checkpoint (DCP) readers and writers, made safe and checkable.

DCP stores its ``.metadata`` with :mod:`pickle`, and pickle runs whatever callable the file names. A
checkpoint directory may come from anywhere (a shared bucket, another job, whoever can write the root,
who can also write a matching commit marker), so :class:`SafeReader` reads it with an unpickler that
resolves only an exact list of names: DCP's metadata classes, ``torch.Size``, the torch dtypes, the
layout helper and the path classes, each an exact ``(module, name)`` pair with no dots (protocol 4
would follow a dotted name through the module's attributes to anything it imports). Anything else is
refused as tampering (:class:`~elastrain.errors.CheckpointTamperedError`), before a single object is
built from it, and so is a metadata file that places data outside its step directory. Tensor data is
read by DCP with ``weights_only=True``; entries stored as bytes (which DCP would unpickle with
``weights_only=False``) are refused before loading and by the load planner (:func:`load_planner`).

Checksums cost no extra reads. The writer (:func:`writer_for`) computes each file's CRC-32, and the
CRC-32 of every stored item in it (a tensor shard, between DCP's two ``tell()`` calls around it), on
the bytes as they are written; the rank reports them (:func:`written_files`) and they go into the
commit marker. The reader (:func:`reader_for`, given the marker's entries) checks each item's CRC-32
on the very bytes DCP loads, and the ``.metadata`` CRC-32 on the bytes it unpickles.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import threading
import zlib
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from elastrain import wire
from elastrain.checkpoint.layout import Chunk, FileEntry
from elastrain.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointTamperedError
from elastrain.storage import Storage, is_url

METADATA = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_PATHS = (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path, pathlib.PosixPath)
# Every global a DCP .metadata written by torch 2.13 refers to (FSDP2/DTensor, optimizer state, bytes entries,
# plain, fsspec), and nothing else: exact (module, name) pairs, resolved here, never imported by name.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): dcp_metadata.Metadata,
    (_MD, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_MD, "StorageMeta"): dcp_metadata.StorageMeta,
    (_MD, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_MD, "TensorProperties"): dcp_metadata.TensorProperties,
    (_MD, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    (_FS, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    **{("torch", name): dtype for name, dtype in wire.DTYPES.items()},
    # storage_meta.checkpoint_id: a path (Python 3.13 names pathlib's module pathlib._local).
    **{(module, cls.__name__): cls for cls in _PATHS for module in ("pathlib", "pathlib._local")},
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib._local", "WindowsPath"): pathlib.PureWindowsPath,
}


class _Refused(pickle.UnpicklingError):
    """The metadata names something a DCP metadata file never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name)) if "." not in name else None
        if found is None:
            raise _Refused(f"it refers to {module}.{name}, which a DCP checkpoint never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"it holds a persistent reference ({pid!r:.60}), which a DCP checkpoint never holds")


def load_metadata_bytes(data: bytes, where: str) -> Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata types.

    A file that names anything else, or places data outside its step directory, raises
    :class:`CheckpointTamperedError` (nothing it names is ever called); any other damage,
    :class:`CheckpointCorruptError`.
    """
    try:
        md = _MetadataUnpickler(io.BytesIO(data), fix_imports=False).load()
    except _Refused as e:
        raise CheckpointTamperedError(f"{where}/{METADATA} was refused: {e}") from None
    except Exception as e:
        raise CheckpointCorruptError(f"{where}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointTamperedError(f"{where}/{METADATA} does not hold DCP metadata (it holds a {type(md).__name__})")
    _check_structure(md, where)
    return md


def _check_structure(md: Metadata, where: str) -> None:
    """Every entry is a well-formed tensor or bytes entry, and every stored item lies in a file inside the step
    directory: what the loader then reads from the metadata is what DCP itself would have written."""
    bad = f"{where}/{METADATA}"
    entries = md.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise CheckpointTamperedError(f"{bad}: its entries are not a dict keyed by name")
    for key, value in entries.items():
        if isinstance(value, TensorStorageMetadata):
            props, chunks = value.properties, value.chunks
            well_formed = (
                isinstance(value.size, torch.Size)
                and isinstance(props, dcp_metadata.TensorProperties)
                and isinstance(props.dtype, torch.dtype)
                and isinstance(chunks, list)
                and all(
                    isinstance(c, dcp_metadata.ChunkStorageMetadata)
                    and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size)
                    for c in chunks
                )
            )
            if not well_formed:
                raise CheckpointTamperedError(f"{bad}: tensor entry {key} is malformed")
        elif not isinstance(value, BytesStorageMetadata):
            raise CheckpointTamperedError(f"{bad}: entry {key} is a {type(value).__name__}")
    storage = md.storage_data if md.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise CheckpointTamperedError(f"{bad}: its storage data is a {type(storage).__name__}")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(index.fqn, str):
            raise CheckpointTamperedError(f"{bad}: its storage data is keyed by a {type(index).__name__}")
        if not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointTamperedError(f"{bad}: the storage of {index.fqn} is not a file and offset")
        rel = info.relative_path
        parts = pathlib.PurePosixPath(rel).parts
        if not parts or rel.startswith(("/", "\\")) or ".." in parts or "\\" in rel or "\x00" in rel:
            raise CheckpointTamperedError(f"{bad} places {index.fqn} in {rel!r}, outside its directory")
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise CheckpointTamperedError(f"{bad}: {index.fqn} has a bad offset or length")


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's load planner, minus the one path that unpickles: entries stored as bytes (``torch.load`` with
    ``weights_only=False``). elastrain saves only tensors through DCP, so such an entry was put there by hand."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointTamperedError(
            f"{read_item.dest_index.fqn} is stored as pickled bytes, which elastrain never writes and never loads"
        )


def load_planner() -> DefaultLoadPlanner:
    """The load planner for ``dcp.load``: DCP's default, refusing entries stored as bytes."""
    return _TensorsOnly()


def check_crc(data: bytes, entry: FileEntry | None, where: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``data`` is the whole file ``entry`` describes."""
    if entry is None:
        return
    if len(data) != entry.size:
        raise CheckpointCorruptError(f"{where} has {len(data)} bytes, the marker says {entry.size} (truncated)")
    if entry.crc32 is not None and zlib.crc32(data) != entry.crc32:
        raise CheckpointCorruptError(f"{where} fails its CRC-32 check (corrupt)")


class _Verifier:
    """What a reader checks: the marker's entries, by file name relative to the step directory."""

    def __init__(self, entries: Mapping[str, FileEntry] | None) -> None:
        self.entries = dict(entries or {})
        self.chunks = {(name, c.offset, c.length): c.crc32 for name, e in self.entries.items() for c in e.chunks}

    def metadata(self, reader: FileSystemReader, rank: int | None) -> Metadata:
        path = reader._get_metadata_path(rank)
        with reader.fs.create_stream(path, "rb") as f:
            data = f.read()
        check_crc(data, self.entries.get(METADATA), f"{reader.path}/{METADATA}")
        md = load_metadata_bytes(data, str(reader.path))
        if self.entries:
            unlisted = sorted({str(i.relative_path) for i in (md.storage_data or {}).values()} - set(self.entries))
            if unlisted:
                raise CheckpointCorruptError(
                    f"{reader.path}/{METADATA} places data in {', '.join(unlisted[:3])}, which the commit marker does "
                    "not list (metadata and marker differ)"
                )
        if md.storage_meta is not None:
            md.storage_meta.load_id = reader.load_id
        return md

    def slice(self, reader: FileSystemReader, file: Any, sinfo: Any) -> IO[bytes] | None:
        """The item's bytes, CRC-checked; ``None`` when its file has no per-item CRCs (checked whole before)."""
        name = str(sinfo.relative_path)
        entry = self.entries.get(name)
        if entry is None or not entry.chunks:
            return None
        where = f"{reader.path}/{name} bytes {sinfo.offset}..{sinfo.offset + sinfo.length}"
        crc = self.chunks.get((name, int(sinfo.offset), int(sinfo.length)))
        if crc is None:
            raise CheckpointCorruptError(f"{where}: not an item the commit marker lists (metadata and marker differ)")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length or zlib.crc32(data) != crc:
            raise CheckpointCorruptError(f"{where} fail their CRC-32 check (corrupt)")
        return io.BytesIO(data)


class SafeReader(FileSystemReader):
    """DCP's filesystem reader with a restricted metadata unpickler, checking CRC-32s as it reads."""

    def __init__(self, path: str | os.PathLike[str], entries: Mapping[str, FileEntry] | None = None) -> None:
        super().__init__(path)
        self._verifier = _Verifier(entries)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._verifier.metadata(self, kwargs.get("rank"))

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        return self._verifier.slice(self, file, sinfo) or super()._slice_file(file, sinfo)


def reader_for(path: str, entries: Mapping[str, FileEntry] | None = None) -> FileSystemReader:
    """A reader of the step directory ``path`` that checks the commit marker's ``entries`` while loading."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        verifier = _Verifier(entries)

        class SafeFsspecReader(FsspecReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
                return verifier.metadata(self, kwargs.get("rank"))

            def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
                return verifier.slice(self, file, sinfo) or super()._slice_file(file, sinfo)

        return SafeFsspecReader(path)
    return SafeReader(path, entries)


class _ChecksumStream:
    """A write stream that passes bytes through and CRCs them: whole file, and per segment between ``tell()``s."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._pos = 0
        self._crc = 0
        self._seg_start = 0
        self._seg_crc = 0
        self.chunks: list[Chunk] = []

    def write(self, b: Any) -> int:
        n = self._raw.write(b)
        view = memoryview(b).cast("B")
        written = len(view) if n is None else int(n)
        if written != len(view):  # buffered files write everything; anything else is not supported here
            raise OSError(f"short write ({written} of {len(view)} bytes) to {getattr(self._raw, 'name', '?')}")
        self._crc = zlib.crc32(view, self._crc)
        self._seg_crc = zlib.crc32(view, self._seg_crc)
        self._pos += written
        return written

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._pos > self._seg_start:
            self.chunks.append(Chunk(self._seg_start, self._pos - self._seg_start, self._seg_crc))
        self._seg_start, self._seg_crc = self._pos, 0

    def entry(self) -> FileEntry:
        self._cut()
        return FileEntry(size=self._pos, crc32=self._crc, chunks=tuple(self.chunks))

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)


class SaveGivenUpError(OSError):
    """A save given up by its checkpointer (its world broke while the save waited on a member that is gone): it
    creates no file from then on."""


class _ChecksummingFs:
    """Wraps a DCP writer's file system: every file it writes is checksummed on the way out, and none is created
    once the save is given up (``given_up``)."""

    def __init__(self, inner: Any, given_up: threading.Event | None = None) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._given_up = given_up
        self.written: dict[str, FileEntry] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if "w" in mode and self._given_up is not None and self._given_up.is_set():
            raise SaveGivenUpError(f"{path}: the save was given up (its world broke); not written")
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksumStream(raw)
            yield stream
            with self._lock:
                self.written[str(path)] = stream.entry()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            if str(path) in self.written:
                self.written[str(new_path)] = self.written.pop(str(path))


def writer_for(path: str, thread_count: int = 1, given_up: threading.Event | None = None) -> FileSystemWriter:
    """A writer that refuses to write into an existing checkpoint, checksums what it writes, and creates no file
    once ``given_up`` is set."""
    writer: FileSystemWriter
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No fsync: a put is durable once closed, and DCP's fallback for streams without a file
        # descriptor is os.sync() of the whole machine after every file.
        writer = FsspecWriter(path, thread_count=thread_count, overwrite=False, sync_files=False)
    else:
        writer = FileSystemWriter(path, thread_count=thread_count, overwrite=False)
    writer.fs = cast(Any, _ChecksummingFs(writer.fs, given_up))
    return writer


def written_files(writer: FileSystemWriter, md: Metadata) -> dict[str, FileEntry]:
    """The files this rank's ``writer`` wrote, by name in the step directory, with their CRC-32s.

    A file keeps its per-item CRC-32s only if they match the items DCP's metadata places in it
    exactly; otherwise the loader checks its whole-file CRC-32 before loading.
    """
    fs = writer.fs
    if not isinstance(fs, _ChecksummingFs):
        raise TypeError("written_files() needs a writer made by writer_for()")
    base = str(writer.path).rstrip("/")
    items: dict[str, set[tuple[int, int]]] = {}
    for info in (md.storage_data or {}).values():
        items.setdefault(str(info.relative_path), set()).add((int(info.offset), int(info.length)))
    out: dict[str, FileEntry] = {}
    for full, entry in fs.written.items():
        name = full[len(base) + 1 :] if full.startswith(base + "/") else Path(full).name
        wanted = items.get(name, set())
        chunks = tuple(c for c in entry.chunks if (c.offset, c.length) in wanted)
        exact = {(c.offset, c.length) for c in chunks} == wanted and bool(wanted)
        out[name] = FileEntry(size=entry.size, crc32=entry.crc32, chunks=chunks if exact else ())
    return out


def is_tampering(e: BaseException) -> bool:
    """Whether ``e`` (or, for DCP's gathered exception, any rank's error) refused a checkpoint as tampered."""
    if isinstance(e, CheckpointException):
        return any(isinstance(exc, CheckpointTamperedError) for exc, _trace in e.failures.values())
    return isinstance(e, CheckpointTamperedError)


def root_cause(e: BaseException) -> str:
    """``Type: message`` of what went wrong; for DCP's gathered exception, the first rank's own error."""
    if isinstance(e, CheckpointException):
        for rank, (exc, _trace) in sorted(e.failures.items()):
            return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(e).__name__}: {e}"


def read_metadata(step_path: str, storage: Storage, entry: FileEntry | None = None) -> Metadata:
    path = storage.join(step_path, METADATA)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{step_path}: no DCP {METADATA}") from None
    check_crc(data, entry, f"{step_path}/{METADATA}")
    return load_metadata_bytes(data, step_path)


def metadata_problems(step_path: str, md: Metadata, storage: Storage) -> list[str]:
    """Files that DCP's metadata lists but that are missing or shorter than the data it places in them."""
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = str(info.relative_path)
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, length in sorted(needed.items()):
        try:
            size = storage.size(storage.join(step_path, rel))
        except FileNotFoundError:
            problems.append(f"{rel} (listed in {METADATA}) is missing")
            continue
        if size < length:
            problems.append(f"{rel} has {size} bytes, {METADATA} needs {length} (truncated)")
    return problems


def check_fits(md: Metadata, template: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise :class:`CheckpointMismatchError` unless the checkpoint has exactly the template's tensors and shapes."""
    saved = md.state_dict_metadata
    missing = sorted(k for k in template if k not in saved)
    unexpected = sorted(k for k in saved if k not in template)
    misshaped = []
    for key, tensor in template.items():
        entry = saved.get(key)
        if entry is None:
            continue
        if not isinstance(entry, TensorStorageMetadata):
            misshaped.append(f"{key} (saved as bytes, expected a tensor)")
        elif tuple(entry.size) != tuple(tensor.size()):
            misshaped.append(f"{key} (saved {tuple(entry.size)}, model has {tuple(tensor.size())})")
    if missing or unexpected or misshaped:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise CheckpointMismatchError(
            f"{where} was saved from a different model or optimizer; " + "; ".join(parts) + ". Point "
            "--checkpoint-dir / ELASTRAIN_CHECKPOINT_DIR at this model's checkpoints, or start a fresh directory"
        )
