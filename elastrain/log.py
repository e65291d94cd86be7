"""One structured log line per lifecycle event.

Lines are logfmt (``elastrain event=rendezvous_done round=3 world_size=2->1``) so that people can read
them and tools can parse them with :func:`parse_event_line`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from elastrain import env

logger = logging.getLogger("elastrain")

_configured = False


def configure(level: str | None = None) -> None:
    """Send elastrain's log lines to stderr once per process (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel((level or os.environ.get(env.LOG_LEVEL) or "INFO").upper())
    logger.propagate = False


def _fmt(value: Any) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if text == "" or any(c in text for c in ' "='):
        return '"' + text.replace('"', '\\"') + '"'
    return text


def format_event(event: str, **fields: Any) -> str:
    parts = [f"event={event}"] + [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
    return "elastrain " + " ".join(parts)


def lifecycle(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one lifecycle event: ``lifecycle("world_size_changed", old=2, new=1)``."""
    fields.setdefault("t", round(time.time(), 3))
    fields.setdefault("pid", os.getpid())
    logger.log(level, format_event(event, **fields))


def parse_event_line(line: str) -> dict[str, str] | None:
    """Inverse of :func:`format_event` for one line; ``None`` if the line is not an elastrain event."""
    idx = line.find("elastrain event=")
    if idx < 0:
        return None
    text = line[idx + len("elastrain ") :]
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip()
        j = eq + 1
        if j < len(text) and text[j] == '"':
            k = j + 1
            buf = []
            while k < len(text) and text[k] != '"':
                if text[k] == "\\" and k + 1 < len(text):
                    k += 1
                buf.append(text[k])
                k += 1
            out[key] = "".join(buf)
            i = k + 2
        else:
            sp = text.find(" ", j)
            sp = len(text) if sp < 0 else sp
            out[key] = text[j:sp]
            i = sp + 1
    return out
