"""Slurm host lists (``node[01-03,07],gpu5``) expanded to host names, like ``scontrol show hostnames``.

The grammar Slurm uses for ``SLURM_JOB_NODELIST``: items separated, outside brackets, by commas or
whitespace (Slurm's host-list parser splits on both: ``"n1 n2"`` and ``"n1, n2"`` are two hosts, as
``--nodelist`` accepts them); in an item, each ``[...]`` holds comma-separated numbers or ``lo-hi``
ranges, and an item with several bracket groups expands to their product, in order (``r[1-2]n[1-2]`` →
r1n1 r1n2 r2n1 r2n2). A range keeps the zero padding of its lower bound (``[08-10]`` → 08 09 10). An
empty item between two commas, or before or after one, is an error.
"""

from __future__ import annotations

import itertools
import re

from elastrain.errors import LaunchSpecError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_HOSTS = 1 << 20  # a typo like node[1-999999999] must not exhaust memory


def _split_top(text: str) -> list[str]:
    """Split at commas and runs of whitespace that are outside brackets; raise on unbalanced brackets and on
    an empty item between commas."""
    items: list[str] = []
    depth, item = 0, ""
    after_comma = True  # at the start, as after a comma: an item must come before the next comma
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchSpecError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchSpecError(f"host list {text!r}: ']' without '['")
        elif depth == 0 and (ch == "," or ch.isspace()):
            if item:
                items.append(item)
                item, after_comma = "", ch == ","
            elif ch == ",":
                if after_comma:
                    raise LaunchSpecError(f"host list {text!r}: empty item")
                after_comma = True
            continue
        item += ch
    if depth:
        raise LaunchSpecError(f"host list {text!r}: '[' without ']'")
    if item:
        items.append(item)
    elif after_comma:
        raise LaunchSpecError(f"host list {text!r}: empty item")
    return items


def _numbers(group: str, text: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise LaunchSpecError(f"host list {text!r}: {part!r} is not a number or lo-hi range")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise LaunchSpecError(f"host list {text!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) + len(out) >= MAX_HOSTS:
            raise LaunchSpecError(f"host list {text!r}: more than {MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_item(item: str, text: str) -> list[str]:
    # "r[1-2]n[01-02]x" → literal pieces and number choices, then their product.
    pieces: list[list[str]] = []
    for literal, group in re.findall(r"([^\[\]]*)(\[[^\]]*\])?", item):
        if literal:
            pieces.append([literal])
        if group:
            pieces.append(_numbers(group[1:-1], text))
    hosts = ["".join(p) for p in itertools.product(*pieces)]
    if not hosts or not hosts[0]:
        raise LaunchSpecError(f"host list {text!r}: empty host name")
    return hosts


def expand_hostlist(text: str) -> list[str]:
    """Every host in ``text``, in order, duplicates kept (as Slurm lists them)."""
    text = text.strip()
    if not text:
        raise LaunchSpecError("host list is empty (is SLURM_JOB_NODELIST set?)")
    hosts: list[str] = []
    for item in _split_top(text):
        hosts.extend(_expand_item(item, text))
        if len(hosts) > MAX_HOSTS:
            raise LaunchSpecError(f"host list {text!r}: more than {MAX_HOSTS} hosts")
    return hosts


def first_host(text: str) -> str:
    """The first host of a Slurm host list: where the c10d rendezvous store listens."""
    return expand_hostlist(text)[0]
