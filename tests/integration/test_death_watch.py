"""The death watch (elastrain/rendezvous/death_watch.py) against real probe listeners in real processes: a peer's
death reads at once through the connection its kernel closes, a dead port is not dialled again before the rearm,
and a listener holding watchers' connections still answers probes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.processes import free_port

from elastrain.rendezvous import liveness
from elastrain.rendezvous.death_watch import DeathWatch

_LISTENER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from elastrain.rendezvous.liveness import ProbeListener
listener = ProbeListener("127.0.0.1")
print(listener.port, flush=True)
time.sleep(600)
"""


@contextmanager
def peer() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A process whose only job is a probe listener, as an agent's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER, root], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def watch(rearm_s: float = 60.0) -> Iterator[tuple[DeathWatch, threading.Event]]:
    wake = threading.Event()
    w = DeathWatch(wake, rearm_s)
    try:
        yield w, wake
    finally:
        w.close()


def test_a_watched_peer_killed_wakes_the_watcher_through_its_closed_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with peer() as (proc, port), watch() as (w, wake):
        w.follow({"p": ("127.0.0.1", port)})
        # Held connections do not keep the listener from answering probes (three more, to the same listener).
        w.follow({"p": ("127.0.0.1", port), "q": ("127.0.0.1", port), "r": ("127.0.0.1", port)})
        assert not liveness.refused({"p": ("127.0.0.1", port)}, 2.0)
        assert not wake.wait(0.5) and w.closed() == set()  # a live peer: nothing to report
        with caplog.at_level(logging.INFO, logger="elastrain"):
            os.kill(proc.pid, signal.SIGKILL)
            assert wake.wait(30), "the peer's death never woke the watcher"
            proc.wait(timeout=10)
            closed: set[str] = set()
            for _ in range(30):  # the three connections close together; the wake may come after the first
                closed |= w.closed()
                if closed == {"p", "q", "r"}:
                    break
                wake.clear()
                wake.wait(1)
        assert closed == {"p", "q", "r"}
        whys = [r.getMessage() for r in caplog.records if "peer_connection_closed" in r.getMessage()]
        # End of file (or a reset): the connection was open when the peer died, not a connect refused afterwards.
        assert whys and not any("ECONNREFUSED" in m for m in whys), whys


def test_a_dead_port_is_dialled_again_only_after_the_rearm(caplog: pytest.LogCaptureFixture) -> None:
    dead = ("127.0.0.1", free_port())  # nothing listens there
    with watch(rearm_s=60.0) as (w, wake):
        w.follow({"d": dead})
        assert wake.wait(30) and w.closed() == {"d"}
        wake.clear()
        w.follow({"d": dead})  # the next beat, well within the rearm: not dialled again
        assert not wake.wait(0.5) and w.closed() == set()
    with watch(rearm_s=0.0) as (w, wake), caplog.at_level(logging.DEBUG, logger="elastrain"):
        w.follow({"d": dead})
        assert wake.wait(30) and w.closed() == {"d"}
        wake.clear()
        w.follow({"d": dead})  # past the rearm: dialled again, refused again
        assert wake.wait(30) and w.closed() == {"d"}
    levels = [r.levelno for r in caplog.records if "peer_connection_closed" in r.getMessage()]
    assert levels[-2:] == [logging.INFO, logging.DEBUG]  # a peer still dead at its rearm is said once


def test_a_peer_no_longer_followed_is_let_go() -> None:
    with peer() as (proc, port), watch() as (w, wake):
        w.follow({"p": ("127.0.0.1", port)})
        assert not wake.wait(0.5)
        w.follow({})
        assert not wake.wait(0.5)  # our own close is no death
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert not wake.wait(0.5) and w.closed() == set()


def test_a_watch_that_never_followed_anyone_closes_its_sockets() -> None:
    wake = threading.Event()
    w = DeathWatch(wake, 1.0)
    before = len(os.listdir("/proc/self/fd"))
    w.close()
    assert len(os.listdir("/proc/self/fd")) == before - 2  # its poke pair
    w.follow({"p": ("127.0.0.1", free_port())})  # after close: nothing starts
    assert not wake.wait(0.3)
