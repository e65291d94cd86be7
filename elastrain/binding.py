"""Where a node listens: on the interface of the address it advertises, never on every interface by default.

A node advertises one address to its peers (``--local-addr``, else its FQDN, as torch does; ``127.0.0.1`` when
the rendezvous endpoint itself is on loopback, as with ``--standalone``: every peer is then on this machine).
Every socket it listens on binds to that address's interface: the c10d store (at the endpoint's address), the
failover store, the liveness probe, the ports it hands out (:func:`free_port`), the workers' store of a round
(started by rank 0 before the script runs, :func:`host_worker_store`) and the live regroup stores. torch's
``TCPStore`` binds every interface by itself; it accepts a socket bound here instead (``master_listen_fd``).

When the address does not name one of this machine's interfaces (a name that resolves to a loopback address
other than the one it names, as Debian's ``127.0.1.1`` for the host name, or to an address of a NAT or a
load balancer), peers may reach the node some other way: it listens on every interface, as before, and says so
once (``event=listen_all``).
"""

from __future__ import annotations

import atexit
import errno
import functools
import ipaddress
import logging
import random
import socket
from collections.abc import Mapping
from datetime import timedelta

import psutil
from torch._C._distributed_c10d import TCPStore

from elastrain import ports
from elastrain.env import WARM
from elastrain.log import lifecycle

LOOPBACK = "127.0.0.1"
ANY = ""
"""What :func:`listen_host` returns when no single interface fits: listen on every one."""


def _strip(host: str) -> str:
    return host.strip().strip("[]").lower()


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address literal.

    A *name* that resolves to loopback on this machine is not: peers elsewhere may resolve it to a routable
    address (Debian maps the host name to ``127.0.1.1``).
    """
    h = _strip(host)
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def endpoint_hosts(endpoint: str) -> list[str]:
    """The hosts of ``host[:port][,host[:port]...]`` (an ``http(s)://`` scheme allowed, as etcd's endpoints)."""
    out = []
    for raw in endpoint.split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        item = item.rstrip("/")
        if not item:
            continue
        if item.startswith("["):
            out.append(item[1:].split("]", 1)[0])
        elif item.count(":") == 1:
            out.append(item.split(":", 1)[0])
        else:
            out.append(item)  # a bare host name, or a bare IPv6 address
    return [h for h in out if h]


def loopback_run(endpoint: str) -> bool:
    """Whether the rendezvous endpoint is on loopback only: every peer of the job runs on this machine."""
    hosts = endpoint_hosts(endpoint)
    return bool(hosts) and all(is_loopback(h) for h in hosts)


def advertised_address(local_addr: str | None, endpoint: str) -> str:
    """What peers and workers use to reach this node: ``--local-addr``, else loopback for a loopback rendezvous,
    else the FQDN (as torch's handler)."""
    if local_addr:
        return local_addr
    if loopback_run(endpoint):
        return LOOPBACK
    return socket.getfqdn()


def _local_addresses() -> set[str]:
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.add(a.address.split("%", 1)[0].lower())
    return out


@functools.lru_cache(maxsize=64)
def listen_host(address: str) -> str:
    """The local address to listen on for peers that reach this node at ``address``; :data:`ANY` when it names
    none of this machine's interfaces (see the module docstring)."""
    h = _strip(address)
    if not h:
        return ANY
    if is_loopback(h):
        try:
            return str(ipaddress.ip_address(h))
        except ValueError:
            return LOOPBACK  # localhost
    try:
        infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        lifecycle("listen_all", level=logging.WARNING, address=address, why=f"it does not resolve here ({exc})")
        return ANY
    resolved = [str(info[4][0]).split("%", 1)[0].lower() for info in infos]
    local = _local_addresses()
    for ip in resolved:
        if ip in local and not ipaddress.ip_address(ip).is_loopback:
            return ip
    lifecycle(
        "listen_all",
        level=logging.WARNING,
        address=address,
        resolves_to=",".join(dict.fromkeys(resolved)),
        why="that is no address of this machine's interfaces that peers elsewhere could use; pass --local-addr "
        "with this node's address to listen on that interface only",
    )
    return ANY


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``host`` from :func:`listen_host`; port 0: any free one), listening.

    :data:`ANY` listens on every interface of both families where this machine has IPv6 (as torch's ``TCPStore``
    does), else on every IPv4 one: a peer that resolves this node's name to either reaches it."""
    if host == ANY and socket.has_ipv6:
        try:
            return _listening(socket.AF_INET6, "::", port, dual_stack=True)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise  # the port is taken (in either family): not a machine without IPv6
            lifecycle("listen_ipv4_only", level=logging.DEBUG, error=repr(exc)[:120])  # no IPv6 on this machine
    return _listening(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port, dual_stack=False)


def _listening(family: int, host: str, port: int, dual_stack: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


_DRAWS = 64
"""How many candidate ports :func:`free_port` tries before it takes the kernel's choice."""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def free_port(address: str) -> int:
    """A port that is free now on the interface this node listens on for ``address``.

    It is bound later by another process (a round's rank 0), so it is drawn where no outgoing connection takes
    it as its source port in the meantime (:mod:`elastrain.ports`), and checked free here the way it will be bound
    (:func:`bound_socket`: on every interface, a port taken in either family is not free). Falls back to the
    kernel's choice when no drawn port is free.
    """
    host = listen_host(address)
    span = ports.handed_out(
        ports.ephemeral_range(_read(ports.EPHEMERAL_RANGE_FILE)),
        ports.reserved_ports(_read(ports.RESERVED_PORTS_FILE)),
    )
    for port in random.sample(span, min(_DRAWS, len(span))):
        try:
            # Checked as it will be bound: on every interface, both families (ANY), as bound_socket and torch do.
            with bound_socket(host, port):
                return port
        except OSError:
            continue
    with bound_socket(host, 0) as s:
        return int(s.getsockname()[1])


def tcp_store_server(
    address: str, port: int, timeout: timedelta, world_size: int | None = None, wait_for_workers: bool = True
) -> TCPStore:
    """A TCPStore that hosts its server on ``address``'s interface (port 0: any free one; ``store.port`` says which).

    Multi-tenant, as torch's own: a store of this process that already serves ``port`` (the workers' store that
    :func:`host_worker_store` started) is shared rather than bound twice. Raises what ``TCPStore`` raises when the
    port is taken by another process.
    """
    host = listen_host(address)
    sock: socket.socket | None = None
    if host != ANY:
        try:
            sock = bound_socket(host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # Taken: by a server of this process (TCPStore then shares it), or by another one (TCPStore fails).
    if sock is None:
        return TCPStore(address, port, world_size, True, timeout, wait_for_workers=wait_for_workers, multi_tenant=True)
    bound = int(sock.getsockname()[1])
    fd = sock.detach()  # the store's server owns it from here
    return TCPStore(
        address,
        bound,
        world_size,
        True,
        timeout,
        wait_for_workers=wait_for_workers,
        multi_tenant=True,
        master_listen_fd=fd,
    )


_held: list[TCPStore] = []


def host_worker_store(environ: Mapping[str, str]) -> None:
    """In a worker about to run its script: if it is rank 0 of its round, start the round's store now, bound to
    ``MASTER_ADDR``'s interface.

    torch's ``init_process_group`` (``env://``) makes rank 0 host the store at ``MASTER_ADDR:MASTER_PORT`` and
    binds every interface; its store is multi-tenant, so it takes this process's server on that port instead. The
    server lives as long as the process (a script that destroys its default group and creates it again on the same
    port finds the first one's keys there). Nothing is done for warm ``--live`` workers (no round yet) or when
    torch's agent store is used.
    """
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if environ.get("RANK") != "0" or not addr or not port.isdigit() or int(port) == 0:
        return
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) or environ.get(WARM) == "1":
        return
    if listen_host(addr) == ANY:
        return  # torch binds every interface itself, as before
    try:
        _held.append(tcp_store_server(addr, int(port), timedelta(seconds=60), wait_for_workers=False))
        atexit.register(_held.clear)  # stopped while the interpreter is whole, not during its finalization
    except (OSError, RuntimeError, ValueError) as exc:
        # The script's own init then reports the port (or binds it as torch does).
        lifecycle("worker_store_early_failed", level=logging.WARNING, master=f"{addr}:{port}", error=repr(exc)[:160])


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux), for ``GLOO_SOCKET_IFNAME``."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return str(name)
    return None
