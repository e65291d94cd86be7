"""Live state transfer between real gloo processes: to every rank, or point to point to the ranks that need it."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import free_port, printed_fields, run_ranks

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "transfer_worker.py")
WORLD = 3


def _run(mode: str) -> dict[str, dict[int, dict[str, str]]]:
    outs = run_ranks(WORKER, mode, WORLD, str(free_port()), timeout=120)
    lines: dict[str, dict[int, dict[str, str]]] = {"BEFORE": {}, "AFTER": {}}
    for out in outs:
        for line in out.splitlines():
            kind = line.split(" ", 1)[0]
            if kind in lines:
                fields = printed_fields(line)
                lines[kind][int(fields["rank"])] = fields
    return lines


@pytest.mark.parametrize("mode", ["all", "receivers"])
def test_the_state_arrives_whole_and_in_place_and_only_where_it_is_sent(mode: str) -> None:
    lines = _run(mode)
    before, after = lines["BEFORE"], lines["AFTER"]
    assert len({before[r]["hash"] for r in range(WORLD)}) == WORLD, "the ranks must start with different states"
    assert after[0]["hash"] == before[0]["hash"], "the source's state changed"
    assert after[2]["hash"] == before[0]["hash"] and after[2]["counter"] == "0", after
    if mode == "receivers":
        assert after[1]["hash"] == before[1]["hash"] and after[1]["sent"] == "0", "rank 1 was sent state"
    else:
        assert after[1]["hash"] == before[0]["hash"]
    assert int(after[0]["sent"]) > 2_800_000, after[0]
    # The model's parameters are received into the receiver's own tensors: no copy, no new memory.
    assert all(after[r]["in_place"] == "True" for r in range(WORLD)), after
