"""The embedded c10d backend: rendezvous state in a TCPStore hosted by one node's agent, with failover.

torch's c10d backend dies with the node that hosts its store (the job ends within seconds). Here
every node publishes a standby port; when the store stops answering, the survivors pick the host's
successor deterministically from the last state they saw (:func:`state.store_successors`), the
successor hosts a new store seeded with that state, and the others connect to it. Where no successor
is reachable the handler fails in seconds with a message that recommends ``--rdzv-backend etcd-v3``.

With a checkpoint root, the store a job's world runs on is published in its fencing claim
(:mod:`elastrain.fence`). A node started with the original ``--rdzv-endpoint`` after a
failover (a replaced VM, a re-created ``worker-0`` pod) looks there first and joins the running job's
store instead of founding a second job at the endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

from elastrain import binding, fence, fence_moves
from elastrain.errors import (
    RendezvousStateCorruptError,
    RendezvousStoreLostError,
    RendezvousValueCorruptError,
    UsageError,
)
from elastrain.log import lifecycle
from elastrain.rendezvous import fence_marks, liveness
from elastrain.rendezvous import state as st
from elastrain.rendezvous.auth import RendezvousAuth
from elastrain.rendezvous.connection import STORE_ERRORS, caused_by
from elastrain.rendezvous.deadline import with_deadline
from elastrain.rendezvous.handler import ElastrainRendezvousHandler
from elastrain.rendezvous.settings import read_timeout
from elastrain.rendezvous.trust import host_of, split_address

DEFAULT_PORT = 29400

STORE_LOST_HINT = (
    "the node hosting the embedded c10d store (--rdzv-endpoint) is gone and no surviving node could take the "
    "store over; for jobs that must survive any node, run an etcd server and use --rdzv-backend etcd-v3"
)


def parse_endpoint(endpoint: str | None) -> tuple[str, int]:
    """``--rdzv-endpoint`` of the c10d backend: ``host[:port]`` (port 29400 by default); UsageError naming it."""
    text = (endpoint or "").strip()
    if not text:
        return "localhost", DEFAULT_PORT  # as torch's parse_rendezvous_endpoint
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise UsageError("--rdzv-endpoint", f"expected host[:port], got {text!r}")
    elif text.count(":") > 1:
        host, port_text = text, ""  # a bare IPv6 address
    else:
        host, _, port_text = text.partition(":")
    if not port_text:
        return host, DEFAULT_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError("--rdzv-endpoint", f"expected host[:port] with a numeric port, got {text!r}") from None
    if not host or not 0 <= port < 65536:
        raise UsageError("--rdzv-endpoint", f"expected host[:port] with a port in 0-65535, got {text!r}")
    return host, port


class C10dStateCorruptError(RendezvousValueCorruptError, RendezvousStateError):
    """The c10d state key holds something that is not base64; ``token`` is the raw value (c10d's token)."""


class C10dBackend(C10dRendezvousBackend):
    """torch's c10d backend, whose corrupt-state error carries the value's token, so that the handler ignores the
    value (and can write a good state over it) instead of failing."""

    def _decode_state(self, base64_state: bytes) -> tuple[bytes, Token] | None:
        try:
            return super()._decode_state(base64_state)
        except RendezvousStateError as exc:
            raise C10dStateCorruptError(
                f"the rendezvous state of run {self._key.removeprefix('torch.rendezvous.')} is not base64 "
                "(not elastrain's or torch's)",
                token=base64_state,
            ) from exc


class C10dStores:
    """Creates the TCPStores: the first one at the endpoint, later ones on a successor's standby port."""

    movable = True  # the store lives in a node: calls get a deadline, and it fails over, refounds, redirects

    def __init__(self, params: RendezvousParameters, auth: RendezvousAuth | None = None) -> None:
        self.params = params
        self.run_id = str(params.run_id)
        self.root: str | None = None  # the checkpoint root, where the running job's store is published
        self._closed_before: int | None = None
        """The newest close of this job in the root when this node first looked (-1: none; None: unknown)."""
        self.timeout = read_timeout(params)
        self.auth = auth or RendezvousAuth(None, self.run_id)
        # Where this node listens when it hosts a store after a failover: its advertised address's interface.
        self.addr = binding.advertised_address(params.local_addr, str(params.endpoint))
        self.resumes = False
        self._claimed_at_start: int | None = None
        """The newest claim's generation (-1: none) when this node started on a store no world ran on; None: it
        started on a running job's store, or without a checkpoint root."""
        self._found = st.RendezvousState()
        """The live state read where this node found the job's published store (the nodes it knows of first)."""

    def first(self, params: RendezvousParameters) -> tuple[TCPStore, bool, str]:
        """The store to start on, whether this process hosts it, and its ``host:port``.

        That is the running job's published store when one answers, else the endpoint's.
        """
        root = params.get("checkpoint_root", None)
        self.root = str(root) if root else None
        if root:
            self._closed_before = fence_marks.newest_close(str(root), -1, self.run_id, self.auth)
            read, top = fence_marks.newest_claim(str(root))
            published = self._published(str(root), top)
            if published is None or self._found.round < 0:  # a store founded afresh (here, or by a node of a relaunch)
                self._claimed_at_start = (top.generation if top is not None else -1) if read else None
                self.resumes = self._ran_before(top)
            if published is not None:
                return published
        return self.at_endpoint()

    def no_world_since_start(self) -> bool:
        """Whether no world of the job formed since this node started on a store no world ran on: the root's newest
        claim is still the one it found then (a round claims the next generation as it forms)."""
        if self.root is None or self._claimed_at_start is None:
            return False
        read, top = fence_marks.newest_claim(self.root)
        return read and (top.generation if top is not None else -1) == self._claimed_at_start

    def _ran_before(self, top: fence.Claim | None) -> bool:
        """Whether this job trained before this node started and did not finish: its newest claim in the root
        (``top``) is newer than its last close (unknown: no)."""
        closed = self._closed_before
        ran = top is not None and top.run_id == self.run_id and closed is not None and closed < top.generation
        if ran and top is not None:
            lifecycle("job_launched_again", generation=top.generation, why="the job's claim is in the checkpoint "
                      "root and no world of it runs: its first round here waits scale_up_window, not the "
                      "last call")  # fmt: skip
        return ran

    def at_endpoint(self) -> tuple[TCPStore, bool, str]:
        """The store at ``--rdzv-endpoint``: hosted here when this node is the endpoint's host (and the port is
        free), else a client of it; raises :class:`RendezvousStoreLostError` when neither works."""
        params = self.params
        host, port = parse_endpoint(params.endpoint)
        cfg_is_host = params.get_as_bool("is_host")
        try_host = cfg_is_host if cfg_is_host is not None else _matches_machine_hostname(host)
        if try_host:
            try:
                # Bound to the endpoint's interface only (torch's own binds every one: --standalone's localhost:0).
                store = binding.tcp_store_server(host, port, self.timeout)
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

    def _published(self, root: str, top: fence.Claim | None) -> tuple[TCPStore, bool, str] | None:
        """The running job's store: where the newest claim (``top``) last moved since, else its own; or None."""
        if top is None or not top.store:
            return None
        # its store left with its last node: nothing to wait for there
        if fence_marks.left(root, top.generation, self.run_id, self.auth):
            lifecycle("published_store_vacated", store=top.store, generation=top.generation)
            return None
        for store, mac in fence_moves.stores_of(root, top):
            found = self._published_at(store, mac, top.generation)
            if found is not None:
                return found
        return None

    def _published_at(self, address: str, mac: str, generation: int) -> tuple[TCPStore, bool, str] | None:
        if self.auth.enabled and not self.auth.signed_store(address, mac):
            lifecycle("fence_claim_untrusted", level=logging.WARNING, store=address, generation=generation,
                      why="its store is not signed with the job's secret")  # fmt: skip
            return None
        try:
            host, port = split_address(address)
            # A store is published once it listens, and listens as long as it lives: refused means gone (a client
            # would retry until its timeout). Never a successor's standby port: it listens once that one hosts.
            if liveness.refused_at(address):
                lifecycle("published_store_silent", store=address, generation=generation, error="refused")
                return None
            # Bounded: the client's handshake with a frozen host's store (SIGSTOP, a paused VM) never returns.
            store = self.connect(host, port, self.timeout.total_seconds())
            state = self._live(self.backend(store))
            if state is None:
                return None
        except (*STORE_ERRORS, ValueError, RendezvousStateCorruptError) as exc:
            lifecycle("published_store_silent", store=address, generation=generation, error=repr(exc)[:120])
            return None
        if not self.auth.enabled and host.lower() not in {i.addr.lower() for i in state.nodes.values()}:
            # Unsigned: follow it only to a store that one of its own job's nodes hosts.
            lifecycle("fence_claim_untrusted", level=logging.WARNING, store=address, generation=generation,
                      why="no node of the job that answers there has that address")  # fmt: skip
            return None
        lifecycle("published_store_found", store=address, generation=generation)
        self._found = state
        return store, False, address

    def finished(self) -> bool:
        """Whether this job closed since this node first looked: a close newer than the root's newest then, by the
        newest world (a world superseded by a newer claim never ends the job). A later run of the same command in
        the same folder finds the earlier run's close there when it starts, and is not taken for a node of it."""
        if self.root is None or self._closed_before is None:
            return False
        closed = fence_marks.newest_close(self.root, None, self.run_id, self.auth)
        if closed is None or closed <= self._closed_before:
            return False
        read, top = fence_marks.newest_claim(self.root)
        return read and (top is None or top.generation <= closed)

    def vacated(self) -> bool:
        """Whether the newest world of this job was left by its last node, which hosted its store (the mark beside
        the claims, signed with the job's secret when it has one): no live store of the job exists."""
        if self.root is None:
            return False
        _, top = fence_marks.newest_claim(self.root)
        return top is not None and fence_marks.left(self.root, top.generation, self.run_id, self.auth)

    def known_gone(self, cached: st.RendezvousState) -> bool:
        nodes = (cached if cached.nodes else self._found).nodes
        return self.root is not None and _known_gone(self.root, self.run_id, nodes)

    def _live(self, backend: RendezvousBackend) -> st.RendezvousState | None:
        """The state at ``backend`` when a live job's rendezvous runs there (opened with the job's secret)."""
        got = backend.get_state()
        if got is None:
            return None
        state = st.decode(self.auth.open_state(got[0]))
        live = not state.closed and not state.superseded_by and bool(st.live_members(state) or state.joining)
        return state if live else None

    def host(self, port: int) -> TCPStore:
        return binding.tcp_store_server(self.addr, port, self.timeout)

    def connect(self, addr: str, port: int, timeout_s: float) -> TCPStore:
        """A client of the store at ``addr:port``; TimeoutError once it is well past ``timeout_s`` (the client's own
        handshake with a frozen host's store never ends: it is left blocked in a daemon thread). The margin is wide:
        a constructor abandoned while it could still return by its own timeout raises later in its thread (the
        process awaits such calls before it exits: :mod:`elastrain.rendezvous.deadline`)."""
        timeout = timedelta(seconds=timeout_s)
        return with_deadline(lambda: TCPStore(addr, port, is_master=False, timeout=timeout), 2 * timeout_s + 5.0)

    def backend(self, store: Store) -> RendezvousBackend:
        return C10dBackend(store, self.run_id)

    # -- what the handler asks of a node-hosted store ---------------------------------------------
    def connect_to(self, address: str, timeout_s: float) -> tuple[RendezvousBackend, Store]:
        host, port = split_address(address)
        store = self.connect(host, port, self.timeout.total_seconds())
        return self.backend(store), store

    def refound(self) -> tuple[RendezvousBackend, Store, str, bool]:
        store, hosts, address = self.at_endpoint()
        return self.backend(store), store, address, hosts

    def answers(self, address: str, timeout_s: float) -> bool:
        host, port = split_address(address)
        if liveness.refused_at(address):  # gone (see _published)
            return False
        try:
            store = self.connect(host, port, timeout_s)
            return self._live(self.backend(store)) is not None
        except RendezvousStateCorruptError:
            return False

    def vouches(self, address: str, timeout_s: float) -> set[str]:
        """The addresses of the nodes of the live job whose store answers at ``address`` (empty if none does)."""
        host, port = split_address(address)
        if liveness.refused_at(address):  # gone (see _published)
            lifecycle("store_probe_failed", level=logging.INFO, address=address, error="refused")
            return set()
        try:
            state = self._live(self.backend(self.connect(host, port, timeout_s)))
        except (*STORE_ERRORS, RuntimeError, ValueError, RendezvousStateCorruptError) as exc:
            lifecycle("store_probe_failed", level=logging.INFO, address=address, error=repr(exc)[:120])
            return set()
        addrs = {i.addr.lower() for i in state.nodes.values()} if state is not None else set()
        return addrs if host_of(address).lower() in addrs else set()

    def failover(
        self, cached: st.RendezvousState, me: str, exc: BaseException, timeout_s: float
    ) -> tuple[RendezvousBackend, Store, str, bool] | None:
        """Move the state store to the first reachable successor of its dead host."""
        host = cached.nodes.get(cached.store_host)
        probe = {cached.store_host: (host.addr, host.probe_port)} if host is not None and host.probe_port else {}
        refused = bool(probe) and bool(liveness.refused(probe, 0.5))
        if not refused and not caused_by(exc, (DistError, TimeoutError, ConnectionError)):  # a store's error
            return None  # the host's process may be alive and the error unrelated to the store
        how = st.Departure.DEAD if refused else st.Departure.SILENT
        if me not in cached.nodes and self.root:
            # A newcomer whose store died before it read the state knows no successor: the store the job's
            # world runs on now is the one published with its fencing claim (when one is alive).
            published = self._published(self.root, fence_marks.newest_claim(self.root)[1])
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
                    backend.set_state(self.auth.seal_state(st.encode(st.after_store_failover(cached, me, how))), None)
                    if self.root is not None and cached.generation >= 0:  # where newcomers find it (no new claim)
                        move = fence_moves.Moved(cached.generation, self.run_id, address, self.auth.store_mac(address))
                        record_move(self.root, move)
                    return backend, store, address, True
                if not _successor_listens(cand, info, timeout_s):  # its process gone: the next one
                    continue
                store = self.connect(info.addr, info.standby_port, timeout_s)
                backend = self.backend(store)
                if _wait_seeded(backend, timeout_s):
                    return backend, store, address, False
            except (*STORE_ERRORS, RuntimeError) as err:
                lifecycle("store_successor_unreachable", level=logging.INFO, candidate=cand, error=repr(err)[:120])
        return None


def _known_gone(root: str, run_id: str, nodes: Mapping[str, st.NodeInfo]) -> bool:
    """Whether every node of ``nodes`` refuses its probe (see ``StoreFactory.known_gone``); knowing none (a world formed
    on this node's store without it), whether nothing listens any more where the newest world's store ran: its own and
    every move of it recorded since (a store listens as long as its host's process lives)."""
    if nodes:
        targets = {n: (i.addr, i.probe_port) for n, i in nodes.items() if i.probe_port}
        if len(targets) < len(nodes):
            return False  # a node that cannot be probed is never proved gone
    else:
        read, top = fence_marks.newest_claim(root)
        if not read or top is None or top.run_id != run_id or not top.store:
            return False
        targets = {address: split_address(address) for address, _ in fence_moves.stores_of(root, top)}
    return liveness.refused(targets, 0.5) == set(targets)


def record_move(root: str, move: fence_moves.Moved) -> None:
    """This node hosts its world's store at ``move.store`` now: record it beside the world's claim, for nodes on
    their way in. In a thread of its own: a failover never waits on the storage."""

    move = dataclasses.replace(move, moved_at=time.time())

    def write() -> None:
        try:
            fence_moves.record(root, move)
        except OSError as exc:
            lifecycle("store_move_unrecorded", level=logging.WARNING, generation=move.generation, store=move.store,
                      root=root, error=repr(exc)[:200])  # fmt: skip
            return
        lifecycle("store_move_recorded", generation=move.generation, store=move.store, root=root)

    threading.Thread(target=write, name="elastrain-store-move", daemon=True).start()


def _successor_listens(cand: str, info: st.NodeInfo, timeout_s: float) -> bool:
    """Wait (at most a second) while nothing listens at the live successor's standby port: it opens its store as soon
    as it sees the host gone, at the same moment as this node when both learn it from the host's closed connection,
    and a client that connects before then retries inside torch until its timeout. False when the successor's own
    process is gone, now or meanwhile (its probe port refuses: killed with the host, say), so that the next one is
    tried at once; True otherwise, and the client's own connect follows, with its own timeout."""
    deadline = time.monotonic() + min(timeout_s, 1.0)
    probes = {"standby": (info.addr, info.standby_port)}
    if info.probe_port:
        probes["process"] = (info.addr, info.probe_port)
    while True:
        gone = liveness.refused(probes, 0.5)
        if "process" in gone:
            lifecycle("store_successor_dead", level=logging.INFO, candidate=cand)
            return False
        if "standby" not in gone:
            return True
        if time.monotonic() >= deadline:
            lifecycle("store_successor_not_listening", level=logging.INFO, store=f"{info.addr}:{info.standby_port}")
            return True
        time.sleep(0.01)


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
    auth = RendezvousAuth.from_params(params)
    stores = C10dStores(params, auth)
    store, hosts, address = stores.first(params)
    return ElastrainRendezvousHandler(
        stores.backend(store),
        store,
        params,
        on_store_lost=STORE_LOST_HINT,
        stores=stores,
        hosts_store=hosts,
        store_address=address,
        auth=auth,
    )
