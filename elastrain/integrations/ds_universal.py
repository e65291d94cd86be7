"""Converting a DeepSpeed checkpoint to DeepSpeed's universal format, once, safely.

DeepSpeed loads ZeRO optimizer state only at the world size it was saved at; its universal format
(``deepspeed.checkpoint.ds_to_universal``) loads at any. The conversion is cached beside the
checkpoint it came from::

    <root>/step-0000000100/                         # the committed DeepSpeed checkpoint
    <root>/step-0000000100/universal/               # its universal form, with its own commit marker
    <root>/step-0000000100/.universal-<pid>-<hex>/  # a conversion in progress (or a killed one's leftover)

The converter reads a view of the step's own top-level files (symbolic links in the temporary
directory: ``ds_to_universal`` walks its input folder recursively, so a killed conversion's leftover
or a damaged ``universal`` directory under the step would otherwise be read as extra shards) and
writes into the same fresh temporary directory; elastrain writes a commit marker there listing
every file with its length and CRC-32, and only then renames the output directory to
``universal``. A conversion killed at any point leaves at most a temporary directory, which is
never loaded and is removed by a later conversion (once it is an hour old, so that a conversion
still running elsewhere is left alone) or with its step directory; a ``universal`` directory is
loaded only after its marker verifies. Nothing here imports torch.distributed: one process
converts, the caller coordinates the others.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from elastrain.checkpoint import layout
from elastrain.errors import CheckpointCorruptError, CheckpointError
from elastrain.storage import fsync_dir

UNIVERSAL = "universal"
_TMP_PREFIX = ".universal-"


class ConversionError(CheckpointError):
    """``ds_to_universal`` failed; the message carries the end of its output."""


def universal_dir(step_path: str | os.PathLike[str]) -> Path:
    return Path(step_path) / UNIVERSAL


def committed_universal(step_path: str | os.PathLike[str], checksum: bool = True) -> layout.CommitMarker | None:
    """The marker of a complete, verified universal conversion of ``step_path``; ``None`` if there is none."""
    target = universal_dir(step_path)
    if not target.is_dir():
        return None
    try:
        return layout.verify_step(str(target), checksum=checksum)
    except CheckpointCorruptError:
        return None


def stale_temporaries(step_path: str | os.PathLike[str], older_than_s: float = 0.0) -> list[Path]:
    """Temporary conversion directories under ``step_path`` untouched for ``older_than_s`` seconds."""
    now = time.time()
    out = []
    for child in Path(step_path).iterdir():
        if child.name.startswith(_TMP_PREFIX) and child.is_dir():
            try:
                if now - child.stat().st_mtime >= older_than_s:
                    out.append(child)
            except FileNotFoundError:
                continue
    return sorted(out)


def converter_command(step_path: str | os.PathLike[str], output: str | os.PathLike[str]) -> list[str]:
    """The ``ds_to_universal`` command line (one worker process each: conversion runs beside training)."""
    return [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        os.fspath(step_path),
        "--output_folder",
        os.fspath(output),
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def convert(
    step_path: str | os.PathLike[str],
    step: int,
    source_world_size: int,
    timeout_s: float = 1800.0,
    checksum: bool = True,
    stale_after_s: float = 3600.0,
) -> Path:
    """Convert ``step_path`` to universal form unless a verified conversion exists; its directory.

    Call from one process. Safe against a kill at any point (see the module docstring) and against
    a second converter racing this one (the loser's rename fails and it uses the winner's result).
    """
    target = universal_dir(step_path)
    if committed_universal(step_path, checksum) is not None:
        return target
    if target.exists():
        # A directory named ``universal`` that does not verify was damaged after its commit.
        shutil.rmtree(target, ignore_errors=True)
    # Leftovers of killed conversions; young ones may belong to a conversion still running elsewhere.
    for leftover in stale_temporaries(step_path, older_than_s=stale_after_s):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(step_path) / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    source, out = tmp / "input", tmp / "output"
    source.mkdir(parents=True)
    for entry in Path(step_path).iterdir():
        if entry.is_file():
            (source / entry.name).symlink_to(entry.resolve())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(
            converter_command(source, out),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConversionError(f"{step_path}: ds_to_universal ran past {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise ConversionError(f"{step_path}: ds_to_universal exited with {proc.returncode}:\n{tail}")
    shutil.rmtree(out / "tmp", ignore_errors=True)  # the converter's scratch space, if it left it
    _fsync_tree(out)
    marker = layout.CommitMarker(
        step=step,
        world_size=source_world_size,
        files=layout.manifest(str(out), checksum=checksum),
        kind="deepspeed-universal",
    )
    layout.write_commit_marker(str(out), marker)
    try:
        os.rename(out, target)
    except OSError:
        # Another converter won the race; its result is as good as ours.
        if committed_universal(step_path, checksum) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{target} exists but does not verify after a concurrent conversion") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(os.fspath(step_path))
    return target
