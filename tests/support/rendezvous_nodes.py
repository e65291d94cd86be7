"""Rendezvous handlers of several "nodes" in one process, over one in-memory store, for the handler's tests.

Each handler is elastrain's real one (threads, heartbeats, rounds) with fast timings; ``rendezvous_all`` runs a
round on every node at once, each in its thread, bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain.rendezvous.backends.c10d import C10dBackend
from elastrain.rendezvous.handler import ElastrainRendezvousHandler

FAST = {"heartbeat_interval": "0.05", "heartbeat_timeout": "0.5", "last_call_timeout": "5"}
RUN_ID = "unit"


def handler(
    store: HashStore,
    max_nodes: int,
    backend: Callable[[HashStore, str], RendezvousBackend] = C10dBackend,
    **conf: str,
) -> ElastrainRendezvousHandler:
    """One node's handler on ``store`` (``conf`` over :data:`FAST`), its state kept by ``backend``."""
    params = RendezvousParameters(
        backend="c10d", endpoint="127.0.0.1:0", run_id=RUN_ID, min_nodes=1, max_nodes=max_nodes, **{**FAST, **conf}
    )
    return ElastrainRendezvousHandler(backend(store, RUN_ID), store, params)


def rendezvous_all(nodes: list[ElastrainRendezvousHandler], timeout_s: float = 30.0) -> list[RendezvousInfo]:
    """A round on every node at once; every node's answer (fails if one does not complete in ``timeout_s``)."""
    out: list[RendezvousInfo | None] = [None] * len(nodes)

    def go(i: int) -> None:
        out[i] = nodes[i].next_rendezvous()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert all(o is not None for o in out), "a rendezvous did not complete"
    return [o for o in out if o is not None]


def eventually(pred: Callable[[], object], timeout: float = 10.0) -> None:
    """Until ``pred()`` is true (polled every 20 ms); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")
