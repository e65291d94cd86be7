"""elastrain's rendezvous handler: torch's ``RendezvousHandler`` over any compare-and-set ``RendezvousBackend``.

Faster than torch's dynamic handler where membership changes: sub-second heartbeats from a thread that
runs from the first join until shutdown (independent of rounds, so a node never evicts itself), a round
that completes as soon as every live member re-joined, graceful leave, and ``num_nodes_waiting`` that
also counts departed members, so torch's own monitor loop restarts survivors without using a restart.
Each round gets its own store prefix and its own worker store (MASTER_PORT picked by the rank-0 node),
never the agent's shared store (pytorch#135712).

Options (``--rdzv-conf key=value``), in seconds:

* ``heartbeat_interval`` (0.25) and ``heartbeat_timeout`` (5): a node whose heartbeat did not move
  for the timeout is dead (a node whose agent process is gone is dead at once: its probe port refuses,
  so the timeout only decides for frozen or unreachable nodes; a short one evicts live nodes that are
  merely CPU-starved, as seen with 1.25 s on a loaded 2-core machine);
* ``last_call_timeout`` (30, as torch): how long a job's *first* round waits for more than
  ``min_nodes``; later rounds never wait for it;
* ``join_timeout`` (600) and ``store_lost_timeout`` (3): how long the store may fail before giving up.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastrain.errors import NodeLeftError, RendezvousStoreLostError, UsageError
from elastrain.log import lifecycle
from elastrain.rendezvous import state as st

_T = TypeVar("_T")


@dataclass(frozen=True)
class HandlerSettings:
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 5.0
    last_call_s: float = 30.0
    join_timeout_s: float = 600.0
    store_lost_timeout_s: float = 3.0
    poll_s: float = 0.02

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise UsageError("--rdzv-conf heartbeat_interval", f"must be > 0, got {self.heartbeat_interval_s}")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s + 0.2:
            raise UsageError(
                "--rdzv-conf heartbeat_timeout",
                f"must be at least 2 x heartbeat_interval + 0.2 s ({2 * self.heartbeat_interval_s + 0.2:.2f}), "
                f"got {self.heartbeat_timeout_s}: a shorter one evicts live but busy nodes",
            )

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> HandlerSettings:
        def num(key: str, default: float) -> float:
            raw = params.get(key, None)
            if raw is None:
                return default
            try:
                return float(raw)
            except (TypeError, ValueError):
                raise UsageError(f"--rdzv-conf {key}", f"expected seconds, got {raw!r}") from None

        d = cls()
        return cls(
            heartbeat_interval_s=num("heartbeat_interval", d.heartbeat_interval_s),
            heartbeat_timeout_s=num("heartbeat_timeout", d.heartbeat_timeout_s),
            last_call_s=num("last_call_timeout", d.last_call_s),
            join_timeout_s=num("join_timeout", d.join_timeout_s),
            store_lost_timeout_s=num("store_lost_timeout", d.store_lost_timeout_s),
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_address(params: RendezvousParameters) -> str:
    """What peers and workers use to reach this node: ``--local-addr``, else the FQDN (as torch's handler)."""
    return params.local_addr or socket.getfqdn()


def _refused(addr: str, port: int, timeout_s: float = 0.2) -> bool:
    """True only when the connection is actively refused: nothing listens, the node's agent is gone."""
    if not port:
        return False
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # timeouts, unreachable: no proof of death, the heartbeat timeout decides


def _is_timeout(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, TimeoutError) or "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return True
        exc = exc.__cause__
    return False


class StoreFactory(Protocol):
    """What store failover needs from a backend whose store lives in a node (c10d)."""

    def host(self, port: int) -> Store: ...
    def connect(self, addr: str, port: int, timeout_s: float) -> Store: ...
    def backend(self, store: Store) -> RendezvousBackend: ...


class _StoreSwitched(Exception):
    """The state store moved to a successor; the operation restarts on the new one."""


class _ProbeListener:
    """A listening socket that exists exactly as long as this process: peers probe it to detect our death."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        threading.Thread(target=self._serve, name="elastrain-probe", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()


class ElastrainRendezvousHandler(RendezvousHandler):
    """One node's view of the job's rendezvous (see the module docstring)."""

    def __init__(
        self,
        backend: RendezvousBackend,
        store: Store,
        params: RendezvousParameters,
        settings: HandlerSettings | None = None,
        on_store_lost: str = "",
        stores: StoreFactory | None = None,
        hosts_store: bool = False,
    ) -> None:
        self._backend = backend
        self._store = store
        self._params = params
        self._settings = settings or HandlerSettings.from_params(params)
        self._on_store_lost = on_store_lost
        self.node_id = f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._addr = node_address(params)
        self._lock = threading.RLock()  # RLock: a signal handler on the main thread may leave mid-update
        self._cached = st.RendezvousState()
        self._round = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._obs = st.Observations()
        self._store_failing_since: float | None = None
        self._left = False
        self.fatal_error: Exception | None = None
        """Set by the heartbeat thread when the state store is gone; the agent raises it."""
        self._probe = _ProbeListener()
        self._stores = stores
        self._hosts_store = hosts_store
        self._standby_port = free_port() if stores is not None else 0
        self._own_stall_at = -1e9
        self._probe_all = False

    # -- torch's RendezvousHandler ---------------------------------------------------------------
    def get_backend(self) -> str:
        return str(self._params.backend)

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def elastrain_round(self) -> int:
        """The job-wide round of the last completed rendezvous (identical on every node)."""
        return self._round

    def get_run_id(self) -> str:
        return str(self._params.run_id)

    def next_rendezvous(self) -> RendezvousInfo:
        s = self._settings
        deadline = time.monotonic() + s.join_timeout_s
        info = st.NodeInfo(self._addr, free_port(), self._probe.port, self._standby_port)
        if self._left:
            raise NodeLeftError(f"node {self.node_id} left the job")
        state = self._update(self._joined(info))
        self._start_heartbeat()
        target = state.round + 1
        lifecycle("rendezvous_joined", node=self.node_id, target_round=target, joining=len(state.joining))
        ready_since: float | None = None
        while True:
            if state.closed:
                raise RendezvousClosedError()
            if self._left:
                raise NodeLeftError(f"node {self.node_id} left the job")
            if self.node_id in state.joining:
                target = state.round + 1
            elif self.node_id in state.members and state.round >= target:
                break
            else:
                # Evicted while waiting (we were frozen), or dropped from the state: ask again.
                state = self._update(self._joined(info))
                continue
            now = time.monotonic()
            if len(state.joining) >= self._params.min_nodes:
                ready_since = now if ready_since is None else ready_since
            else:
                ready_since = None
            ready_for = 0.0 if ready_since is None else now - ready_since
            if st.can_complete(state, self._params.min_nodes, self._params.max_nodes, ready_for, s.last_call_s):

                def _complete(cur: st.RendezvousState, ready_for: float = ready_for) -> st.RendezvousState | None:
                    ok = st.can_complete(cur, self._params.min_nodes, self._params.max_nodes, ready_for, s.last_call_s)
                    return st.complete(cur, self._params.max_nodes) if ok else None

                state = self._update(_complete)
                continue
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no round formed within join_timeout={s.join_timeout_s:.0f}s "
                    f"({len(state.joining)} of min {self._params.min_nodes} nodes joined)"
                )
            time.sleep(s.poll_s)
            state = self._read()
        self._round = state.round
        master = state.nodes[state.members[0]]
        rank = state.members.index(self.node_id)
        store = PrefixStore(f"elastrain/{self.get_run_id()}/round{state.round}/", self._store)
        bootstrap = RendezvousStoreInfo(master_addr=master.addr, master_port=master.master_port)
        return RendezvousInfo(store, rank, len(state.members), bootstrap)

    def is_closed(self) -> bool:
        return self._read().closed

    def set_closed(self) -> None:
        self._update(st.close)

    def num_nodes_waiting(self) -> int:
        try:
            state = self._read()
        except Exception:
            return 0
        if st.change_for(state, self.node_id, self._round) is None:
            return 0
        return max(1, st.nodes_waiting(state))

    def shutdown(self) -> bool:
        """The job is over for this node: close the rendezvous (as torch's handlers do) and stop beating."""
        self._stop_heartbeat()
        try:
            self._update(lambda cur: st.close(st.remove(cur, [self.node_id], "finished")))
        except Exception:
            return False
        return True

    # -- elastrain's additions -------------------------------------------------------------------
    @property
    def membership_grace_s(self) -> float:
        """How long after a worker failure a departed peer can take to show up in the state."""
        return self._settings.heartbeat_timeout_s + 2 * self._settings.heartbeat_interval_s

    @property
    def store_failing(self) -> bool:
        return self._store_failing_since is not None

    def probe_peers(self) -> None:
        """Probe every peer at the next heartbeat tick (the agent calls this when its workers fail)."""
        self._probe_all = True

    def membership_change(self) -> str | None:
        """Why this node's current round is over (a member died/left, a node waits, we were evicted)."""
        if self._round < 0:
            return None
        try:
            state = self._read()
        except Exception:
            return None
        return st.change_for(state, self.node_id, self._round)

    def leave(self, reason: str) -> None:
        """Announce that this node leaves (survivors re-form at once) and stop its heartbeat."""
        if self._left:
            return
        self._left = True
        self._stop_heartbeat()
        try:
            self._update(lambda cur: st.remove(cur, [self.node_id], f"left:{reason}"))
            lifecycle("node_left", node=self.node_id, reason=reason, round=self._round)
        except Exception as exc:  # the others will evict us by heartbeat instead
            lifecycle("node_leave_unannounced", level=logging.WARNING, node=self.node_id, error=repr(exc))

    def _joined(self, info: st.NodeInfo) -> Callable[[st.RendezvousState], st.RendezvousState]:
        def fn(cur: st.RendezvousState) -> st.RendezvousState:
            new = st.join(cur, self.node_id, info)
            if self._hosts_store and new.store_host != self.node_id:
                new = replace(new, store_host=self.node_id)
            return new

        return fn

    # -- state access ----------------------------------------------------------------------------
    def _read(self) -> st.RendezvousState:
        for _ in range(10):
            try:
                with self._lock:
                    got = self._call(lambda: self._backend.get_state())
                break
            except _StoreSwitched:
                continue
        else:
            raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")
        state = st.RendezvousState() if got is None else st.decode(got[0])
        self._cached = state
        return state

    def _update(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        """Apply ``fn`` with compare-and-set until it sticks; return the state now stored."""
        for _ in range(10):
            try:
                return self._update_once(fn)
            except _StoreSwitched:
                continue
        raise RendezvousStoreLostError("the rendezvous store kept moving (10 failovers in a row)")

    def _update_once(self, fn: Callable[[st.RendezvousState], st.RendezvousState | None]) -> st.RendezvousState:
        with self._lock:
            got = self._call(lambda: self._backend.get_state())
            for _ in range(1000):
                state, token = (st.RendezvousState(), None) if got is None else (st.decode(got[0]), got[1])
                new = fn(state)
                if new is None or new == state:
                    self._cached = state
                    return state
                payload = st.encode(new)
                result = self._call(lambda p=payload, t=token: self._backend.set_state(p, t))  # type: ignore[misc]
                if result is None:
                    got = self._call(lambda: self._backend.get_state())
                    continue
                data, new_token, ok = result
                if ok:
                    self._cached = new
                    return new
                got = (data, new_token)
        raise RendezvousStoreLostError("compare-and-set on the rendezvous state kept losing races (1000 tries)")

    def _call(self, op: Callable[[], _T]) -> _T:
        try:
            out = op()
        except Exception as exc:
            now = time.monotonic()
            if self._store_failing_since is None:
                self._store_failing_since = now
            if self._failover(exc):
                self._store_failing_since = None
                raise _StoreSwitched() from exc
            if now - self._store_failing_since >= self._settings.store_lost_timeout_s:
                raise RendezvousStoreLostError(
                    f"the rendezvous store stopped answering for {now - self._store_failing_since:.1f}s ({exc})"
                    + (f"; {self._on_store_lost}" if self._on_store_lost else "")
                ) from exc
            raise
        self._store_failing_since = None
        return out

    def _failover(self, exc: Exception) -> bool:
        """Move the state store to the first reachable successor of its dead host (c10d only)."""
        cached = self._cached
        if self._stores is None or not cached.store_host or cached.store_host == self.node_id:
            return False
        host_info = cached.nodes.get(cached.store_host)
        host_alive = (
            host_info is not None and host_info.probe_port and not _refused(host_info.addr, host_info.probe_port)
        )
        if host_alive and not _is_timeout(exc):
            # The host's process is alive (frozen or slow): only a read timeout proves it stopped serving.
            return False
        for cand in st.store_successors(cached):
            info = cached.nodes[cand]
            try:
                if cand == self.node_id:
                    store = self._stores.host(info.standby_port)
                    backend = self._stores.backend(store)
                    backend.set_state(st.encode(st.after_store_failover(cached, self.node_id)), None)
                    self._hosts_store = True
                else:
                    if info.probe_port and _refused(info.addr, info.probe_port):
                        continue
                    store = self._stores.connect(info.addr, info.standby_port, self._settings.store_lost_timeout_s)
                    backend = self._stores.backend(store)
                    deadline = time.monotonic() + self._settings.store_lost_timeout_s
                    while backend.get_state() is None and time.monotonic() < deadline:
                        time.sleep(0.02)
                    if backend.get_state() is None:
                        continue
            except Exception:
                continue
            self._backend, self._store = backend, store
            lifecycle(
                "store_failover",
                level=logging.WARNING,
                old_host=cached.store_host,
                new_host=cand,
                endpoint=f"{info.addr}:{info.standby_port}",
                cause=repr(exc)[:120],
            )
            return True
        return False

    # -- heartbeats ------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="elastrain-heartbeat", daemon=True)
        self._thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def _heartbeat_loop(self) -> None:
        s = self._settings
        while not self._stop.wait(s.heartbeat_interval_s):
            try:
                self._heartbeat_once(time.monotonic())
            except RendezvousStoreLostError as exc:
                self.fatal_error = exc
                lifecycle("rendezvous_store_lost", level=logging.ERROR, error=str(exc))
                return
            except Exception:
                continue  # transient; _call tracks how long the store has been failing

    def _heartbeat_once(self, now: float) -> None:
        s = self._settings
        if self._obs.last_read is not None and now - self._obs.last_read > max(s.heartbeat_timeout_s / 2, 0.5):
            self._own_stall_at = now  # this process was frozen or starved
        state = self._update(lambda cur: st.beat(cur, self.node_id))
        if self.node_id not in state.heartbeats:
            return  # not part of the job (evicted or not joined): never judge the others
        self._obs = st.observe(self._obs, state.heartbeats, now, stall_s=max(s.heartbeat_timeout_s / 2, 0.5))
        dead = st.dead_nodes(self._obs, now, s.heartbeat_timeout_s, exclude=self.node_id)
        # Probe only suspects (a heartbeat late by 1.5 intervals): a refused probe proves death at once,
        # while probing everyone every tick would cost N connections per node per interval.
        suspects = [
            n
            for n, (_, seen_at) in self._obs.seen.items()
            if n != self.node_id
            and n not in dead
            and n in state.nodes
            and (self._probe_all or now - seen_at >= 1.5 * s.heartbeat_interval_s)
        ]
        self._probe_all = False
        gone = [n for n in suspects if _refused(state.nodes[n].addr, state.nodes[n].probe_port)]
        others = [m for m in st.live_members(state) if m != self.node_id]
        if (
            others
            and all(m in dead for m in others)
            and not gone
            and now - self._own_stall_at < 3 * s.heartbeat_timeout_s
        ):
            # We were frozen and now every peer looks silent: the job moved on without us (perhaps to a
            # new store). Evicting them all would start a second world: leave instead.
            raise RendezvousStoreLostError(
                f"node {self.node_id} was frozen and lost contact with every peer; it leaves the job "
                "(the others went on without it)"
            )
        dead = sorted({*dead, *gone})
        if not dead:
            return

        evicted: list[str] = []

        def _evict(cur: st.RendezvousState) -> st.RendezvousState:
            evicted[:] = [d for d in dead if d in cur.heartbeats]
            return st.remove(cur, evicted, "dead")

        after = self._update(_evict)
        for d in evicted:
            if d not in after.heartbeats:
                lifecycle(
                    "node_dead",
                    level=logging.WARNING,
                    node=d,
                    how="probe_refused" if d in gone else "heartbeat_timeout",
                    silent_s=round(now - self._obs.seen[d][1], 3) if d in self._obs.seen else None,
                    round=after.round,
                    member=d in after.members,
                    by=self.node_id,
                )


def create_handler(
    backend: RendezvousBackend, store: Store, params: RendezvousParameters, on_store_lost: str = ""
) -> RendezvousHandler:
    """torch's handler-creator shape: elastrain's handler over ``backend`` (state) and ``store`` (per-round data)."""
    return ElastrainRendezvousHandler(backend, store, params, on_store_lost=on_store_lost)
