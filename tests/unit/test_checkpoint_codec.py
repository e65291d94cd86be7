"""Splitting state into tensors and JSON, RNG capture, and the safe DCP metadata reader."""

from __future__ import annotations

import json
import math
import pickle
import random

import numpy as np
import pytest
import torch

from elastrain.checkpoint.codec import join_state, split_state
from elastrain.checkpoint.dcp_io import check_fits, load_metadata_bytes
from elastrain.checkpoint.rng import capture_rng, restore_rng
from elastrain.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError


def test_split_and_join_round_trip_exactly_through_json() -> None:
    w = torch.randn(3, 2)
    state = {
        "model": {"layer.weight": w, "a/b": torch.zeros(1)},
        "optimizer": {"param_groups": [{"betas": (0.9, 0.999), "lr": 0.1 + 0.2, "params": ["layer.weight"]}]},
        "sampler": {"cursor": 12345678901234, "done": False, "name": "x", "none": None, "inf": math.inf},
        "intkeys": {0: {"step": torch.tensor(3.0)}, 1: "one"},
    }
    tensors, plain = split_state(state)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert len(tensors) == 3
    back = join_state(json.loads(json.dumps(plain)), tensors)
    assert back["model"]["layer.weight"] is w
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["optimizer"]["param_groups"][0]["lr"] == 0.1 + 0.2
    assert back["sampler"] == state["sampler"]
    assert set(back["intkeys"]) == {0, 1} and back["intkeys"][1] == "one"


def test_values_that_json_cannot_hold_are_refused_with_their_path() -> None:
    with pytest.raises(CheckpointError, match="train_state/fn"):
        split_state({"train_state": {"fn": object()}})


def test_rng_states_round_trip() -> None:
    saved = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    restore_rng(json.loads(json.dumps(saved)))
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_metadata_reader_never_builds_arbitrary_objects() -> None:
    with pytest.raises(CheckpointCorruptError, match=r"builtins\.print"):
        load_metadata_bytes(pickle.dumps(Evil()), "ckpt")
    with pytest.raises(CheckpointCorruptError, match="unreadable"):
        load_metadata_bytes(b"garbage", "ckpt")


def test_check_fits_names_missing_unexpected_and_misshaped_keys() -> None:
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    def meta(shape: tuple[int, ...]) -> TensorStorageMetadata:
        props = TensorProperties(dtype=torch.float32)
        return TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])

    md = Metadata(state_dict_metadata={"model/a": meta((2, 2)), "model/b": meta((3,)), "model/old": meta((1,))})
    check_fits(md, {"model/a": torch.zeros(2, 2), "model/b": torch.zeros(3), "model/old": torch.zeros(1)}, "ck")
    with pytest.raises(CheckpointMismatchError) as err:
        check_fits(md, {"model/a": torch.zeros(2, 3), "model/b": torch.zeros(3), "model/new": torch.zeros(1)}, "ck")
    msg = str(err.value)
    assert "missing: model/new" in msg and "unexpected: model/old" in msg and "model/a (saved (2, 2)" in msg
