"""Which ports a node hands out to be bound later by another process (a round's ``MASTER_PORT``, where the round's
workers' store and a live regroup's listen; the standby store's), as pure functions of the kernel's settings.

A port that ``bind`` to port 0 returned is one of the kernel's ephemeral range, the range it also gives every
outgoing connection as its source port: one of the many connections a job opens can take it before the process
meant to listen on it does (``EADDRINUSE`` at the round's start). So a node draws such ports from the span just
below that range, leaving out what the machine keeps for others: the ports the administrator reserved
(``ip_local_reserved_ports``), torch's default rendezvous and master ports (another job on the machine may start
on them), and Kubernetes' NodePort range (kube-proxy redirects them on a node's own addresses).
"""

from __future__ import annotations

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"
LINUX_EPHEMERAL = (32768, 60999)
SPAN = 12288
"""How many ports below the ephemeral range a node draws from (before what is left out)."""
LEFT_OUT = (range(29400, 29600), range(30000, 32768))
"""torch's default rendezvous (29400) and master (29500) ports and their neighbours; Kubernetes' NodePort range."""


def ephemeral_range(text: str | None) -> tuple[int, int]:
    """The kernel's ephemeral range from ``ip_local_port_range``'s text (Linux's default when absent or odd)."""
    try:
        low, high = (int(v) for v in (text or "").split())
    except ValueError:
        return LINUX_EPHEMERAL
    return (low, high) if 1024 < low <= high <= 65535 else LINUX_EPHEMERAL


def reserved_ports(text: str | None) -> frozenset[int]:
    """The ports of ``ip_local_reserved_ports``'s text (``8080,9000-9010``); what does not parse is left out."""
    out: set[int] = set()
    for part in (text or "").replace("\n", ",").split(","):
        first, _, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            continue
        out.update(range(max(lo, 0), min(hi, 65535) + 1))
    return frozenset(out)


def handed_out(ephemeral: tuple[int, int], reserved: frozenset[int] = frozenset()) -> list[int]:
    """The ports a node draws from: the :data:`SPAN` just below the ephemeral range (above 1024), less the
    reserved ports and :data:`LEFT_OUT`; empty when the ephemeral range leaves no room below it."""
    low = ephemeral[0]
    return [p for p in range(max(1025, low - SPAN), low) if p not in reserved and not any(p in r for r in LEFT_OUT)]
