"""How the rendezvous waits and how often it reports an error it rides out: backed-off waits, throttled log lines."""

from __future__ import annotations

import logging
import random
import time

from elastrain.log import lifecycle


class Backoff:
    """Waits that start short and grow to a ceiling, with jitter; reset when something changes."""

    def __init__(self, low: float, high: float) -> None:
        self._low, self._high, self._cur = low, high, low

    def reset(self) -> None:
        self._cur = self._low

    def sleep(self) -> None:
        time.sleep(self._cur * random.uniform(0.8, 1.2))
        self._cur = min(self._high, self._cur * 1.5)


class Throttled:
    """One log line per kind of swallowed error and interval, with a count of the ones not logged."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every = every_s
        self._last: dict[str, float] = {}
        self._hidden: dict[str, int] = {}

    def log(self, event: str, exc: BaseException, **fields: object) -> None:
        key = f"{event}:{type(exc).__name__}"
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self._every:
            self._hidden[key] = self._hidden.get(key, 0) + 1
            return
        hidden = self._hidden.pop(key, 0)
        self._last[key] = now
        lifecycle(event, level=logging.WARNING, error=repr(exc)[:200], not_logged_since=hidden, **fields)
