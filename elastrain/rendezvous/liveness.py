"""How a node learns that a peer is gone, and that it was itself the one that stalled.

* Every agent listens on a *probe port* for as long as its process lives (:class:`ProbeListener`). A
  refused connection proves that the process is gone (its host answers, nothing listens); a timeout
  or an unreachable address proves nothing, and the heartbeat timeout decides.
* Suspects are probed together, with one deadline for all of them (:func:`refused`), so that a dozen
  nodes vanishing at once costs one short wait, not a dozen.
* A node judges its own stall from its heartbeat thread's scheduling (:class:`TickClock`): when the
  thread wakes up much later than it asked to (the process was frozen or starved of CPU), or a read of
  the store itself took that long, its view of the others' heartbeats is stale and proves nothing.
  The time it spends probing or evicting is its own work, not a stall.
* A node knows when it was silent long enough for its peers to judge it dead (:class:`Pulse`: a thread that
  only sleeps, so a wake-up far later than asked means the process was frozen, never that a store call hung):
  the job may have trained on without it.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from elastrain import binding
from elastrain.log import lifecycle
from elastrain.rendezvous import dial
from elastrain.rendezvous.trust import split_address


class ProbeListener:
    """A listening socket that exists exactly as long as this process: peers probe it to detect our death.

    A connection a peer keeps open (:mod:`~elastrain.rendezvous.death_watch`) is held, silent, until that peer closes
    it: the kernel closes it when this process dies, and the peer reads that at once. At most ``HELD`` are held; a
    connection beyond them is closed at once, as a probe's is."""

    HELD = 4096

    def __init__(self, host: str = "") -> None:
        """Listen on ``host`` (the interface of this node's advertised address; "" for every one)."""
        self._sock = binding.bound_socket(host, 0)
        self.port = int(self._sock.getsockname()[1])
        threading.Thread(target=self._serve, name="elastrain-probe", daemon=True).start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is not None:  # a held connection: its peer closed it (or sent what nobody reads)
                    conn = cast(socket.socket, key.fileobj)
                    try:
                        if conn.recv(4096):
                            continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass  # reset: closed as well
                    sel.unregister(conn)
                    conn.close()
                    continue
                try:
                    conn, _ = self._sock.accept()
                except OSError as exc:
                    lifecycle("probe_listener_closed", level=logging.DEBUG, error=repr(exc))
                    sel.close()
                    return
                if len(sel.get_map()) > self.HELD:
                    conn.close()
                    continue
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ, True)


def refused_at(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a connection to ``host:port`` (``[v6]:port`` too) is actively refused: nothing listens there."""
    return bool(refused({address: split_address(address)}, timeout_s))


def refused(targets: Mapping[str, tuple[str, int]], timeout_s: float) -> set[str]:
    """The targets (name -> (host, port)) whose connection is actively refused at every address the host resolves to
    (:mod:`~elastrain.rendezvous.dial`), all probed at once.

    Non-blocking connects share one deadline; whatever has not answered by then (frozen, cut off, unreachable), and
    a host that does not resolve, is not counted as refused.
    """
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    dialled: dict[str, int] = {}
    refusals: dict[str, int] = {}
    try:
        for name, (host, port) in targets.items():
            if not port:
                continue
            begun = dial.begin(host, port)
            dialled[name], refusals[name] = begun.addresses, begun.refused
            for sock in begun.under_way:
                socks.append(sock)
                sel.register(sock, selectors.EVENT_WRITE, name)
        deadline = time.monotonic() + timeout_s
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sock = cast(socket.socket, key.fileobj)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                    refusals[str(key.data)] += 1
                sel.unregister(sock)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return {name for name, n in dialled.items() if n and refusals[name] == n}


@dataclass
class TickClock:
    """The heartbeat thread's own schedule: was this process frozen or starved since the last tick?"""

    interval_s: float
    stall_s: float
    next_at: float | None = None
    stalled_at: float = -1e18

    def wait_s(self, now: float) -> float:
        return self.interval_s if self.next_at is None else max(0.0, self.next_at - now)

    def woke(self, now: float) -> bool:
        """Record a wake-up at ``now``; True if it came ``stall_s`` later than scheduled."""
        late = self.next_at is not None and now - self.next_at > self.stall_s
        if late:
            self.stalled_at = now
        return late

    def store_took(self, started: float, ended: float) -> bool:
        """A store read that took ``stall_s`` or more leaves this node with a stale view, like a freeze."""
        slow = ended - started > self.stall_s
        if slow:
            self.stalled_at = ended
        return slow

    def done(self, now: float) -> None:
        self.next_at = now + self.interval_s

    def stalled_within(self, now: float, window_s: float) -> bool:
        return now - self.stalled_at < window_s


class Pulse:
    """A thread of this process that only sleeps and wakes: when it wakes ``silent_s`` or more after its last
    wake-up, the process was frozen (SIGSTOP, a paused VM) or starved that long, and its heartbeat with it. It
    touches no store, so a hung store call never reads as a freeze (a heartbeat tick can hang in one)."""

    def __init__(self, interval_s: float, silent_s: float) -> None:
        self._interval_s = interval_s
        self._silent_s = silent_s
        self._last: float | None = None
        self.silent_at = -1e18
        """When the process last came back from such a gap (monotonic)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="elastrain-pulse", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._last = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.woke(time.monotonic())

    def woke(self, now: float) -> None:
        """A wake-up at ``now``."""
        if self._last is not None and now - self._last >= self._silent_s:
            self.silent_at = now
        self._last = now

    def silent_since(self, since: float, now: float) -> bool:
        """Whether the process was silent for ``silent_s`` after ``since``: a gap it came back from, or one it is
        in (thawed, the pulse not yet awake)."""
        return self.silent_at > since or (self._last is not None and now - self._last >= self._silent_s)
