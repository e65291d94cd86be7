from __future__ import annotations

import json

import pytest

from elastrain.errors import CheckpointMismatchError
from elastrain.train_state import TrainState


def test_history_records_changes_not_restarts() -> None:
    st = TrainState()
    assert st.start(2, now=1.0) is None
    assert st.reference_world_size == 2
    st.advance(16, epoch=0)
    st.advance(16, epoch=0)
    assert st.start(2, now=2.0) is None  # a restart at the same size
    assert st.start(1, lr_scale=0.5, now=3.0) == 2
    st.advance(8, epoch=1)
    assert (st.step, st.samples_seen, st.epoch) == (3, 40, 1)
    assert st.steps_since_change == 1
    assert st.previous_lr_scale() == 1.0
    assert [(h.step, h.world_size) for h in st.history] == [(0, 2), (2, 1)]


def test_round_trips_through_json() -> None:
    st = TrainState()
    st.start(3, lr_scale=1.5, now=10.0)
    st.advance(24, epoch=0)
    st.start(1, lr_scale=0.5, now=11.0)
    data = json.loads(json.dumps(st.state_dict()))
    back = TrainState()
    back.load_state_dict(data)
    assert back == st


def test_malformed_state_is_a_mismatch() -> None:
    with pytest.raises(CheckpointMismatchError, match="train state"):
        TrainState().load_state_dict({"step": 1})
