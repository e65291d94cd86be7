"""A store call abandoned at its deadline is awaited before the process finalises: one that ended by its own timeout
during the finalisation aborted an agent whose job had succeeded (exit -6, ``terminate called without an active
exception``; the spare test of tests/e2e/test_membership.py, once in the full suite)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
from support.processes import events_in, worker_env

from elastrain.rendezvous import deadline

# A real TCPStore client, abandoned in its handshake with a port that accepts connections and never answers (the
# kernel completes the connection; nothing reads): it waits until that port's listener closes as the process exits,
# then raises in its thread (after the client's retries, ~2 s), while the interpreter finalises. Without the wait at
# exit ("unguarded") the process aborts.
SCRIPT = textwrap.dedent(
    """
    import atexit, socket, sys, time
    from datetime import timedelta
    from torch.distributed import TCPStore
    from elastrain import log
    from elastrain.rendezvous import deadline

    log.configure()
    if sys.argv[1:] == ["unguarded"]:  # as before: measured here, the process aborts (3 runs of 3)
        atexit.unregister(deadline.await_running)
    mute = socket.create_server(("127.0.0.1", 0), backlog=8)
    port = mute.getsockname()[1]
    try:
        deadline.with_deadline(
            lambda: TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2)), 0.2
        )
    except TimeoutError:
        print("abandoned", flush=True)
    atexit.register(mute.close)  # as the process exits: the client raises then, in its thread


    class SlowToFinalise:  # the interpreter's finalisation takes a while, as a large program's does
        def __del__(self, sleep=time.sleep):
            sleep(8)


    last = SlowToFinalise()
    sys.exit(0)
    """
)


def test_a_process_that_exits_with_a_store_call_abandoned_waits_for_it_and_exits_cleanly() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=worker_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "abandoned" in out.stdout, text
    awaited = events_in(text, "store_calls_awaited")
    assert awaited and awaited[0]["count"] == "1" and awaited[0]["left"] == "0", text


def test_no_store_call_starts_once_the_process_awaits_its_running_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "_exiting", False)
    monkeypatch.setattr(deadline, "_running", set())
    release = threading.Event()
    with pytest.raises(TimeoutError):
        deadline.with_deadline(lambda: release.wait(30), 0.05)
    threading.Timer(0.3, release.set).start()
    assert deadline.await_running(limit_s=30) == 0  # the abandoned call ended, and was waited for
    with pytest.raises(TimeoutError, match="exiting"):
        deadline.with_deadline(lambda: 1, 5)
