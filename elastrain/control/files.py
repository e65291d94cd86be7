"""One file of a node's control directory: written whole or not at all, read back through one checked path.

Each file in a node's control directory (``ELASTRAIN_CONTROL_DIR``) holds one JSON object, written by the
agent or a worker of the same launcher (:func:`write_atomic`: a temporary file and a rename). Reading
one (:class:`MessageReader`) decodes it into a typed message through :class:`Fields`; anything else
there (not JSON, another shape, a directory, an older or newer launcher's file) decodes to
:class:`~elastrain.errors.ControlMessageError`, naming the file and the field, which the reader logs
once per content of the file and reads as no message, so a stray file never crashes an agent or a
worker. :func:`poll` is the bounded wait both channels use.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from elastrain.errors import ControlMessageError
from elastrain.log import lifecycle

_T = TypeVar("_T")
# Temporary names unique per process, thread and call: two writers of one file never share one.
_TMP_SEQUENCE = itertools.count()


def write_atomic(path: Path, payload: dict[str, object]) -> None:
    """Write ``path`` whole or not at all; safe from any number of threads and processes at once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_TMP_SEQUENCE)}.tmp")
    try:
        with open(tmp, "x") as f:  # exclusive: a name that is somehow taken fails here, not at the rename
            f.write(json.dumps(payload))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def poll(get: Callable[[], _T], done: Callable[[_T], bool], timeout_s: float, poll_s: float) -> _T:
    """``get()`` every ``poll_s`` until ``done`` says its value will do or ``timeout_s`` passed; the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(poll_s)


class Fields:
    """The fields of one decoded JSON object, each read with a type check; errors name the file and field."""

    def __init__(self, data: object, source: str) -> None:
        if not isinstance(data, dict):
            raise ControlMessageError(f"{source}: expected a JSON object, got {type(data).__name__}")
        self._data: dict[str, object] = data
        self.source = source

    @classmethod
    def parse(cls, raw: bytes | str, source: str) -> Fields:
        """The object in ``raw`` (a whole file); :class:`ControlMessageError` if it is not JSON."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ControlMessageError(f"{source}: not JSON ({type(exc).__name__}: {exc})"[:300]) from None
        return cls(data, source)

    def _bad(self, key: str, wanted: str, value: object) -> ControlMessageError:
        return ControlMessageError(f"{self.source}: field {key!r} must be {wanted}, got {value!r}"[:300])

    def _get(self, key: str) -> object:
        if key not in self._data:
            raise ControlMessageError(f"{self.source}: missing field {key!r}")
        return self._data[key]

    def has(self, key: str) -> bool:
        return key in self._data

    def integer(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer", value)
        return value

    def optional_integer(self, key: str) -> int | None:
        """An integer or ``null`` (the field must be there)."""
        return None if self._get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        """A finite number (JSON allows ``NaN`` and ``Infinity`` as Python writes them; a time must not be)."""
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._bad(key, "a finite number", value)
        return float(value)

    def text(self, key: str, default: str | None = None) -> str:
        if default is not None and key not in self._data:
            return default
        value = self._get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._data.get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def integer_map(self, key: str) -> dict[int, int]:
        """An object whose keys are decimal integers and whose values are integers."""
        value = self._get(key)
        if not isinstance(value, dict):
            raise self._bad(key, "an object", value)
        out: dict[int, int] = {}
        for k, v in value.items():
            try:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(v)
                out[int(k)] = v
            except ValueError:
                raise self._bad(key, "a map of integers to integers", value) from None
        return out


class MessageReader:
    """Reads control files for one channel: a missing file is no message; a file that does not decode is
    logged (``control_message_invalid``, once per content of that file) and is no message either."""

    def __init__(self) -> None:
        self._reported: dict[Path, int] = {}

    def read(self, path: Path, decode: Callable[[Fields], _T]) -> _T | None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # a directory or an unreadable file in its place
            self._report(path, hash(repr(exc)), ControlMessageError(f"{path.name}: cannot be read ({exc})"))
            return None
        try:
            return decode(Fields.parse(raw, path.name))
        except ControlMessageError as exc:
            self._report(path, hash(raw), exc)
            return None

    def _report(self, path: Path, version: int, exc: ControlMessageError) -> None:
        if self._reported.get(path) == version:
            return  # read again at the next poll: said once is enough
        self._reported[path] = version
        lifecycle(
            "control_message_invalid",
            level=logging.WARNING,
            file=str(path),
            error=str(exc),
            action="ignored: read as no message",
        )
