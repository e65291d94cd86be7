"""A store call bounded by a deadline, and the calls still running when the process exits.

A TCPStore client call can block for good (a frozen host's store, a network cut), so every call runs in a daemon
thread that the caller abandons at its deadline. An abandoned call most often ends later by the client's own timeout,
raising in its thread. If that happens while the interpreter finalises, the thread cannot take the GIL back through
the C++ frames it raises in, and the process aborts (``terminate called without an active exception``, exit -6): an
agent whose job had succeeded ended that way in the full suite. So the process awaits its running calls before it
finalises (an ``atexit`` hook, bounded by :data:`EXIT_WAIT_S`), and starts none after that.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

from elastrain.log import lifecycle

_T = TypeVar("_T")

EXIT_WAIT_S = 10.0
"""The longest the process waits at exit for its running store calls (a client's own timeouts are 3-5 s)."""

_lock = threading.Lock()
_running: set[threading.Thread] = set()
_exiting = False


def with_deadline(op: Callable[[], _T], timeout_s: float) -> _T:
    """``op()`` in a daemon thread; TimeoutError if it has not returned within ``timeout_s`` (it is abandoned, and
    awaited at the process's exit)."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["out"] = op()
        except BaseException as exc:  # handed to the caller below
            box["err"] = exc
        finally:
            with _lock:
                _running.discard(threading.current_thread())
            done.set()

    thread = threading.Thread(target=run, name="elastrain-store-call", daemon=True)
    with _lock:  # started and recorded at once: the exit never joins a thread not started yet (run() takes the lock
        if _exiting:  # only as it ends, after this block)
            raise TimeoutError("the process is exiting: no rendezvous store call starts any more")
        thread.start()
        _running.add(thread)
    if not done.wait(timeout_s):
        raise TimeoutError(f"a rendezvous store call did not return in {timeout_s}s")
    if "err" in box:
        raise cast(BaseException, box["err"])
    return cast(_T, box["out"])


def await_running(limit_s: float = EXIT_WAIT_S) -> int:
    """Before the interpreter finalises: wait (bounded by ``limit_s``) for the store calls still running, and start no
    more; how many still run after it (each may still abort the process if it ends during the finalisation)."""
    global _exiting
    with _lock:
        _exiting = True
        running = list(_running)
    if not running:
        return 0
    started = time.monotonic()
    deadline = started + limit_s
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = sum(1 for t in running if t.is_alive())
    lifecycle(
        "store_calls_awaited",
        count=len(running),
        left=left,
        waited_s=round(time.monotonic() - started, 3),
        why="a store call that ends while the interpreter finalises aborts the process",
    )
    return left


atexit.register(await_running)
