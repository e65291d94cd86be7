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
interval, never a busy loop.
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

from elastrain.log import lifecycle

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
        self._open: dict[str, tuple[Target, socket.socket]] = {}  # the watch thread's own
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
                        self._readable(sel, str(key.data))
        except Exception as exc:  # a bug: deaths are then learnt at the heartbeat's beats, as without the watch
            lifecycle("death_watch_failed", level=logging.ERROR, error=repr(exc)[:300])
        finally:
            for _, sock in self._open.values():
                sock.close()
            self._open.clear()
            sel.close()
            self._poke_r.close()
            self._poke_w.close()

    def _sync(self, sel: selectors.BaseSelector, want: dict[str, Target], held: set[str]) -> None:
        """Close the connections to peers no longer watched (or at another address); open the missing ones."""
        for name, (target, sock) in list(self._open.items()):
            if want.get(name) != target:
                sel.unregister(sock)
                sock.close()
                del self._open[name]
        for name, target in want.items():
            if name in self._open or name in held:
                continue
            conn = _connect(target)
            if conn is None:
                continue
            self._open[name] = (target, conn)
            sel.register(conn, selectors.EVENT_READ, name)

    def _readable(self, sel: selectors.BaseSelector, name: str) -> None:
        """A peer's connection is readable: closed (end of file, a reset, a refused connect), as its listener never
        sends anything."""
        _, sock = self._open[name]
        try:
            if sock.recv(64):
                return
            why = "end of file"
        except BlockingIOError:
            return
        except OSError as exc:
            why = errno.errorcode.get(exc.errno or 0, repr(exc))
        sel.unregister(sock)
        sock.close()
        del self._open[name]
        with self._lock:
            self._held[name] = time.monotonic()
            self._closed.add(name)
        lifecycle("peer_connection_closed", node=name, why=why)
        self._wake.set()


def _connect(target: Target) -> socket.socket | None:
    """A non-blocking connection under way to ``target`` (a refused one reads as closed at once); None when no
    socket could be made (no proof of anything: the heartbeat judges as before)."""
    host, port = target
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        lifecycle("death_watch_socket_failed", level=logging.WARNING, error=repr(exc)[:120])
        return None
    sock.setblocking(False)
    try:
        code = sock.connect_ex((host, port))
    except OSError as exc:  # a name that does not resolve, say
        lifecycle("death_watch_connect_failed", level=logging.DEBUG, host=host, error=repr(exc)[:120])
        sock.close()
        return None
    if code not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.ECONNREFUSED):
        sock.close()
        return None
    return sock
