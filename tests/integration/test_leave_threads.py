"""A leave ended on another thread ends the wait."""

from __future__ import annotations

import threading

from elastrain.launcher.leave import Leave


def test_the_wait_ends_when_the_leave_is_over_on_another_thread(logged: list[str]) -> None:
    leave = Leave(margin_s=600.0)
    leave.claim("SIGTERM", 600.0)
    threading.Thread(target=leave.over).start()
    assert leave.wait()
    assert not [line for line in logged if "leave_wait_gave_up" in line]
