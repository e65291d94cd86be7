"""The etcd v3 rendezvous backend: torch's ``RendezvousBackend`` on etcd transactions, no node special.

``--rdzv-backend etcd-v3 --rdzv-endpoint host:port[,host:port...]`` keeps the rendezvous state in one etcd
key, ``<key_prefix>/<run_id>/state``. The token is the key's mod revision; ``set_state`` is one transaction
that writes only if the revision is still the caller's (compare-and-set), and otherwise returns the
current state and token. The store handed to the agents (rank assignment, barriers, MASTER_ADDR) lives
in etcd too (:mod:`elastrain.rendezvous.backends.etcd_store`), so any node, including the first one started, can
die without taking the job with it.

torch's own etcd backends speak the etcd v2 API only (gone after etcd 3.5). The client library and the
retry, failover, TLS, auth and lease behaviour are described in :mod:`elastrain.rendezvous.backends.etcd_client`.

``--rdzv-conf`` keys (all optional):

=================  ========================================================================
key_prefix         root of the job's keys (default ``/elastrain``); keys go under ``<prefix>/<run_id>/``
ca_cert            CA bundle that signed etcd's certificate; turns TLS on (alias ``cacert``)
client_cert        client certificate for etcd's ``--client-cert-auth`` (alias ``cert``)
client_key         its private key (alias ``key``)
user, password     etcd user and password (or ``password_file``, a file holding the password); refused
                   without TLS to a non-loopback etcd unless ``allow_insecure_password=true``
secret_file        the job's rendezvous secret (every state write and key signed: elastrain.rendezvous.auth)
connect_timeout    seconds the first contact may take before the launch fails (default 10)
request_timeout    deadline of one etcd request, seconds (default 5)
retry_timeout      seconds a request is retried through an etcd outage (default 60)
lease_ttl          seconds the job's keys outlive its last agent (default 60)
compact_interval   seconds between compactions of etcd's history (default 300; 0: never)
read_timeout       seconds one blocking read of the agents' store waits (default 5, as the c10d store's)
=================  ========================================================================

Operations: the state key is written only on membership changes (join, leave, round completion,
eviction). Heartbeats are one small put per node per beat on the node's own key (``.../store/elastrain/<run>/
beat/<node>``, on the job's lease), and readers poll a version counter before they re-read the state. etcd
keeps every revision until compaction, so the history grows with the puts:

    revisions/s = N nodes x 4 beats/s;  bytes/s ~ N x 4 x 150 B (key, value, revision metadata in bbolt)
    1,000 nodes: 4,000 rev/s, ~0.6 MB/s -> ~180 MB per 300 s compaction window (default quota 2 GiB)
    4,096 nodes: ~2.4 MB/s -> ~740 MB per window: still under the quota; use compact_interval=60 above that

The agents compact history older than ``compact_interval`` (tested: ``test_history_is_compacted``), so the
database stays at about one window of history plus the live keys. Store keys of past rounds stay until the
job's lease expires; ``add`` retried across a lost reply may count twice (etcd has no idempotency key).
"""

from __future__ import annotations

import logging
from typing import Any

from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastrain.errors import RendezvousValueCorruptError
from elastrain.rendezvous.backends.etcd_client import EtcdClient
from elastrain.rendezvous.backends.etcd_options import options_from_params
from elastrain.rendezvous.backends.etcd_store import EtcdStore
from elastrain.rendezvous.settings import read_timeout

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
# Every state value starts with this, so a key written by anything else is reported, not unpickled.
STATE_MAGIC = b"elastrain-rdzv-state/1\n"


class EtcdStateCorruptError(RendezvousValueCorruptError, RendezvousStateError):
    """The state key holds something elastrain did not write; ``token`` is its mod revision."""


def encode_state(state: bytes) -> bytes:
    return STATE_MAGIC + state


def decode_state(value: bytes, key: str, revision: int = 0) -> bytes:
    if not value.startswith(STATE_MAGIC):
        raise EtcdStateCorruptError(
            f"the rendezvous state at etcd key {key} was not written by elastrain ({len(value)} bytes); use another "
            "--rdzv-id or key_prefix, or delete the key",
            token=revision,
        )
    return value[len(STATE_MAGIC) :]


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the token is its mod revision."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._key = client.root + "state"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    @property
    def client(self) -> EtcdClient:
        return self._client

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._client.get(self._key)
        if found is None:
            return None
        value, revision = found
        return decode_state(value, self._key, revision), revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            # Not a token we handed out: never write, report the current state.
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        key = self._key

        def compare(t: Any) -> list[Any]:
            return [t.create(key) == 0] if token is None else [t.mod(key) == token]

        ok, responses = self._client.transaction(
            "rendezvous state compare-and-set",
            compare,
            # Read back inside the transaction: the put's mod revision is the new token.
            lambda t, lease: [t.put(key, encode_state(state), lease=lease), t.get(key)],
            lambda t: [t.get(key)],
        )
        found = responses[-1]
        if not found:
            return None
        value, meta = found[0]
        return decode_state(bytes(value), key, int(meta.mod_revision)), int(meta.mod_revision), ok


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, Store]:
    """The etcd-v3 backend and store for ``params``; fails within ``connect_timeout`` if etcd is unreachable."""
    client = EtcdClient(options_from_params(params), params.run_id)
    client.connect()
    # A blocking read waits --rdzv-conf read_timeout, as the c10d store's: torch's agent reads every member's worker
    # information after a round forms, and a member frozen right then stalled the round for the store's default 300 s.
    return EtcdV3RendezvousBackend(client), EtcdStore(client, timeout=read_timeout(params))
