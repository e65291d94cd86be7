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


@pytest.mark.parametrize("mode", ["all", "receivers", "pooled"])
def test_the_state_arrives_whole_and_in_place_and_only_where_it_is_sent(mode: str) -> None:
    lines = _run(mode)
    before, after = lines["BEFORE"], lines["AFTER"]
    assert len({before[r]["hash"] for r in range(WORLD)}) == WORLD, "the ranks must start with different states"
    assert after[0]["hash"] == before[0]["hash"], "the source's state changed"
    assert after[2]["hash"] == before[0]["hash"] and after[2]["counter"] == "0", after
    if mode in ("receivers", "pooled"):
        assert after[1]["hash"] == before[1]["hash"] and after[1]["sent"] == "0", "rank 1 was sent state"
    else:
        assert after[1]["hash"] == before[0]["hash"]
    assert int(after[0]["sent"]) > 2_800_000, after[0]
    # The model's parameters are received into the receiver's own tensors: no copy, no new memory (also when
    # the device is named cpu:0, as accelerate names it, and the tensors report cpu).
    assert all(after[r]["in_place"] == "True" for r in range(WORLD)), after
    # A new member's optimizer state lands in the memory it made ready while it waited, tensor for tensor.
    assert after[2]["pooled"] == str(mode == "pooled"), after[2]


def test_the_optimizer_state_streams_while_a_step_runs_and_lands_whole() -> None:
    lines = _run("overlap")
    before, after = lines["BEFORE"], lines["AFTER"]
    # The model (and the small state) arrive before the call returns; the optimizer's state by finish().
    assert after[2]["model_on_return"] == before[0]["model"], after[2]
    assert after[2]["hash"] == before[0]["hash"] and after[2]["counter"] == "0", after
    assert after[1]["hash"] == before[1]["hash"] and after[1]["sent"] == "0", "rank 1 was sent state"
    assert after[0]["hash"] == before[0]["hash"], "the source's state changed"
    assert all(after[r]["complete"] == "True" and after[r]["error"] == "none" for r in range(WORLD)), after
    assert all(after[r]["in_place"] == "True" for r in range(WORLD)), after


@pytest.mark.parametrize("mode", ["helped", "helped-overlap"])
def test_the_members_that_hold_the_state_each_send_a_share_and_it_arrives_whole(mode: str) -> None:
    lines = _run(mode)
    before, after = lines["BEFORE"], lines["AFTER"]
    assert before[0]["model"] == before[1]["model"] != before[2]["model"], before
    assert after[2]["hash"] == before[0]["hash"] and after[2]["counter"] == "0", after  # objects: the source's
    assert after[1]["hash"] == before[1]["hash"] and after[1]["counter"] == "10", "the helper's state changed"
    assert after[0]["hash"] == before[0]["hash"], "the source's state changed"
    assert all(after[r]["in_place"] == "True" for r in range(WORLD)), after
    if mode == "helped-overlap":
        assert all(after[r]["complete"] == "True" and after[r]["error"] == "none" for r in range(WORLD)), after


def test_a_helper_sends_its_own_bytes() -> None:
    """A control: a helper holding another state of the same shapes (never so after an agreement) leaves the receiver
    with neither state: the helper's pieces are what it sent."""
    lines = _run("helped-unlike")
    before, after = lines["BEFORE"], lines["AFTER"]
    assert after[2]["hash"] not in (before[0]["hash"], before[1]["hash"]), after


def test_a_receiver_whose_optimizer_state_broke_off_says_its_state_is_not_whole() -> None:
    lines = _run("broken")
    after = lines["AFTER"]
    assert 0 not in after, "the source left as soon as the call returned"
    assert after[2]["error"] == "TransferFailedError" and after[2]["intact"] == "False", after[2]
    assert after[2]["complete"] == "False", after[2]
    assert after[1]["intact"] == "True" and after[1]["error"] == "none", after[1]  # it received nothing


def test_frozen_parameters_every_receiver_holds_alike_are_not_sent() -> None:
    """A frozen layer (LoRA's base model) that rank 2 built as rank 0 did stays out of the transfer; built from
    another seed, it is sent. Either way rank 2 ends with rank 0's whole state."""
    alike, unlike = _run("frozen"), _run("frozen-unlike")
    for lines in (alike, unlike):
        before, after = lines["BEFORE"], lines["AFTER"]
        assert after[2]["hash"] == before[0]["hash"] and after[2]["counter"] == "0", after
        assert after[1]["hash"] == before[1]["hash"] and after[1]["sent"] == "0", "rank 1 was sent state"
        assert after[2]["in_place"] == "True", after
    assert alike["BEFORE"][2]["hash"] != unlike["BEFORE"][2]["hash"]
    base = 512 * 512 * 4 + 512 * 4  # the frozen layer's bytes
    assert int(unlike["AFTER"][0]["sent"]) - int(alike["AFTER"][0]["sent"]) == base, (alike["AFTER"], unlike["AFTER"])
