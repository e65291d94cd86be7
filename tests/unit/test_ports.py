"""The ports a node hands out (elastrain/ports.py): below the kernel's ephemeral range, less what the machine keeps
for others (a real bind of one: tests/integration/test_rendezvous_binding_listen.py and every multi-node test)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from elastrain import ports

LINUX = ports.LINUX_EPHEMERAL


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768\t60999\n", LINUX), ("50000 60000", (50000, 60000)), ("1024 65000", LINUX), ("40000 30000", LINUX),
     ("", LINUX), (None, LINUX), ("x y", LINUX), ("40000", LINUX)],
)  # fmt: skip
def test_ephemeral_range(text: str | None, expected: tuple[int, int]) -> None:
    assert ports.ephemeral_range(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", set()), (None, set()), ("\n", set()), ("8080", {8080}), ("8080,9000-9002\n", {8080, 9000, 9001, 9002}),
     ("x,22000-x, 22001 ", {22001}), ("65534-70000", {65534, 65535})],
)  # fmt: skip
def test_reserved_ports(text: str | None, expected: set[int]) -> None:
    assert ports.reserved_ports(text) == expected


def test_handed_out_ports_on_linux_defaults() -> None:
    span = ports.handed_out(LINUX)
    assert (span[0], span[-1]) == (20480, 29999)
    assert 29400 not in span and 29500 not in span and 29599 not in span and 29600 in span
    assert not any(p >= 30000 for p in span)
    assert len(span) == 12288 - 200 - 2768


@pytest.mark.parametrize(
    ("ephemeral", "first", "last"),
    [((2000, 60999), 1025, 1999), ((50000, 60000), 37712, 49999), ((1025, 60999), None, None)],
)  # fmt: skip
def test_handed_out_ports_lie_below_the_ephemeral_range(
    ephemeral: tuple[int, int], first: int | None, last: int | None
) -> None:
    span = ports.handed_out(ephemeral)
    assert ((span[0], span[-1]) if span else (None, None)) == (first, last)


@given(
    low=hs.integers(1025, 65535),
    reserved=hs.frozensets(hs.integers(1, 65535), max_size=50),
)
def test_a_handed_out_port_is_never_ephemeral_reserved_or_left_out(low: int, reserved: frozenset[int]) -> None:
    span = ports.handed_out((low, 65535), reserved)
    assert all(1024 < p < low and p not in reserved for p in span)
    assert not any(p in r for p in span for r in ports.LEFT_OUT)
    assert span == sorted(set(span))
