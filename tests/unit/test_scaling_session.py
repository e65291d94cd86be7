"""The Session's use of the scaling policies in one process: LR rescale and ramp, loss scales, loader workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from elastrain.env import WorkerEnv
from elastrain.metrics import read_events, read_metrics
from elastrain.scaling import warmup_linear
from elastrain.session import Session, SessionError
from elastrain.train_state import WorldSizeChange

ENV = WorkerEnv.from_environ({})


def make(tmp_path: Path, **kw: object) -> tuple[Session, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(24, dtype=torch.float32).reshape(12, 2), torch.ones(12))
    kw.setdefault("max_steps", 4)
    session = Session(model, opt, data, metrics_dir=str(tmp_path), env=ENV, **kw)  # type: ignore[arg-type]
    return session, opt


def test_linear_policy_rescales_and_ramps_after_a_change(tmp_path: Path) -> None:
    session, _ = make(tmp_path, policy="linear", micro_batch=3, rescale_warmup_steps=2)
    # As if a checkpoint said: the job ran at world size 2 (the reference) until now.
    session.state.history.append(WorldSizeChange(step=0, world_size=2, time=0.0, lr_scale=1.0))
    lrs = []
    with session:
        assert session.plan is not None and session.plan.global_batch == 3 and session.plan.lr_scale == 0.5
        for step in session:
            for mb in step:
                x, y = mb.data
                step.backward(((session.model(x).squeeze(-1) - y) ** 2).mean(), mb)
            lrs.append(step.lr)
            step.optimizer_step()
            step.log(loss=step.mean_loss())
    # From scale 1.0 at world size 2 to 0.5 at world size 1, over two steps.
    assert lrs == pytest.approx([0.075, 0.05, 0.05, 0.05])
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["start", "world_size_changed", "rescale", "finish"]
    assert events[2]["world_size"] == "2->1" and events[2]["lr"] == "0.075"
    assert [s for s, _ in read_metrics(tmp_path / "metrics.jsonl").series("loss")] == [1, 2, 3, 4]


def test_schedule_follows_samples_and_constant_leaves_lr_alone(tmp_path: Path) -> None:
    session, opt = make(tmp_path, global_batch=4, micro_batch=2, lr_schedule=warmup_linear(8, 100))
    with session:
        lrs = []
        for step in session:
            lrs.append(step.lr)
            for mb in step:
                step.backward(session.model(mb.data[0]).mean(), mb)
            step.optimizer_step()
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.1 * (1 - 4 / 92)])

    session, opt = make(tmp_path / "b", global_batch=4, micro_batch=2)
    opt.param_groups[0]["lr"] = 0.3
    with session:
        for step in session:
            assert step.lr is None
            for mb in step:
                step.backward(session.model(mb.data[0]).mean(), mb)
            step.optimizer_step()
    assert opt.param_groups[0]["lr"] == 0.3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loss_scales_cover_the_step(tmp_path: Path, num_workers: int) -> None:
    # 12 samples, global batch 5, micro 2: steps of 5, 5 and a partial 2 (epoch_end="partial").
    session, _ = make(tmp_path, global_batch=5, micro_batch=2, epochs=1, max_steps=None, num_workers=num_workers)
    seen = []
    with session:
        for step in session:
            scales = [mb.loss_scale for mb in step.micro_batches]
            assert sum(scales) == pytest.approx(1.0)
            seen.append([mb.size for mb in step.micro_batches])
            for mb in step:
                step.backward(session.model(mb.data[0]).mean(), mb)
            step.optimizer_step()
    assert seen == [[2, 2, 1], [2, 2, 1], [2]]


def test_token_normalisation(tmp_path: Path) -> None:
    session, _ = make(tmp_path, global_batch=4, micro_batch=2, token_count=lambda batch: int(batch[0][:, 0].sum()))
    with session:
        step = session.next_step()
        tokens = [int(mb.data[0][:, 0].sum()) for mb in step.micro_batches]
        assert [mb.loss_scale for mb in step.micro_batches] == pytest.approx([t / sum(tokens) for t in tokens])
        with pytest.raises(SessionError, match="optimizer_step"):
            session.next_step()
        step.optimizer_step()


def test_needs_an_end(tmp_path: Path) -> None:
    with pytest.raises(SessionError, match="max_steps"):
        make(tmp_path, global_batch=4, max_steps=None)
