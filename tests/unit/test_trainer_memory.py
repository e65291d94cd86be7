"""What a Trainer worker keeps or receives at a regroup, and which checkpoint it resumes from (pure)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import EarlyStoppingCallback, PrinterCallback, TrainerState

from elastrain.checkpoint import layout
from elastrain.integrations.trainer.checkpoints import choose, newest_committed
from elastrain.integrations.trainer.memory import (
    DataPosition,
    Deferred,
    Progress,
    callback_states,
    restore_callback_states,
)


def test_the_data_position_is_a_function_of_the_step() -> None:
    p = DataPosition(step=10, cursor=80, global_batch=8)
    assert p.cursor_at(10) == 80 and p.cursor_at(13) == 104
    p.rebase(13)
    assert (p.step, p.cursor) == (13, 104)
    q = DataPosition()
    q.load_state_dict(p.state_dict())
    assert q == p


def test_progress_travels_as_plain_values_into_a_fresh_trainer_state() -> None:
    held = TrainerState(global_step=42, epoch=1.5, total_flos=3.0, best_metric=0.25)
    held.log_history = [{"loss": 2.5, "step": 40}]
    stopper = EarlyStoppingCallback(early_stopping_patience=3)
    stopper.early_stopping_patience_counter = 2
    sent = Progress()
    sent.track(held, [PrinterCallback(), stopper])
    state = sent.state_dict()
    assert json.loads(json.dumps(state)) == state  # nothing but plain values
    received = Progress()
    received.load_state_dict(state)
    fresh, mine = TrainerState(), EarlyStoppingCallback(early_stopping_patience=3)
    received.apply(fresh, [mine])
    assert (fresh.global_step, fresh.epoch, fresh.best_metric, fresh.log_history) == (42, 1.5, 0.25, held.log_history)
    assert mine.early_stopping_patience_counter == 2  # every member stops at the same evaluation


def test_callbacks_a_member_lacks_or_has_more_of_keep_their_own_state() -> None:
    counters = [1, 2]
    sent = [EarlyStoppingCallback(), EarlyStoppingCallback()]
    for cb, n in zip(sent, counters, strict=True):
        cb.early_stopping_patience_counter = n
    states = callback_states(sent)
    assert states == {
        "EarlyStoppingCallback": [{"early_stopping_patience_counter": 1}, {"early_stopping_patience_counter": 2}]
    }
    here = [EarlyStoppingCallback()]
    restore_callback_states(here, states)
    assert here[0].early_stopping_patience_counter == 1
    more = [EarlyStoppingCallback(), EarlyStoppingCallback(), EarlyStoppingCallback()]
    restore_callback_states(more, states)
    assert [cb.early_stopping_patience_counter for cb in more] == [1, 2, 0]
    restore_callback_states(more, {})  # from a member with none: nothing changes
    assert [cb.early_stopping_patience_counter for cb in more] == [1, 2, 0]


def test_the_token_count_kept_is_the_last_completed_steps() -> None:
    """The Trainer counts each micro-batch's tokens as it finishes it: a step lost half-way must not count twice."""
    state = TrainerState(global_step=6, num_input_tokens_seen=600)
    progress = Progress()
    progress.track(state, [])
    progress.step_begins(state)  # step 7 begins
    state.num_input_tokens_seen += 50  # its first micro-batch finished; then the world broke
    assert progress.state_dict()["num_input_tokens_seen"] == 600
    progress.snapshot()
    fresh = TrainerState()
    progress.apply(fresh, [])
    assert (fresh.global_step, fresh.num_input_tokens_seen) == (6, 600)
    state.num_input_tokens_seen += 50
    state.global_step = 7  # the step completed: its whole count is progress
    assert progress.state_dict()["num_input_tokens_seen"] == 700


def test_a_deferred_state_waits_for_its_object() -> None:
    class Sched:
        def __init__(self) -> None:
            self.state = {"last_epoch": 0}

        def state_dict(self) -> dict[str, int]:
            return dict(self.state)

        def load_state_dict(self, s: dict[str, int]) -> None:
            self.state = dict(s)

    d = Deferred()
    assert d.state_dict() == {}
    d.load_state_dict({"last_epoch": 7})
    later = Sched()
    d.apply(later)
    assert later.state == {"last_epoch": 7}
    d.apply(Sched())  # applied once
    assert d.pending is None


def _folder(root: Path, step: int, committed: bool) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if committed:
        (d / layout.MARKER).write_text("{}")
    return d


def test_resume_never_loads_a_folder_that_was_not_committed(tmp_path: Path) -> None:
    _folder(tmp_path, 100, committed=True)
    cut = _folder(tmp_path, 150, committed=False)  # a save a restart cut short
    newest = str(tmp_path / "checkpoint-100")
    assert newest_committed(str(tmp_path)) == newest
    assert choose(None, str(tmp_path)).path == newest
    assert choose(True, str(tmp_path)).path == newest
    assert choose(False, str(tmp_path)).path is None
    replaced = choose(str(cut), str(tmp_path))
    assert (replaced.path, replaced.replaced) == (newest, str(cut))
    assert choose(newest, str(tmp_path)).path == newest


def test_no_committed_folder_is_a_fresh_start(tmp_path: Path) -> None:
    _folder(tmp_path, 5, committed=False)
    assert choose(None, str(tmp_path)).path is None
    assert choose(str(tmp_path / "checkpoint-5"), str(tmp_path)).path is None
    assert newest_committed(str(tmp_path / "missing")) is None
