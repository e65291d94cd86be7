"""A watched peer's process died: known at once, not at the next heartbeat.

The kernel closes every socket of a process that dies (SIGKILL, a crash, the OOM killer), and the other end of each
reads end-of-file at once. So this node holds one idle connection to the probe port
(:class:`~elastrain.rendezvous.liveness.ProbeListener`) of each peer it watches: the heartbeat's judge (every node,
when it judges) and the host of the state store. When one of them closes, the heartbeat wakes at once: it probes
that peer (a refused probe evicts it) and beats, so that a store whose host died fails over now. A closed connection
proves nothing by itself (a reset on the network, a peer that closed its listener): the probe and the store calls
decide, as they do at every beat. A machine that vanishes closes nothing; its silence is judged by the heartbeat
timeout, as before.

A peer whose connection closed is connected again at a :meth:`DeathWatch.follow` (each beat) at least ``rearm_s`` (a
heartbeat interval) later: a dead peer that stays in the state costs one refused connection, and one early beat, per
interval, never a busy loop (logged once: a refusal of a peer already reported closed is logged at debug level).

A peer is dialled at every address its name resolves to (:mod:`~elastrain.rendezvous.dial`): it listens on one of
them, so a refusal at one address while another connection to it is open proves nothing and wakes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from typing import cast

from elastrain.log import lifecycle
from elastrain.rendezvous import dial

Target = tuple[str, int]
"""A peer's probe address: (host, port)."""


class DeathWatch:
    """This node's open connections to its watched peers' probe ports; sets ``wake`` when one of them closes."""

    def __init__(self, wake: threading.Event, rearm_s: float) -> None:
        self._wake = wake
        self._rearm_s = rearm_s
        self._lock = threading.Lock()
        self._want: dict[str, Target] = {}
        self._held: dict[str, float] = {}
        """Peers whose connection closed, and when (monotonic): not connected again for ``rearm_s``."""
        self._closed: set[str] = set()
        self._open: dict[str, tuple[Target, list[socket.socket]]] = {}  # the watch thread's own: one per address
        self._reported: set[str] = set()  # the watch thread's own: peers whose close was logged
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._poke_r, self._poke_w = socket.socketpair()
        self._poke_r.setblocking(False)
        self._poke_w.setblocking(False)  # a poke never blocks the heartbeat (one pending is enough)

    def follow(self, targets: Mapping[str, Target]) -> None:
        """Watch exactly ``targets`` (name -> probe address) from now on (called at each beat)."""
        wanted = {n: t for n, t in targets.items() if t[1]}
        now = time.monotonic()
        with self._lock:
            rearmed = {n for n, at in self._held.items() if now - at >= self._rearm_s or n not in wanted}
            if self._stopping or (wanted == self._want and not rearmed):
                return
            self._want = wanted
            for n in rearmed:
                del self._held[n]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastrain-death-watch", daemon=True)
                self._thread.start()
        self._poke()

    def closed(self) -> set[str]:
        """The watched peers whose connection closed since the last call."""
        with self._lock:
            out, self._closed = self._closed, set()
        return out

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is None:  # never followed anyone: no thread to close the poke pair on its way out
            self._poke_r.close()
            self._poke_w.close()
            return
        self._poke()
        if thread is not threading.current_thread():
            thread.join(timeout=2)

    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._poke_w.send(b"x")

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._poke_r, selectors.EVENT_READ, None)
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    want, held = dict(self._want), set(self._held)
                self._sync(sel, want, held)
                for key, _ in sel.select():
                    if key.data is None:
                        with contextlib.suppress(OSError):
                            self._poke_r.recv(4096)
                    else:
                        self._readable(sel, str(key.data), cast(socket.socket, key.fileobj))
        except Exception as exc:  # a bug: deaths are then learnt at the heartbeat's beats, as without the watch
            lifecycle("death_watch_failed", level=logging.ERROR, error=repr(exc)[:300])
        finally:
            for _, socks in self._open.values():
                for sock in socks:
                    sock.close()
            self._open.clear()
            sel.close()
            self._poke_r.close()
            self._poke_w.close()

    def _sync(self, sel: selectors.BaseSelector, want: dict[str, Target], held: set[str]) -> None:
        """Close the connections to peers no longer watched (or at another address); open the missing ones."""
        for name, (target, socks) in list(self._open.items()):
            if want.get(name) != target:
                self._drop(sel, name, socks)
        self._reported &= set(want)
        for name, target in want.items():
            if name in self._open or name in held:
                continue
            begun = dial.begin(*target)
            if begun.under_way:
                self._open[name] = (target, begun.under_way)
                for sock in begun.under_way:
                    sel.register(sock, selectors.EVENT_READ, name)
            elif begun.addresses and begun.refused == begun.addresses:  # every address refused at once
                self._report(name, "ECONNREFUSED")

    def _drop(self, sel: selectors.BaseSelector, name: str, socks: list[socket.socket]) -> None:
        for sock in socks:
            sel.unregister(sock)
            sock.close()
        del self._open[name]

    def _readable(self, sel: selectors.BaseSelector, name: str, sock: socket.socket) -> None:
        """A connection to a peer is readable: closed (end of file, a reset, a refused connect), as its listener never
        sends anything. A refusal at one of the peer's addresses while another is still open proves nothing (it
        listens on one of them)."""
        try:
            if sock.recv(64):
                return
            why = "end of file"
        except BlockingIOError:
            return
        except OSError as exc:
            why = errno.errorcode.get(exc.errno or 0, repr(exc))
        socks = self._open[name][1]
        sel.unregister(sock)
        sock.close()
        socks.remove(sock)
        if why == "ECONNREFUSED" and socks:
            return
        self._drop(sel, name, socks)
        self._report(name, why)

    def _report(self, name: str, why: str) -> None:
        again = why == "ECONNREFUSED" and name in self._reported  # still dead at a rearm: said already
        self._reported.add(name)
        with self._lock:
            self._held[name] = time.monotonic()
            self._closed.add(name)
        lifecycle("peer_connection_closed", level=logging.DEBUG if again else logging.INFO, node=name, why=why)
        self._wake.set()
