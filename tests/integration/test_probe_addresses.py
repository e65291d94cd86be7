"""A peer is probed and watched at every address its name resolves to, in that address's own family (IPv6 too).

Real processes: a probe listener in a child (as an agent's), probed by name and SIGKILLed
(``tests/workers/probe_names.py``). A name that resolves to two families is given its addresses by a network
namespace's own ``/etc/hosts`` (``ip netns exec``), and the IPv6 one is a global address on that namespace's
interface, which the resolver puts before the IPv4 one (RFC 6724) so that the listener takes it, as on a dual-stack
machine. Before, a probe dialled IPv4 only: an IPv6 peer's death was never proved (a SIGKILLed node was evicted by
the heartbeat timeout, seconds later), and a live dual-stack peer listening on its IPv6 address read as dead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import netns

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "probe_names.py")
V6 = "2001:db8:213::1"  # a documentation prefix, only ever on an interface inside the namespace made here


def _probe(argv: list[str]) -> dict[str, object]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _alive_then_dead(read: dict[str, object]) -> None:
    assert read["refused_alive"] == [], read  # a live peer is never proved dead
    assert read["woke_alive"] is False, read  # nor does its watch wake
    assert read["woke_dead"] is True and read["closed"] == ["peer"], read  # its death is seen at once
    assert read["refused_dead"] == ["peer"], read  # and proved


def test_an_ipv6_peer_is_proved_dead_by_its_probe() -> None:
    read = _probe([sys.executable, WORKER, "::1"])
    assert read["listened_on"] == "::1"
    _alive_then_dead(read)


@pytest.fixture
def dual_stack() -> netns.Network:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netns.network(1) as net:
        net.add_address(0, f"{V6}/64")
        v4 = net.nodes[0].addr
        net.hosts(0, {"peer-v6-first": [v4, V6], "peer-loopback": ["::1", "127.0.0.1"]})
        yield net


def test_a_dual_stack_peer_listening_on_its_ipv6_address_is_alive_until_killed(dual_stack: netns.Network) -> None:
    read = _probe(dual_stack.cmd(0, [sys.executable, WORKER, "peer-v6-first"]))
    assert read["listened_on"] == V6  # the name's first address here: a refusal at its IPv4 one proves nothing
    _alive_then_dead(read)


def test_a_peer_listening_on_one_address_of_its_name_is_alive_until_killed(dual_stack: netns.Network) -> None:
    read = _probe(dual_stack.cmd(0, [sys.executable, WORKER, "peer-loopback", "127.0.0.1"]))
    _alive_then_dead(read)  # ::1 refuses from the start, 127.0.0.1 answers: alive
