"""A TCP proxy on loopback in front of a local server (a rendezvous store): it can drop everything silently (a
network cut) or reset the connections open now (a broken connection, the server's process alive)."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.drop = threading.Event()
        """Set: bytes are read and thrown away (the peers block in their receives, as behind a cut)."""
        self._target = target_port
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                if not self.drop.is_set():
                    dst.sendall(chunk)
        except OSError:
            return
        finally:
            dst.close()

    def cut(self) -> None:
        """Reset every connection open now; new ones go through as before."""
        with self._lock:
            doomed, self._open = self._open, []
        for s in doomed:
            with contextlib.suppress(OSError):  # closed by its pipe meanwhile: nothing left to reset
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()

    def close(self) -> None:
        self._sock.close()
        self.cut()
