"""torch.distributed.checkpoint (DCP) readers and writers, made safe and checkable.

DCP stores its ``.metadata`` with :mod:`pickle`. A checkpoint directory may come from anywhere
(a shared bucket, another job), so :class:`SafeReader` reads it with an unpickler that only builds
DCP's own metadata classes, torch sizes and dtypes. Tensor data is read by DCP with
``weights_only=True``; elastrain never hands DCP a non-tensor value, so nothing else is unpickled.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from elastrain.checkpoint.storage import Storage, is_url
from elastrain.errors import CheckpointCorruptError, CheckpointMismatchError

METADATA = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING":
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which elastrain does not load")


def load_metadata_bytes(data: bytes, where: str) -> Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata types; corrupt input raises CheckpointCorruptError."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointCorruptError(f"{where}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{where}: {METADATA} does not hold DCP metadata")
    return md


def _safe_read_metadata(reader: FileSystemReader, rank: int | None) -> Metadata:
    path = reader._get_metadata_path(rank)
    with reader.fs.create_stream(path, "rb") as f:
        md = load_metadata_bytes(f.read(), str(reader.path))
    if md.storage_meta is not None:
        md.storage_meta.load_id = reader.load_id
    return md


class SafeReader(FileSystemReader):
    """DCP's filesystem reader with a restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _safe_read_metadata(self, kwargs.get("rank"))


def reader_for(path: str) -> FileSystemReader:
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(FsspecReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
                return _safe_read_metadata(self, kwargs.get("rank"))

        return SafeFsspecReader(path)
    return SafeReader(path)


def writer_for(path: str, thread_count: int = 1) -> FileSystemWriter:
    """A writer that refuses to write into an existing checkpoint (step directories are never reused)."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # No fsync: a put is durable once closed, and DCP's fallback for streams without a file
        # descriptor is os.sync() of the whole machine after every file.
        return FsspecWriter(path, thread_count=thread_count, overwrite=False, sync_files=False)
    return FileSystemWriter(path, thread_count=thread_count, overwrite=False)


def read_metadata(step_path: str, storage: Storage) -> Metadata:
    path = storage.join(step_path, METADATA)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{step_path}: no DCP {METADATA}") from None
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
