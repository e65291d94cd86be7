"""elastrain.wire: plain data round-trips exactly through JSON; anything else, sent or received, is refused."""

from __future__ import annotations

import math
import pickle
import struct

import numpy as np
import pytest
import torch

from elastrain import wire
from elastrain.errors import WireFormatError


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**70),
        0.1 + 0.2,
        -0.0,
        math.inf,
        "ünïcode \ud83d",
        [1, [2, (3, "x")]],
        ("ok", 3),
        {"verdict": ("stale", "why"), "files": {"a": {"size": 1, "crc32": None}}},
        {0: {"step": 3}, 1: "one", (2, 3): [4]},  # int and tuple keys
        {"__tuple__": "a key that looks like a tag", "b": 1},
        {None: 1, True: 2, 1.5: 3},
    ],
)
def test_plain_data_round_trips_exactly(value: object) -> None:
    back = wire.decode(wire.encode(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)  # tuples stay tuples, -0.0 stays -0.0, key types stay


def test_nan_and_numpy_scalars_travel_as_floats_and_ints() -> None:
    back = wire.decode(wire.encode({"nan": math.nan, "np": np.float32(1.5), "i": np.int64(7)}))
    assert math.isnan(back["nan"]) and back["np"] == 1.5 and back["i"] == 7 and type(back["i"]) is int


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"train_state": {"fn": Opaque()}}, "train_state/fn"),
        ({"a": [1, lambda: 0]}, "a/1"),
        ({"t": torch.zeros(1)}, "t"),  # tensors go as tensors, not as JSON
        ({"k": {Opaque(): 1}}, "k"),
        ({"s": {1, 2}}, "s"),
    ],
)
def test_values_that_are_not_plain_data_are_refused_naming_the_entry(value: object, where: str) -> None:
    with pytest.raises(WireFormatError, match=f"entry {where}"):
        wire.encode(value)


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps({"a": 1}),  # a peer that still sends pickles
        b"\xff\xfe",
        b'{"a": ',
        b"[" * 100_000 + b"]" * 100_000,  # deep enough to exhaust the parser's recursion
        b'{"__items__": [[{"a": 1}, 2]]}',  # a dict as a dict key
        b'{"__items__": [[1]]}',
        b'{"__tuple__": 3}',
        b'{"__tensor__": 0}',  # a placeholder where no tensor is expected
    ],
)
def test_malformed_messages_are_refused_with_a_typed_error(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        wire.decode(data)


def test_tensors_go_through_the_hooks_and_placeholders_come_in_order() -> None:
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    tree = {"model": {"w": a}, "opt": {"state": {0: {"exp_avg": b}}, "betas": (0.9, 0.999)}}
    seen: list[tuple[str, ...]] = []

    def out(t: torch.Tensor, path: tuple[str, ...]) -> list[object]:
        seen.append(path)
        return [len(seen) - 1, wire.dtype_name(t.dtype)]

    plain = wire.loads(wire.dumps(wire.to_plain(tree, out)))
    assert wire.placeholders(plain) == [[0, "float32"], [1, "int64"]]
    back = wire.from_plain(plain, lambda p: [a, b][p[0]])
    assert back["model"]["w"] is a and back["opt"]["state"][0]["exp_avg"] is b
    assert back["opt"]["betas"] == (0.9, 0.999) and seen == [("model", "w"), ("opt", "state", "#0", "exp_avg")]


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float8_e4m3fn", "bool", "int64"])
def test_dtypes_travel_by_name(name: str) -> None:
    dtype = getattr(torch, name)
    assert wire.dtype_of(wire.dtype_name(dtype)) is dtype


@pytest.mark.parametrize("name", ["float32.__class__", "Size", "manual_seed", "os", 5, None])
def test_anything_but_a_dtype_name_is_refused(name: object) -> None:
    with pytest.raises(WireFormatError, match="not a torch dtype"):
        wire.dtype_of(name)


def test_a_float_is_bit_identical_after_the_trip() -> None:
    x = struct.unpack("d", struct.pack("Q", 0x3FB999999999999A))[0]
    assert struct.pack("d", wire.decode(wire.encode(x))) == struct.pack("d", x)
