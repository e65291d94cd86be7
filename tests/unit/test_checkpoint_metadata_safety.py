"""A crafted DCP ``.metadata`` never runs code: only an exact list of DCP's own classes is ever resolved.

The loader sees the file before anything is built from it, so the test payloads would each have a visible
effect if resolved (create a file, spawn a process, run a shell command); none may happen, and each is
refused as tampering, not as mere corruption. Real metadata written by torch 2.13 (FSDP2 / DTensor, AdamW
state, non-tensor entries stored as bytes, several dtypes) still loads.
"""

from __future__ import annotations

import copyreg
import io
import json
import logging
import os
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from support.crafted_pickle import (
    DCP_FILESYSTEM,
    DCP_METADATA,
    computed_name,
    creates_file,
    inst,
    persistent,
    pickle4,
    runs,
    spawns,
    stack_global,
    text,
)
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from elastrain.checkpoint import Checkpointer, layout
from elastrain.checkpoint.dcp_io import METADATA, load_metadata_bytes, load_planner
from elastrain.errors import CheckpointCorruptError, CheckpointTamperedError

FIXTURES = Path(__file__).parent / "dcp_metadata"


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[Path]:
    """A file that a payload would create; and no child process may appear while the test runs."""
    path = tmp_path / "PWNED"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield path
    spawned = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not spawned, f"a payload spawned processes {spawned}"
    assert not path.exists(), "a payload ran"


def test_real_torch_metadata_loads() -> None:
    data = (FIXTURES / "fsdp2-adamw-2ranks.metadata").read_bytes()
    md = load_metadata_bytes(data, "fsdp2")
    assert md.state_dict_metadata == pickle.loads(data).state_dict_metadata
    kinds = {type(v) for v in md.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata, BytesStorageMetadata}  # DTensor shards and optimizer scalars as bytes
    dtypes = {v.properties.dtype for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata)}
    assert {torch.float32, torch.bfloat16, torch.int32, torch.bool, torch.float8_e4m3fn} <= dtypes


def test_metadata_that_elastrain_writes_loads(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.register(model=model, optimizer=opt)
        ckpt.save(1, blocking=True)
    step = tmp_path / layout.step_dir_name(1)
    md = load_metadata_bytes((step / METADATA).read_bytes(), str(step))
    assert "model/0.weight" in md.state_dict_metadata and "optimizer/state/0.weight/exp_avg" in md.state_dict_metadata


HOSTILE = {
    # The review's payload: protocol 4 follows a dotted name through the allowed module's imports.
    "popen through torch._strobelight": lambda p: spawns(["touch", str(p)]),
    "popen through the filesystem module": lambda p: spawns(["touch", str(p)], module=DCP_FILESYSTEM),
    "a class that creates a file": lambda p: creates_file(str(p)),
    "the same through the metadata module": lambda p: creates_file(str(p), DCP_METADATA, "os.fdopen"),
    "os.system through an allowed module": lambda p: runs(f"touch {p}", DCP_METADATA, "os.system"),
    "a dotted name under torch": lambda p: runs(f"touch {p}", "torch", "serialization.os.system"),
    "builtins through a module's globals": lambda p: runs(f"open({str(p)!r}, 'w')", DCP_METADATA, "__builtins__.eval"),
    "builtins through an allowed class": lambda p: runs(f"open({str(p)!r}, 'w')", "torch", "Size.__init__.eval"),
    "builtins.eval": lambda p: runs(f"open({str(p)!r}, 'w')", "builtins", "eval"),
    "builtins.exec, text GLOBAL": lambda p: runs(f"open({str(p)!r}, 'w')", "builtins", "exec", stack=False),
    "builtins.getattr": lambda p: runs("system", "builtins", "getattr"),
    "posix.system": lambda p: runs(f"touch {p}", "posix", "system"),
    "os.system, text GLOBAL": lambda p: runs(f"touch {p}", "os", "system", stack=False),
    "subprocess.getoutput": lambda p: runs(f"touch {p}", "subprocess", "getoutput"),
    "a name computed from the memo": lambda p: computed_name(str(p)),
    "the INST opcode": lambda p: inst(str(p)),
    "an allowed class's dunder": lambda p: pickle4(stack_global(DCP_METADATA, "Metadata.__init__") + b"."),
    "a persistent id": lambda p: persistent(f"touch {p}"),
    "a __reduce__ that calls os.system": lambda p: pickle.dumps(_Reduces(f"touch {p}")),
}


class _Reduces:
    """What ``pickle.dumps`` writes for an object whose ``__reduce__`` names ``os.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_crafted_metadata_never_runs_code_and_is_refused_as_tampering(name: str, sentinel: Path) -> None:
    with pytest.raises(CheckpointTamperedError, match=r"\.metadata was refused"):
        load_metadata_bytes(HOSTILE[name](sentinel), "step-7")


def test_an_extension_code_resolves_through_the_same_list(sentinel: Path) -> None:
    code = 0x7FFF_FFF0
    copyreg.add_extension("io", "FileIO", code)
    try:
        payload = pickle4(b"\x84" + code.to_bytes(4, "little") + b"(" + text(str(sentinel)) + text("w") + b"tR")
        with pytest.raises(CheckpointTamperedError, match=r"io\.FileIO"):
            load_metadata_bytes(payload, "step-7")
    finally:
        copyreg.remove_extension("io", "FileIO", code)


def test_a_payload_after_real_metadata_is_refused_too(sentinel: Path) -> None:
    real = (FIXTURES / "fsdp2-adamw-2ranks.metadata").read_bytes()
    # Valid metadata first (kept on the stack), then the payload's result replaces it: still never resolved.
    mixed = real[:-1] + b"0" + creates_file(str(sentinel))[2:]
    with pytest.raises(CheckpointTamperedError):
        load_metadata_bytes(mixed, "step-7")


def _metadata(relative_path: str, entry: object = None) -> bytes:
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    tensor = TensorStorageMetadata(properties=props, size=torch.Size([2]), chunks=[chunk])
    index = MetadataIndex("model/w", torch.Size([0]))
    md = Metadata(
        state_dict_metadata={"model/w": tensor if entry is None else entry},  # type: ignore[dict-item]
        storage_data={index: dcp_filesystem._StorageInfo(relative_path, 0, 8)},
    )
    return pickle.dumps(md, protocol=4)


@pytest.mark.parametrize("where", ["/etc/passwd", "../../secrets.bin", "sub/../../x", "\\\\host\\share"])
def test_metadata_that_reads_outside_its_directory_is_refused(where: str) -> None:
    with pytest.raises(CheckpointTamperedError, match="outside its directory"):
        load_metadata_bytes(_metadata(where), "step-7")
    load_metadata_bytes(_metadata("__0_0.distcp"), "step-7")  # the names DCP writes


def test_metadata_whose_entries_are_not_storage_entries_is_refused() -> None:
    with pytest.raises(CheckpointTamperedError, match="entry model/w is a OrderedDict"):
        load_metadata_bytes(_metadata("__0_0.distcp", entry=__import__("collections").OrderedDict()), "step-7")
    with pytest.raises(CheckpointTamperedError, match="does not hold DCP metadata"):
        load_metadata_bytes(pickle.dumps(torch.Size([1])), "step-7")


def test_damage_that_is_not_tampering_is_reported_as_corrupt() -> None:
    real = (FIXTURES / "fsdp2-adamw-2ranks.metadata").read_bytes()
    with pytest.raises(CheckpointCorruptError, match="unreadable") as err:
        load_metadata_bytes(real[: len(real) // 2], "step-7")
    assert not isinstance(err.value, CheckpointTamperedError)


def test_the_load_planner_never_unpickles_an_entry_stored_as_bytes(sentinel: Path) -> None:
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("model/w"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("model/w"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(CheckpointTamperedError, match="model/w is stored as pickled bytes"):
        load_planner().load_bytes(item, io.BytesIO(pickle.dumps(_Reduces(f"touch {sentinel}"))))


def test_an_entry_stored_as_pickled_bytes_is_refused_and_an_older_step_restored(
    tmp_path: Path, sentinel: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DCP would unpickle an entry stored as bytes with ``weights_only=False``; elastrain never writes one."""
    model = torch.nn.Linear(2, 1)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.register(model=model)
        ckpt.save(1, blocking=True)
        ckpt.save(2, blocking=True)
    step = tmp_path / layout.step_dir_name(2)
    md = pickle.loads((step / METADATA).read_bytes())
    md.state_dict_metadata["model/weight"] = BytesStorageMetadata()
    data = pickle.dumps(md)
    (step / METADATA).write_bytes(data)
    marker = json.loads((step / layout.MARKER).read_text())
    marker["files"][METADATA] = {"size": len(data), "crc32": zlib.crc32(data)}
    (step / layout.MARKER).write_text(json.dumps(marker))
    again = Checkpointer(tmp_path, async_save=False)
    again.register(model=torch.nn.Linear(2, 1))
    with caplog.at_level(logging.ERROR, logger="elastrain"):
        info = again.restore()
    again.close()
    assert info is not None and info.step == 1
    tampered = [r.getMessage() for r in caplog.records if "event=checkpoint_tampered" in r.getMessage()]
    assert len(tampered) == 1 and "step=2" in tampered[0] and "model/weight as pickled bytes" in tampered[0]


def _malformed(kind: str) -> bytes:
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    tensor = TensorStorageMetadata(properties=props, size=torch.Size([2]), chunks=[chunk])
    info = dcp_filesystem._StorageInfo("__0_0.distcp", 0, 8)
    storage: dict[object, object] = {MetadataIndex("model/w", torch.Size([0])): info}
    if kind == "size":
        tensor.size = [2]  # type: ignore[assignment]
    elif kind == "chunks":
        tensor.chunks = {"0": chunk}  # type: ignore[assignment]
    elif kind == "dtype":
        props.dtype = "float32"  # type: ignore[assignment]
    elif kind == "index":
        storage = {"model/w": info}
    elif kind == "offset":
        info.offset = -8
    md = Metadata(state_dict_metadata={"model/w": tensor}, storage_data=storage)
    return pickle.dumps(md, protocol=4)


@pytest.mark.parametrize("kind", ["size", "chunks", "dtype", "index", "offset"])
def test_malformed_metadata_is_refused_with_a_typed_error(kind: str) -> None:
    with pytest.raises(CheckpointTamperedError):
        load_metadata_bytes(_malformed(kind), "step-7")
    load_metadata_bytes(_malformed("none"), "step-7")
