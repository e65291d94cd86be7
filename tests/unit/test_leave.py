"""A node's leave: claimed once, and the main loop's wait for it is bounded by its deadline plus a margin."""

from __future__ import annotations

import time

from elastrain.launcher.leave import Leave


def test_only_the_first_claim_is_the_leave() -> None:
    leave = Leave()
    assert leave.reason is None and leave.wait()  # nothing to wait for
    assert leave.claim("preemption:azure:Preempt", 30.0)
    assert not leave.claim("SIGTERM", 25.0)
    assert leave.reason == "preemption:azure:Preempt"


def test_a_leave_that_never_ends_is_given_up_after_its_deadline_and_the_margin(logged: list[str]) -> None:
    leave = Leave(margin_s=0.2)
    leave.claim("preemption:gcp:preempted", 0.3)  # its checkpoint hangs: over() never comes
    started = time.monotonic()
    assert not leave.wait()
    assert time.monotonic() - started >= 0.45  # waited the deadline and the margin, not less
    (gave_up,) = [line for line in logged if "event=leave_wait_gave_up" in line]
    assert "reason=preemption:gcp:preempted" in gave_up


def test_a_deadline_already_past_still_waits_the_margin_only() -> None:
    leave = Leave(margin_s=0.1)
    leave.claim("late notice", -5.0)
    assert not leave.wait()


def test_a_claim_from_a_signal_handler_while_the_same_thread_waits_does_not_deadlock() -> None:
    """The SIGTERM handler runs on the main thread, possibly inside wait(): claim() must not block there."""
    leave = Leave(margin_s=0.0)
    with leave._lock:  # what wait() holds for a moment on the main thread
        assert leave.claim("SIGTERM", 0.0)
