"""The agent ↔ worker control channel's files: wrong shapes are typed errors read as no message, never a
crash (writers on several threads at once: tests/integration/test_control_channel_threads.py)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastrain.control import ControlChannel, RegroupChannel, RegroupNotice, SaveCause
from elastrain.control.files import Fields, MessageReader
from elastrain.errors import ControlMessageError
from elastrain.launcher.regroup import REGROUP_ACK_MARGIN_S, compiling_until

# Each file a reader decodes: a valid message, the kind of each field it reads, and what "no message" reads as.
# Kinds: int, int? (an int or null), number (finite), text, text= (a text with a default), flag= (a bool with
# a default), map (decimal string -> int).
_NOTICE = {
    "round": 3, "generation": 7, "world_size": 4, "group_rank": 1, "group_world_size": 2, "ranks": {"0": 2, "1": 3},
    "master_addr": "127.0.0.1", "master_port": 29999, "start_reason": "scale_down", "previous_world_size": 6,
    "announced_at": 1.5, "no_departure": False, "superseded": True,
}  # fmt: skip
_NOTICE_KINDS = {
    "round": "int", "generation": "int?", "world_size": "int", "group_rank": "int", "group_world_size": "int",
    "ranks": "map", "master_addr": "text", "master_port": "int", "start_reason": "text",
    "previous_world_size": "int?", "announced_at": "number", "no_departure": "flag=", "superseded": "flag=",
}  # fmt: skip
Read = Callable[[ControlChannel, RegroupChannel], object]
FILES: dict[str, tuple[dict[str, object], dict[str, str], Read, object]] = {
    "save-request.json": (
        {"request_id": 2, "reason": "leave: SIGTERM", "requested_at": 1.5, "cause": "leave"},
        {"request_id": "int", "reason": "text", "requested_at": "number", "cause": "text="},
        lambda c, r: c.current_request(),
        None,
    ),
    "save-ack.json": (
        {"step": 7, "checkpoint": "/ckpt/step-7", "current_at": 2.5},
        {"step": "int", "checkpoint": "text", "current_at": "number"},
        lambda c, r: c.latest_ack(),
        None,
    ),
    "regroup.json": (_NOTICE, _NOTICE_KINDS, lambda c, r: r.notice(), None),
    "regroup-ack-0.json": ({"round": 3, "pid": 11, "at": 1.0}, {"round": "int"}, lambda c, r: r.acked(0, 3), False),
    "broken-0.json": ({"round": 3, "at": 1.0}, {"round": "int"}, lambda c, r: r.broken_round(), None),
    "live-0.json": (
        {"local_rank": 0, "pid": 11}, {"local_rank": "int", "pid": "int"}, lambda c, r: r.live_pids(), {}
    ),
    "warm-0.json": (
        {"local_rank": 0, "pid": 11}, {"local_rank": "int", "pid": "int"}, lambda c, r: r.warm_pids(), {}
    ),
    "finishing-0.json": (
        {"local_rank": 0, "pid": 11},
        {"local_rank": "int", "pid": "int"},
        lambda c, r: r.finishing_pids(),
        {},
    ),
}  # fmt: skip

_NAN, _INF = math.nan, math.inf
BAD_VALUES = {
    "int": ["3", 1.5, True, None, [3], {"n": 3}],
    "int?": ["3", 1.5, True, [3]],
    "number": ["1.5", True, None, _NAN, _INF, [1.5]],
    "text": [1, None, ["x"], {"x": 1}, True],
    "text=": [1, None, ["x"]],
    "flag=": ["yes", 1, None, []],
    "map": [[], "0:2", None, {"a": 2}, {"0": "2"}, {"0": True}, {"0": 2.5}],
}
# Whole files that are no message of any kind: not JSON, not an object, too deep to decode, not text.
BAD_FILES = [b"", b"{", b"[]", b'"text"', b"7", b"null", b"{}", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe{}"]


def _wrong_shapes() -> Iterator[tuple[str, bytes]]:
    for name, (valid, kinds, _, _) in FILES.items():
        for raw in BAD_FILES:
            yield name, raw
        for key, kind in kinds.items():
            if not kind.endswith("="):  # a field with a default may be left out
                yield name, json.dumps({k: v for k, v in valid.items() if k != key}).encode()
            for bad in BAD_VALUES[kind]:
                yield name, json.dumps({**valid, key: bad}).encode()  # json writes NaN and Infinity as Python does


WRONG_SHAPES = list(_wrong_shapes())


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_valid_message_reads_as_a_message(tmp_path: Path, name: str) -> None:
    valid, _, read, nothing = FILES[name]
    (tmp_path / name).write_text(json.dumps(valid))
    assert read(ControlChannel(tmp_path), RegroupChannel(tmp_path)) not in (nothing, None)


@pytest.mark.parametrize(("name", "raw"), WRONG_SHAPES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(WRONG_SHAPES)])
def test_a_wrong_shape_is_no_message_and_is_logged_once(
    tmp_path: Path, logged: list[str], name: str, raw: bytes
) -> None:
    _, _, read, nothing = FILES[name]
    (tmp_path / name).write_bytes(raw)
    control, regroup = ControlChannel(tmp_path), RegroupChannel(tmp_path)
    assert read(control, regroup) == nothing
    assert read(control, regroup) == nothing  # polled again: not logged again
    (invalid,) = [line for line in logged if "event=control_message_invalid" in line]
    assert str(tmp_path / name) in invalid


@pytest.mark.parametrize("raw", [*BAD_FILES, json.dumps({"request_id": "2"}).encode()])
def test_a_worker_polling_a_wrong_request_sees_no_request(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "save-request.json").write_bytes(raw)
    (tmp_path / "save-ack.json").write_bytes(raw)
    assert ControlChannel(tmp_path).pending() is None
    agent = ControlChannel(tmp_path)  # the agent's next request replaces it, with a fresh id
    request = agent.request_save(SaveCause.LEAVE, "test")
    assert request.request_id == 1 and ControlChannel(tmp_path).pending() == request


def test_a_directory_in_place_of_a_file_is_no_message(tmp_path: Path, logged: list[str]) -> None:
    (tmp_path / "save-ack.json").mkdir()
    (tmp_path / "live-0.json").mkdir()
    assert ControlChannel(tmp_path).latest_ack() is None
    assert RegroupChannel(tmp_path).live_pids() == {}
    assert sum("event=control_message_invalid" in line for line in logged) == 2


def test_a_file_fixed_after_a_wrong_shape_reads_again(tmp_path: Path, logged: list[str]) -> None:
    channel, reader = RegroupChannel(tmp_path), RegroupChannel(tmp_path)
    (tmp_path / "regroup.json").write_text('{"round": "x"}')
    assert reader.notice() is None
    notice = RegroupNotice.from_json(_NOTICE)
    channel.announce(notice)
    assert reader.notice() == notice
    (tmp_path / "regroup.json").write_text("[]")  # a later foreign file: the last good notice stands
    assert reader.notice() == notice


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "expected a JSON object, got list"),
        ({}, "missing field 'n'"),
        ({"n": "1"}, "field 'n' must be an integer"),
        ({"n": True}, "field 'n' must be an integer"),
    ],
)
def test_errors_name_the_file_and_the_field(data: object, words: str) -> None:
    with pytest.raises(ControlMessageError, match="^" + re.escape(f"x.json: {words}")):
        Fields(data, "x.json").integer("n")


def test_regroup_notice_from_json_raises_a_typed_error() -> None:
    with pytest.raises(ControlMessageError, match=re.escape("regroup.json: field 'ranks'")):
        RegroupNotice.from_json({**_NOTICE, "ranks": [1, 2]})
    with pytest.raises(ControlMessageError, match="expected a JSON object"):
        RegroupNotice.from_json([("round", 1)])


def test_a_missing_file_is_no_message_and_not_logged(tmp_path: Path, logged: list[str]) -> None:
    assert MessageReader().read(tmp_path / "absent.json", lambda f: f.integer("n")) is None
    assert logged == []


def test_a_request_to_a_removed_directory_raises_oserror_and_leaves_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "control"
    agent = ControlChannel(directory)
    directory.rmdir()
    with pytest.raises(OSError):
        agent.request_save(SaveCause.LEAVE, "SIGTERM")
    assert not directory.exists()


def test_a_worker_in_a_compiled_first_step_extends_its_agent_s_wait_until_it_withdraws(tmp_path: Path) -> None:
    channel = RegroupChannel(tmp_path)
    assert channel.first_step_until(0) is None and compiling_until(channel, [0, 1]) is None
    channel.announce_first_step(1, pid=123, until=time.time() + 100.0)
    channel.announce_first_step(0, pid=124, until=time.time() - 1.0)  # its bound is over: no reason to wait
    until = compiling_until(channel, [0, 1])
    assert until is not None and 99.0 < until - time.monotonic() - REGROUP_ACK_MARGIN_S <= 100.0
    assert compiling_until(channel, [0]) is None  # only the missing workers count
    channel.withdraw_first_step(1)
    assert compiling_until(channel, [0, 1]) is None
    channel.announce_first_step(1, pid=125, until=time.time() + 100.0)
    channel.forget_workers([1])  # a restarted worker's word no longer holds
    assert channel.first_step_until(1) is None
