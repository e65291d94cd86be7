"""The embedded c10d backend: rendezvous state in a TCPStore hosted by one node's agent, with failover.

torch's c10d backend dies with the node that hosts its store (measured: the job ends in 1.3 s). Here
every node publishes a standby port; when the store stops answering, the survivors pick the host's
successor deterministically from the last state they saw (:func:`state.store_successors`), the
successor hosts a new store seeded with that state, and the others connect to it. Where no successor
is reachable the handler fails in seconds with a message that recommends ``--rdzv-backend etcd-v3``.
"""

from __future__ import annotations

from datetime import timedelta

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from elastrain.errors import RendezvousStoreLostError
from elastrain.rendezvous.handler import ElastrainRendezvousHandler

DEFAULT_PORT = 29400
# Store operations on a frozen host fail after this long (torch's default, 60 s, would stall everyone).
DEFAULT_READ_TIMEOUT_S = 5.0

STORE_LOST_HINT = (
    "the node hosting the embedded c10d store (--rdzv-endpoint) is gone and no surviving node could take the "
    "store over; for jobs that must survive any node, run an etcd server and use --rdzv-backend etcd-v3"
)


class C10dStores:
    """Creates the TCPStores: the first one at the endpoint, later ones on a successor's standby port."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.run_id = str(params.run_id)
        raw = params.get("read_timeout", None)
        self.timeout = timedelta(seconds=float(raw) if raw is not None else DEFAULT_READ_TIMEOUT_S)

    def first(self, params: RendezvousParameters) -> tuple[TCPStore, bool]:
        """The endpoint's store and whether this process hosts it."""
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
        cfg_is_host = params.get_as_bool("is_host")
        try_host = cfg_is_host if cfg_is_host is not None else _matches_machine_hostname(host)
        if try_host:
            try:
                return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=self.timeout), True
            except (RuntimeError, ValueError, TimeoutError):
                if cfg_is_host:
                    raise
        try:
            return TCPStore(host, port, is_master=False, timeout=self.timeout), False
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise RendezvousStoreLostError(
                f"cannot reach the c10d rendezvous store at {params.endpoint} ({exc}); check --rdzv-endpoint"
            ) from exc

    def host(self, port: int) -> TCPStore:
        return TCPStore("0.0.0.0", port, is_master=True, multi_tenant=True, timeout=self.timeout)

    def connect(self, addr: str, port: int, timeout_s: float) -> TCPStore:
        return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    def backend(self, store: Store) -> RendezvousBackend:
        return C10dRendezvousBackend(store, self.run_id)


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """elastrain's handler with its state in the embedded c10d store (with store failover)."""
    stores = C10dStores(params)
    store, hosts = stores.first(params)
    return ElastrainRendezvousHandler(
        stores.backend(store), store, params, on_store_lost=STORE_LOST_HINT, stores=stores, hosts_store=hosts
    )
