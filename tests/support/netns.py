"""Private networks of Linux network namespaces for partition tests: nodes with real addresses, links to cut.

Layout of one :class:`Network` of N nodes (all names carry a creation time and the pid, so parallel runs
never collide and leftovers of a crashed run can be told apart and removed; older than an hour, they are
removed by :func:`network`)::

    node ns  <prefix>-n0   eth0 10.213.0.1/24 ──veth── p0 ┐
    node ns  <prefix>-n1   eth0 10.213.0.2/24 ──veth── p1 ├─ bridges in the hub ns  <prefix>-hub
    ...                                                  ┘

Everything lives inside namespaces created here: the host's own network namespace gets no interface,
no address and no route, so traffic between nodes can never leave them. Inside each node namespace only
``lo`` and ``eth0`` exist and the only route is the private /24.

A partition moves hub ports onto separate bridges (``partition([0, 1], [2])``): packets between groups
are silently lost, as on a real network split, while every interface stays up. :meth:`Network.link_down`
(carrier loss on one node's link) is the other way to cut a node off. ``tc netem``/``tc ... action drop``
would be a third, but this machine's kernel has no netem, classifier or action modules (``Specified qdisc
kind is unknown``), and iptables is not needed: moving bridge ports needs only ``ip``.
:meth:`Network.close` removes everything and is idempotent; processes still running inside the
namespaces (only ever ones a test started there) are SIGKILLed by pid first.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

PREFIX = "etpart"
ETC_NETNS = "/etc/netns"
"""``ip netns exec NS`` mounts the files of ``/etc/netns/NS`` over ``/etc``'s, for the command it runs."""
SUBNET = "10.213.0"  # a private /24 that exists only inside namespaces created here
STALE_AFTER_S = 3600.0
NODE_IF = "eth0"  # the node's interface, inside its own namespace (GLOO_SOCKET_IFNAME)
_IP_TIMEOUT_S = 20.0
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-\d+-(?:hub|n\d+)$")
_seq = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(cmd)}: no answer within {_IP_TIMEOUT_S}s") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


@functools.cache
def unavailable_reason() -> str | None:
    """``None`` if this process may create network namespaces, veth pairs and bridges; else why not.

    Found by trying (a namespace with a veth pair and a bridge, deleted at once): being root is not
    enough where a container lacks CAP_SYS_ADMIN/CAP_NET_ADMIN or the kernel lacks veth/bridge.
    """
    name = f"{PREFIX}-{int(time.time())}-{os.getpid()}-{next(_seq)}-hub"
    try:
        _run("ip", "netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except NetnsError as exc:
        return f"the kernel refuses network namespaces here: {exc}"
    try:
        _run("ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _run("ip", "-n", name, "link", "add", "probebr", "type", "bridge")
    except NetnsError as exc:
        return f"the kernel refuses veth pairs or bridges inside a namespace: {exc}"
    finally:
        _delete_namespace(name)
    return None


def namespaces() -> list[str]:
    """Every named network namespace on this machine (``ip netns list``)."""
    out = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` (by pid) and delete it, with its files in ``/etc/netns``; deleting a namespace
    deletes its veth ends too."""
    for pid in _pids_in(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _run("ip", "netns", "delete", ns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def remove_stale(now: float | None = None, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Delete namespaces of this module's prefix created more than ``older_than_s`` ago (crashed runs)."""
    now = time.time() if now is None else now
    removed = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and now - int(m.group(1)) > older_than_s:
            _delete_namespace(ns)
            removed.append(ns)
    return removed


@dataclass(frozen=True)
class NetNode:
    index: int
    ns: str
    addr: str
    port: str
    """The node's port on the hub bridge (an interface in the hub namespace)."""


class Network:
    """N node namespaces on one private bridge; see the module docstring. Use as a context manager."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"a Network has 1 to 200 nodes, got {n}")
        stem = f"{PREFIX}-{int(time.time())}-{os.getpid()}-{next(_seq)}"
        self.hub = f"{stem}-hub"
        self.nodes = [NetNode(i, f"{stem}-n{i}", f"{SUBNET}.{i + 1}", f"p{i}") for i in range(n)]
        self._bridges = ["br0"]
        self._created: list[str] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        self._add_ns(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_ns(node.ns)
            _run("ip", "-n", node.ns, "link", "set", "lo", "up")
            # Both ends are created directly inside their namespaces: nothing appears in the host's.
            _run(
                "ip", "-n", self.hub, "link", "add", node.port, "type", "veth",
                "peer", "name", NODE_IF, "netns", node.ns,
            )  # fmt: skip
            _run("ip", "-n", self.hub, "link", "set", node.port, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", node.port, "up")
            _run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", NODE_IF)
            _run("ip", "-n", node.ns, "link", "set", NODE_IF, "up")

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._created.append(ns)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (and so every interface) this network created; safe to call twice."""
        while self._created:
            _delete_namespace(self._created.pop())

    # -- running things ------------------------------------------------------------------------
    def cmd(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``i``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.nodes[i].ns, *argv]

    def pids(self, i: int) -> list[int]:
        """Processes running inside node ``i``'s namespace."""
        return _pids_in(self.nodes[i].ns)

    # -- cutting and healing -------------------------------------------------------------------
    def partition(self, *groups: Iterable[int]) -> None:
        """Split the network: nodes of one group reach each other only. Nodes in no group stay on br0."""
        seen: set[int] = set()
        for g, group in enumerate(groups):
            bridge = self._bridge(g)
            for i in group:
                if i in seen or not 0 <= i < len(self.nodes):
                    raise ValueError(f"node {i} is unknown or in two groups of {groups}")
                seen.add(i)
                _run("ip", "-n", self.hub, "link", "set", self.nodes[i].port, "master", bridge)

    def isolate(self, i: int) -> None:
        """Cut node ``i`` off from every other node (the others still reach each other)."""
        self.partition([j for j in range(len(self.nodes)) if j != i], [i])

    def heal(self) -> None:
        """Undo :meth:`partition`/:meth:`isolate`: every port back on one bridge."""
        for node in self.nodes:
            _run("ip", "-n", self.hub, "link", "set", node.port, "master", "br0")

    def _bridge(self, g: int) -> str:
        while len(self._bridges) <= g:
            name = f"br{len(self._bridges)}"
            _run("ip", "-n", self.hub, "link", "add", name, "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", name, "up")
            self._bridges.append(name)
        return self._bridges[g]

    def add_address(self, i: int, cidr: str) -> None:
        """One more address on node ``i``'s ``eth0`` (an IPv6 one, say: ``2001:db8::1/64``), usable at once."""
        _run("ip", "-n", self.nodes[i].ns, "addr", "add", cidr, "dev", NODE_IF, "nodad")

    def hosts(self, i: int, names: dict[str, list[str]]) -> None:
        """Commands run in node ``i``'s namespace resolve each name to its addresses (their own ``/etc/hosts``)."""
        folder = os.path.join(ETC_NETNS, self.nodes[i].ns)
        os.makedirs(folder, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{a} {name}" for name, addrs in names.items() for a in addrs]
        with open(os.path.join(folder, "hosts"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")

    def link_down(self, i: int) -> None:
        """Take node ``i``'s hub port down: its ``eth0`` loses carrier (a pulled cable)."""
        _run("ip", "-n", self.hub, "link", "set", self.nodes[i].port, "down")

    def link_up(self, i: int) -> None:
        _run("ip", "-n", self.hub, "link", "set", self.nodes[i].port, "up")


@contextlib.contextmanager
def network(n: int) -> Iterator[Network]:
    """A :class:`Network` of ``n`` nodes, deleted on exit whatever happens; stale leftovers removed first."""
    remove_stale()
    net = Network(n)
    try:
        yield net
    finally:
        net.close()
