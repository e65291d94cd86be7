"""A leave ended on another thread ends the wait."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from elastrain.launcher.leave import Leave


@pytest.fixture
def logged() -> Iterator[list[str]]:
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("elastrain"), _Keep()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_the_wait_ends_when_the_leave_is_over_on_another_thread(logged: list[str]) -> None:
    leave = Leave(margin_s=600.0)
    leave.claim("SIGTERM", 600.0)
    threading.Thread(target=leave.over).start()
    assert leave.wait()
    assert not [line for line in logged if "leave_wait_gave_up" in line]
