"""The embedded c10d backend: rendezvous state in a TCPStore hosted by one node's agent, with failover.

torch's c10d backend dies with the node that hosts its store (measured: the job ends in 1.3 s). Here
every node publishes a standby port; when the store stops answering, the survivors pick the host's
successor deterministically from the last state they saw (:func:`state.store_successors`), the
successor hosts a new store seeded with that state, and the others connect to it. Where no successor
is reachable the handler fails in seconds with a message that recommends ``--rdzv-backend etcd-v3``.

With a checkpoint root, the store a job's world runs on is published in its fencing claim
(:mod:`elastrain.checkpoint.fence`). A node started with the original ``--rdzv-endpoint`` after a
failover (a replaced VM, a re-created ``worker-0`` pod) looks there first and joins the running job's
store instead of founding a second job at the endpoint.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from elastrain.checkpoint import fence
from elastrain.errors import RendezvousStateCorruptError, RendezvousStoreLostError
from elastrain.log import lifecycle
from elastrain.rendezvous import liveness
from elastrain.rendezvous import state as st
from elastrain.rendezvous.handler import STORE_ERRORS, ElastrainRendezvousHandler

DEFAULT_PORT = 29400
# Store operations on a frozen host fail after this long (torch's default, 60 s, would stall everyone).
DEFAULT_READ_TIMEOUT_S = 5.0

STORE_LOST_HINT = (
    "the node hosting the embedded c10d store (--rdzv-endpoint) is gone and no surviving node could take the "
    "store over; for jobs that must survive any node, run an etcd server and use --rdzv-backend etcd-v3"
)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class C10dStores:
    """Creates the TCPStores: the first one at the endpoint, later ones on a successor's standby port."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.params = params
        self.run_id = str(params.run_id)
        self.root: str | None = None  # the checkpoint root, where the running job's store is published
        raw = params.get("read_timeout", None)
        self.timeout = timedelta(seconds=float(raw) if raw is not None else DEFAULT_READ_TIMEOUT_S)

    def first(self, params: RendezvousParameters) -> tuple[TCPStore, bool, str]:
        """The store to start on, whether this process hosts it, and its ``host:port``.

        That is the running job's published store when one answers, else the endpoint's.
        """
        root = params.get("checkpoint_root", None)
        self.root = str(root) if root else None
        if root:
            published = self._published(str(root))
            if published is not None:
                return published
        return self.at_endpoint()

    def at_endpoint(self) -> tuple[TCPStore, bool, str]:
        """The store at ``--rdzv-endpoint``: hosted here when this node is the endpoint's host (and the port is
        free), else a client of it; raises :class:`RendezvousStoreLostError` when neither works."""
        params = self.params
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
        cfg_is_host = params.get_as_bool("is_host")
        try_host = cfg_is_host if cfg_is_host is not None else _matches_machine_hostname(host)
        if try_host:
            try:
                store = TCPStore(host, port, is_master=True, multi_tenant=True, timeout=self.timeout)
                # The port actually bound (--standalone asks for port 0): what the fencing claim publishes.
                return store, True, f"{host}:{store.port}"
            except (RuntimeError, ValueError, TimeoutError):
                if cfg_is_host:
                    raise
        try:
            return TCPStore(host, port, is_master=False, timeout=self.timeout), False, f"{host}:{port}"
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise RendezvousStoreLostError(
                f"cannot reach the c10d rendezvous store at {params.endpoint} ({exc}); check --rdzv-endpoint"
            ) from exc

    def _published(self, root: str) -> tuple[TCPStore, bool, str] | None:
        try:
            top = fence.newest(root)
        except OSError as exc:
            lifecycle("fence_read_failed", level=logging.WARNING, root=root, error=repr(exc)[:200])
            return None
        if top is None or not top.store:
            return None
        try:
            host, port = _split(top.store)
            store = TCPStore(host, port, is_master=False, timeout=self.timeout)
            if not self._live(C10dRendezvousBackend(store, self.run_id)):
                return None
        except (*STORE_ERRORS, ValueError, RendezvousStateCorruptError) as exc:
            lifecycle("published_store_silent", store=top.store, generation=top.generation, error=repr(exc)[:120])
            return None
        lifecycle("published_store_found", store=top.store, generation=top.generation)
        return store, False, top.store

    @staticmethod
    def _live(backend: RendezvousBackend) -> bool:
        got = backend.get_state()
        if got is None:
            return False
        state = st.decode(got[0])
        return not state.closed and not state.superseded_by and bool(st.live_members(state) or state.joining)

    def host(self, port: int) -> TCPStore:
        return TCPStore("0.0.0.0", port, is_master=True, multi_tenant=True, timeout=self.timeout)

    def connect(self, addr: str, port: int, timeout_s: float) -> TCPStore:
        return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    def backend(self, store: Store) -> RendezvousBackend:
        return C10dRendezvousBackend(store, self.run_id)

    # -- what the handler asks of a node-hosted store ---------------------------------------------
    def connect_to(self, address: str, timeout_s: float) -> tuple[RendezvousBackend, Store]:
        host, port = _split(address)
        store = TCPStore(host, port, is_master=False, timeout=self.timeout)
        return self.backend(store), store

    def refound(self) -> tuple[RendezvousBackend, Store, str, bool]:
        store, hosts, address = self.at_endpoint()
        return self.backend(store), store, address, hosts

    def answers(self, address: str, timeout_s: float) -> bool:
        host, port = _split(address)
        try:
            store = self.connect(host, port, timeout_s)
            return self._live(self.backend(store))
        except RendezvousStateCorruptError:
            return False

    def failover(
        self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float
    ) -> tuple[RendezvousBackend, Store, str, bool] | None:
        """Move the state store to the first reachable successor of its dead host."""
        host_info = cached.nodes.get(cached.store_host)
        refused = (
            host_info is not None
            and bool(host_info.probe_port)
            and cached.store_host in liveness.refused({cached.store_host: (host_info.addr, host_info.probe_port)}, 0.5)
        )
        if not refused and not _store_error(exc):
            return None  # the host's process may be alive and the error unrelated to the store
        how = st.Departure.DEAD if refused else st.Departure.SILENT
        if me not in cached.nodes and self.root:
            # A newcomer whose store died before it read the state knows no successor: the store the job's
            # world runs on now is the one published with its fencing claim (when one is alive).
            published = self._published(self.root)
            if published is not None:
                store, _, address = published
                return self.backend(store), store, address, False
        for cand in st.store_successors(cached):
            info = cached.nodes[cand]
            address = f"{info.addr}:{info.standby_port}"
            try:
                if cand == me:
                    store = self.host(info.standby_port)
                    backend = self.backend(store)
                    backend.set_state(st.encode(st.after_store_failover(cached, me, how)), None)
                    return backend, store, address, True
                if info.probe_port and liveness.refused({cand: (info.addr, info.probe_port)}, 0.5):
                    continue
                store = self.connect(info.addr, info.standby_port, timeout_s)
                backend = self.backend(store)
                if _wait_seeded(backend, timeout_s):
                    return backend, store, address, False
            except (*STORE_ERRORS, RuntimeError) as err:
                lifecycle("store_successor_unreachable", level=logging.INFO, candidate=cand, error=repr(err)[:120])
        return None


def _store_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is torch's typed store error: timeout or broken connection."""
    while exc is not None:
        if isinstance(exc, (DistError, TimeoutError, ConnectionError)):
            return True
        exc = exc.__cause__
    return False


def _wait_seeded(backend: RendezvousBackend, timeout_s: float) -> bool:
    """Wait (bounded, backed off) until the successor has seeded its new store with the state."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while time.monotonic() < deadline:
        if backend.get_state() is not None:
            return True
        time.sleep(delay)
        delay = min(0.25, delay * 1.5)
    return backend.get_state() is not None


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """elastrain's handler with its state in the embedded c10d store (with store failover)."""
    stores = C10dStores(params)
    store, hosts, address = stores.first(params)
    return ElastrainRendezvousHandler(
        stores.backend(store),
        store,
        params,
        on_store_lost=STORE_LOST_HINT,
        stores=stores,
        hosts_store=hosts,
        store_address=address,
    )
