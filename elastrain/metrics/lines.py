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
checkpoint is taken; events flush every record).

No torch import: agents use this too.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from elastrain.log import lifecycle

PART_SUFFIX = ".jsonl"


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
    record). Local files are written at once whatever it says.
    """

    def __init__(self, path: str | os.PathLike[str], flush_every_s: float = 0.0) -> None:
        self.path = os.fspath(path)
        self.flush_every_s = flush_every_s
        self.url = is_url(self.path)
        self._fs: Any = None
        self._buffer: list[bytes] = []
        self._first_ns = 0
        self._seq = 0
        self._writer = uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        if self.url:
            from fsspec.core import url_to_fs

            self._fs, _ = url_to_fs(self.path)
            atexit.register(self.flush)
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


def read_text(path: str | os.PathLike[str]) -> str:
    """A log's whole text: a file's content, or the concatenation of a folder's parts in name order.

    Works for local paths and URLs; a missing log reads as empty. A local folder of parts (an object
    store's log copied down) reads like the URL it came from.
    """
    text = os.fspath(path)
    if is_url(text):
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(text)
        fs.invalidate_cache()
        chunks: list[bytes] = []
        if fs.isfile(root):
            chunks.append(bytes(fs.cat_file(root)))
        try:
            parts = sorted(p for p in fs.find(root) if str(p) != root and str(p).endswith(PART_SUFFIX))
        except FileNotFoundError:
            parts = []
        if parts:
            # One batched request on async backends (s3fs, adlfs); a part deleted meanwhile is left out.
            contents = fs.cat(parts, on_error="omit")
            chunks.extend(bytes(contents[p]) for p in sorted(contents))
        return b"".join(c if c.endswith(b"\n") or not c else c + b"\n" for c in chunks).decode(errors="replace")
    local = Path(text)
    if local.is_dir():
        parts_local = sorted(p for p in local.iterdir() if p.name.endswith(PART_SUFFIX) and p.is_file())
        return "".join(_line_ended(p.read_text(errors="replace")) for p in parts_local)
    try:
        return local.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _line_ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


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
