"""A connection to an etcd v3 cluster for one job: failover, bounded retries, auth renewal, the job's lease.

Client library: ``python3-etcd3`` 0.13 (the maintained, synchronous fork of ``etcd3`` with the same API; why
this one and what its calls cost: docs/benchmarks.md). gRPC gives per-call deadlines and,
with the options below, reconnects within a second after an etcd restart. Two python3-etcd3 defaults
are overridden here: a failed endpoint is skipped for 300 s (here 0.5 s; our own backoff paces retries),
and auth tokens are sent as call credentials, which gRPC refuses on a plaintext channel (here: metadata).

Everything a job writes lives under ``<key_prefix>/<run_id>/`` and is attached to one etcd lease shared
by the whole job: every agent keeps it alive, so the keys outlive any node, and they expire ``lease_ttl``
seconds after the last agent is gone (a finished or abandoned job does not fill etcd up).

Outages: a call that cannot reach any endpoint is retried with bounded exponential backoff, failing over
between endpoints, for up to ``retry_timeout`` seconds; the job pauses meanwhile (workers keep training)
and then goes on. The first contact uses ``connect_timeout`` instead, so an unreachable etcd at start is
an error naming the endpoints within seconds. An auth token that etcd forgot across a restart is renewed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import etcd3
import grpc
from etcd3 import exceptions as etcd_exc
from etcd3.client import Endpoint
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastrain.errors import RendezvousStoreLostError, UsageError
from elastrain.log import lifecycle
from elastrain.rendezvous.backends.etcd_options import EtcdOptions

logger = logging.getLogger(__name__)

T = TypeVar("T")

# etcd refuses transactions with more operations than this (--max-txn-ops, default 128).
MAX_TXN_OPS = 128

_RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)
# A failed endpoint is skipped for this long (python3-etcd3's default is 300 s); our backoff paces retries.
_ENDPOINT_RETRY_S = 0.5
# Reconnect quickly after an etcd restart; gRPC's default backoff grows to 120 s.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


class EtcdUnavailableError(RendezvousStoreLostError, RendezvousConnectionError):
    """No etcd endpoint answered within the allowed time; the message names the endpoints."""


def _describe_error(exc: BaseException) -> str:
    cause = exc.__context__ if isinstance(exc, etcd_exc.Etcd3Exception) and exc.__context__ else exc
    if isinstance(cause, grpc.RpcError):
        code, details = cause.code(), cause.details()
        return f"{code.name}: {details}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code: grpc.StatusCode = exc.code()
        return code
    return None


class EtcdClient:
    """One job's view of etcd: every call is retried through outages and failover, within bounds."""

    def __init__(self, options: EtcdOptions, run_id: str) -> None:
        self.options = options
        self.run_id = run_id
        self.root = f"{options.key_prefix.rstrip('/')}/{run_id}/"
        self._lock = threading.Lock()
        self._client: etcd3.MultiEndpointEtcd3Client | None = None
        self._lease = JobLease(self)

    # -- connection ---------------------------------------------------------------------------
    def _new_client(self) -> etcd3.MultiEndpointEtcd3Client:
        o = self.options
        creds = None
        if o.secure:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(o.ca_cert, o.client_key, o.client_cert)
        endpoints = [
            Endpoint(host, port, secure=o.secure, creds=creds, time_retry=_ENDPOINT_RETRY_S, opts=_GRPC_OPTIONS)
            for host, port in o.endpoints
        ]
        client = etcd3.MultiEndpointEtcd3Client(
            endpoints=endpoints, timeout=o.request_timeout_s, user=o.user, password=o.password, failover=True
        )
        if not o.secure:
            # gRPC refuses call credentials on a plaintext channel; the token also travels as metadata.
            client.call_credentials = None
        return client

    def _current(self) -> etcd3.MultiEndpointEtcd3Client:
        with self._lock:
            if self._client is None:
                self._client = self._new_client()
            return self._client

    def _drop(self, client: etcd3.MultiEndpointEtcd3Client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        try:
            client.close()
        except Exception:  # closing a broken channel must not hide the real error
            logger.debug("closing an etcd client failed", exc_info=True)

    def call(self, what: str, fn: Callable[[etcd3.MultiEndpointEtcd3Client], T], timeout: float | None = None) -> T:
        """Run ``fn(client)``, retrying connection failures with bounded backoff for ``timeout`` seconds."""
        budget = self.options.retry_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + budget
        delay = 0.05
        attempt = 0
        last: BaseException | None = None
        while True:
            attempt += 1
            client: etcd3.MultiEndpointEtcd3Client | None = None
            try:
                client = self._current()
                return fn(client)
            except _RETRYABLE as exc:
                # "no endpoint available" only says that all endpoints failed recently; keep the reason they did.
                if last is None or not isinstance(exc, etcd_exc.NoServerAvailableError):
                    last = exc
            except grpc.RpcError as exc:
                code = _rpc_code(exc)
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    last = exc
                elif code is grpc.StatusCode.UNAUTHENTICATED and self.options.user is not None:
                    # etcd forgets simple auth tokens when it restarts: log in again.
                    last = exc
                    if client is not None:
                        self._drop(client)
                elif code is grpc.StatusCode.PERMISSION_DENIED:
                    raise UsageError(
                        "--rdzv-conf",
                        f"etcd at {self.options.describe()} denied {self._who()} access to "
                        f"{self.root} ({_describe_error(exc)}): grant it readwrite on that prefix",
                    ) from None
                elif code is grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in str(exc.details()):
                    raise UsageError(
                        "--rdzv-conf",
                        f"etcd at {self.options.describe()} requires authentication: set user and password",
                    ) from None
                elif code is grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in str(exc.details()):
                    raise UsageError(
                        "--rdzv-conf",
                        f"etcd at {self.options.describe()} rejected user {self.options.user!r}: check user/password",
                    ) from None
                else:
                    raise
            except ValueError as exc:
                # python3-etcd3 raises ValueError for a failed endpoint when failover has nowhere to go.
                last = last or exc
            if attempt == 2 or attempt % 20 == 0:
                lifecycle(
                    "etcd_retrying",
                    level=logging.WARNING,
                    op=what,
                    endpoints=self.options.describe(),
                    error=_describe_error(last),
                )
            now = time.monotonic()
            if now >= deadline:
                raise EtcdUnavailableError(
                    f"etcd at {self.options.describe()} did not answer {what} within {budget:g} s "
                    f"({attempt} attempts; last error: {_describe_error(last)}). Check that etcd is running "
                    f"and reachable, and --rdzv-endpoint (and the TLS options in --rdzv-conf)."
                ) from None
            time.sleep(min(delay * random.uniform(0.8, 1.2), max(deadline - now, 0.0)))
            delay = min(delay * 2, 1.0)

    def _who(self) -> str:
        o = self.options
        if o.user is not None:
            return f"user {o.user!r}"
        return "the user named by the client certificate's common name" if o.client_cert else "anonymous access"

    def connect(self) -> None:
        """First contact (bounded by ``connect_timeout``): check access and join the job's lease."""
        self.call("a connection check", lambda c: c.get(self.root + "lease"), timeout=self.options.connect_timeout_s)
        self.lease_id()
        lifecycle(
            "etcd_connected", endpoints=self.options.describe(), root=self.root, lease_ttl=self.options.lease_ttl_s
        )

    def close(self) -> None:
        self._lease.stop()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- the job's lease (see JobLease) -------------------------------------------------------------
    def lease_id(self) -> int:
        """The lease every key of this job is attached to (created by the first agent, shared by all)."""
        return self._lease.lease_id()

    def compact_history(self) -> int | None:
        """Compact etcd's history up to the revision seen by the previous call; return the new mark."""
        return self._lease.compact_history()

    # -- key-value helpers --------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, int] | None:
        """The value and mod revision of ``key``, or None."""
        value, meta = self.call("get", lambda c: c.get(key))
        if value is None:
            return None
        return bytes(value), int(meta.mod_revision)

    def put(self, key: str, value: bytes) -> None:
        self.call_with_lease("put", lambda c, lease: c.put(key, value, lease=lease))

    def call_with_lease(self, what: str, fn: Callable[[etcd3.MultiEndpointEtcd3Client, int], T]) -> T:
        """Like :meth:`call` for writes; if the job's lease vanished, a new one is acquired and the write retried."""
        for _ in range(3):
            lease = self.lease_id()
            try:
                return self.call(what, lambda c, lease=lease: fn(c, lease))  # type: ignore[misc]
            except grpc.RpcError as exc:
                if _rpc_code(exc) is grpc.StatusCode.NOT_FOUND and "lease not found" in str(exc.details()):
                    self._lease.expired(lease)
                    continue
                raise
        raise EtcdUnavailableError(f"etcd at {self.options.describe()} keeps losing the lease of {self.root}")

    def transaction(
        self,
        what: str,
        compare: Callable[[Any], Sequence[Any]],
        success: Callable[[Any, int], Sequence[Any]],
        failure: Callable[[Any], Sequence[Any]],
    ) -> tuple[bool, list[Any]]:
        """One transaction; the builders receive the client's ``transactions`` helper (and the lease for writes)."""

        def run(c: etcd3.MultiEndpointEtcd3Client, lease: int) -> tuple[bool, list[Any]]:
            t = c.transactions
            ok, responses = c.transaction(
                compare=list(compare(t)), success=list(success(t, lease)), failure=list(failure(t))
            )
            return bool(ok), list(responses)

        return self.call_with_lease(what, run)

    def delete(self, key: str) -> bool:
        return bool(self.call("delete", lambda c: c.delete(key)))

    def count_prefix(self, prefix: str) -> int:
        def count(c: etcd3.MultiEndpointEtcd3Client) -> int:
            response = c.get_prefix_response(prefix, count_only=True)
            return int(response.count)

        return self.call("count", count)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` (None where missing), read in transactions of at most MAX_TXN_OPS."""
        out: list[bytes | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start : start + MAX_TXN_OPS]

            def read(c: etcd3.MultiEndpointEtcd3Client, chunk: Sequence[str] = chunk) -> list[Any]:
                _, responses = c.transaction(compare=[], success=[c.transactions.get(k) for k in chunk], failure=[])
                return list(responses)

            for found in self.call("multi_get", read):
                out.append(bytes(found[0][0]) if found else None)
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for start in range(0, len(items), MAX_TXN_OPS):
            chunk = items[start : start + MAX_TXN_OPS]
            self.call_with_lease(
                "multi_set",
                lambda c, lease, chunk=chunk: c.transaction(  # type: ignore[misc]
                    compare=[], success=[c.transactions.put(k, v, lease=lease) for k, v in chunk], failure=[]
                ),
            )


class JobLease:
    """The etcd lease that every key of the job is attached to, kept alive (and etcd's history compacted) by a
    thread of this agent."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._options = client.options
        self._root = client.root
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._keepalive: threading.Thread | None = None
        self._stopped = threading.Event()
        self._compaction_mark: int | None = None
        self._may_compact = True

    def stop(self) -> None:
        self._stopped.set()

    def lease_id(self) -> int:
        """The lease every key of this job is attached to (created by the first agent, shared by all)."""
        with self._lock:
            lease = self._lease_id
        if lease is None:
            lease = self._acquire_lease()
        return lease

    def _acquire_lease(self) -> int:
        key = self._root + "lease"
        ttl = self._options.lease_ttl_s

        def acquire(c: etcd3.MultiEndpointEtcd3Client) -> int:
            mine = c.lease(ttl)
            ok, responses = c.transaction(
                compare=[c.transactions.create(key) == 0],
                success=[c.transactions.put(key, str(mine.id), lease=mine.id)],
                failure=[c.transactions.get(key)],
            )
            if ok:
                return int(mine.id)
            c.revoke_lease(mine.id)
            found = responses[0]
            if not found:
                raise etcd_exc.ConnectionFailedError()  # the shared lease expired just now: try again
            return int(found[0][0])

        lease = self._client.call("lease acquisition", acquire)
        with self._lock:
            self._lease_id = lease
            if self._keepalive is None:
                self._keepalive = threading.Thread(target=self._keep_alive, name="elastrain-etcd-lease", daemon=True)
                self._keepalive.start()
        return lease

    def expired(self, lease: int) -> None:
        with self._lock:
            if self._lease_id == lease:
                self._lease_id = None
        lifecycle("etcd_lease_expired", level=logging.WARNING, lease=lease, root=self._root)

    def _keep_alive(self) -> None:
        interval = max(self._options.lease_ttl_s / 4, 1.0)
        every = self._options.compact_interval_s
        next_compaction = time.monotonic() + every * random.uniform(0.5, 1.0)
        while not self._stopped.wait(interval):
            with self._lock:
                lease = self._lease_id
            if lease is None:
                continue
            try:
                responses = self._client.call(
                    "lease keep-alive",
                    lambda c, lease=lease: list(c.refresh_lease(lease)),  # type: ignore[misc]
                    timeout=self._options.lease_ttl_s / 2,
                )
                if not responses or responses[0].TTL <= 0:
                    self.expired(lease)
                if every > 0 and time.monotonic() >= next_compaction:
                    next_compaction = time.monotonic() + every
                    self.compact_history()
            except Exception as exc:  # the next request retries; the thread must not die
                logger.warning("etcd lease keep-alive failed: %s", _describe_error(exc))

    def compact_history(self) -> int | None:
        """Compact etcd's history up to the revision seen by the previous call; return the new mark.

        Every heartbeat rewrites the rendezvous state, and etcd keeps every old version until it is
        compacted: without this (or etcd's own ``--auto-compaction-retention``) a long job fills etcd's
        space quota and etcd refuses all writes. Compaction is cluster-wide and idempotent.
        """
        revision = int(self._client.call("revision", lambda c: c.get_response(self._root + "lease").header.revision))
        mark, self._compaction_mark = self._compaction_mark, revision
        if mark is None or not self._may_compact:
            return revision

        def compact(c: etcd3.MultiEndpointEtcd3Client) -> grpc.StatusCode:
            try:
                c.compact(mark)
            except grpc.RpcError as exc:
                code = _rpc_code(exc)
                # OUT_OF_RANGE: someone compacted further already; PERMISSION_DENIED: not an admin.
                if code in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED):
                    return code
                raise
            return grpc.StatusCode.OK

        code = self._client.call("compaction", compact)
        if code is grpc.StatusCode.OK:
            lifecycle("etcd_compacted", revision=mark, root=self._root)
        elif code is grpc.StatusCode.PERMISSION_DENIED:
            self._may_compact = False
            lifecycle(
                "etcd_compaction_denied",
                level=logging.WARNING,
                user=self._options.user,
                hint="run etcd with --auto-compaction-retention, or set compact_interval=0",
            )
        return revision
