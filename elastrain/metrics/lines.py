"""JSON-lines logs that work on a local or shared filesystem and on object stores.

On a filesystem a log is one file, and each record is one ``write`` on a file opened with
``O_APPEND``: processes can share the file, and a kill leaves at most one torn last line, which
:func:`read_json_lines` skips.

Object stores (``s3://``, ``az://``, any fsspec URL) have no append. There the log's path names a
folder of *parts*: a writer buffers records and puts them as one new object per flush, named
``<nanoseconds of its first record>-<writer>-<sequence>.jsonl``. A put is atomic, so a part is
either absent or whole; nothing is ever rewritten, so writers never race. Readers concatenate the
parts in name order, which is the order in which writers started them: within one writer exactly,
across writers (a restart on another node) as far as the nodes' clocks agree, far closer than the
seconds a restart takes. A record still in a buffer when its process is killed is lost: callers
flush at the points that matter (:class:`~elastrain.metrics.series.MetricsWriter` when a
checkpoint is taken; events flush every record). :func:`compact` merges the parts into one, in
the background, so that neither a long run's start nor a reader has thousands of objects to read
(the metrics writer of rank 0 merges when it opens a segment and every 64 flushes).

No torch import: agents use this too.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from elastrain.log import lifecycle

PART_SUFFIX = ".jsonl"
COMPACTED = "-compacted"
_COMPACTED_TAIL = re.compile(r"(-compacted-[0-9a-z]+)+$")


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://...``) rather than a local path."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def append_json_line(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` to a local file as one line with a single write (atomic against other appenders)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, encode(record))
    finally:
        os.close(fd)


class LineLog:
    """Appends records to a JSON-lines log: a local file, or parts under a URL (see the module docstring).

    ``flush_every_s``: on object stores, put the buffer once its oldest record is this old (0: every
    record). ``compact_every``: on object stores, merge the log's parts in a background thread after
    every this many flushes (0: never), so that the number of parts stays small during a long run.
    Local files are written at once whatever these say.
    """

    def __init__(self, path: str | os.PathLike[str], flush_every_s: float = 0.0, compact_every: int = 0) -> None:
        self.path = os.fspath(path)
        self.flush_every_s = flush_every_s
        self.compact_every = compact_every
        self.url = is_url(self.path)
        self._fs: Any = None
        self._buffer: list[bytes] = []
        self._first_ns = 0
        self._seq = 0
        self._writer = uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        self._compactor: threading.Thread | None = None
        if self.url:
            from fsspec.core import url_to_fs

            self._fs, _ = url_to_fs(self.path)
            atexit.register(self.close)
        else:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        if not self.url:
            append_json_line(self.path, record)
            return
        with self._lock:
            if not self._buffer:
                self._first_ns = time.time_ns()
            self._buffer.append(encode(record))
            due = time.time_ns() - self._first_ns >= self.flush_every_s * 1e9
        if due:
            self.flush()

    def flush(self) -> None:
        """Put the buffered records as one new part; on failure keep them for the next flush (logged)."""
        with self._lock:
            if not self._buffer:
                return
            name = f"{self._first_ns:019d}-{self._writer}-{self._seq:06d}{PART_SUFFIX}"
            data = b"".join(self._buffer)
            try:
                self._fs.pipe_file(f"{self.path.rstrip('/')}/{name}", data)
            except OSError as e:
                lifecycle(
                    "log_flush_failed", level=logging.WARNING, path=self.path, records=len(self._buffer), error=str(e)
                )
                return
            self._buffer.clear()
            self._seq += 1
            periodic = self.compact_every > 0 and self._seq % self.compact_every == 0
        if periodic:
            self.compact_in_background()

    def compact_in_background(self) -> None:
        """Start merging the log's parts (:func:`compact`) on a thread, unless a merge is still running."""
        if not self.url or (self._compactor is not None and self._compactor.is_alive()):
            return
        self._compactor = threading.Thread(target=self._compact, name="elastrain-log-compact", daemon=True)
        self._compactor.start()

    def _compact(self) -> None:
        try:
            compact(self.path, tag=self._writer)
        except OSError as e:
            lifecycle("log_compact_failed", level=logging.WARNING, path=self.path, error=str(e))

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush, and wait (bounded) for a running merge: a merge cut short only leaves duplicates readers drop."""
        self.flush()
        compactor = self._compactor
        if compactor is not None and compactor.is_alive():
            compactor.join(timeout_s)
            if compactor.is_alive():
                lifecycle("log_compact_unfinished", level=logging.WARNING, path=self.path, waited_s=timeout_s)


def _list_parts(fs: Any, root: str) -> list[str]:
    fs.invalidate_cache()  # other processes add parts: never answer from a cached listing
    try:
        return sorted(str(p) for p in fs.find(root) if str(p) != root and str(p).endswith(PART_SUFFIX))
    except FileNotFoundError:
        return []


def _read_parts(fs: Any, parts: list[str]) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of each part in name order; one batched request on async backends (s3fs, adlfs)."""
    if not parts:
        return []
    contents = fs.cat(parts, on_error="omit")  # a part deleted meanwhile (compacted) is left out
    return [(name, _line_ended(bytes(contents[name]))) for name in sorted(contents)]


def _line_ended(data: bytes) -> bytes:
    return data if not data or data.endswith(b"\n") else data + b"\n"


def _unique_lines(data: bytes) -> bytes:
    """Each line once, first occurrence kept: a compaction cut short leaves its parts beside the merged copy."""
    seen: set[bytes] = set()
    out = []
    for line in data.splitlines(keepends=True):
        if line not in seen:
            seen.add(line)
            out.append(line)
    return b"".join(out)


def compact(path: str | os.PathLike[str], tag: str | None = None) -> int:
    """Merge the parts of the log at URL ``path`` into one part; returns how many parts it merged.

    The merged part takes the place of the newest part it contains (``<its name>-compacted-<tag>``),
    is put first, and only then are the merged parts deleted: a kill in between leaves duplicate
    lines, which readers drop. Parts written meanwhile are untouched, and each merger names its
    result with its own ``tag``, so that two merging at once never overwrite each other: every
    part deleted is inside a merged part already stored. Local files: nothing to do.
    """
    text = os.fspath(path)
    if not is_url(text):
        return 0
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(text)
    parts = _read_parts(fs, _list_parts(fs, root))
    if len(parts) < 2:
        return 0
    newest = _COMPACTED_TAIL.sub("", parts[-1][0][: -len(PART_SUFFIX)])
    target = f"{newest}{COMPACTED}-{tag or uuid.uuid4().hex[:8]}{PART_SUFFIX}"
    fs.pipe_file(target, _unique_lines(b"".join(data for _, data in parts)))
    merged = [name for name, _ in parts if name != target]
    fs.rm(merged)
    return len(parts)


def read_text(path: str | os.PathLike[str]) -> str:
    """A log's whole text: a file's content, or the concatenation of a folder's parts in name order.

    Works for local paths and URLs; a missing log reads as empty. A local folder of parts (an object
    store's log copied down) reads like the URL it came from.
    """
    text = os.fspath(path)
    if is_url(text):
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(text)
        head = _line_ended(bytes(fs.cat_file(root))) if fs.isfile(root) else b""
        parts = _read_parts(fs, _list_parts(fs, root))
        return (head + _unique_lines(b"".join(data for _, data in parts))).decode(errors="replace")
    local = Path(text)
    if local.is_dir():
        files = sorted(p for p in local.iterdir() if p.name.endswith(PART_SUFFIX) and p.is_file())
        return _unique_lines(b"".join(_line_ended(p.read_bytes()) for p in files)).decode(errors="replace")
    try:
        return local.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON object in the log at ``path``; torn or foreign lines are skipped."""
    out: list[dict[str, Any]] = []
    for line in read_text(path).splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out
