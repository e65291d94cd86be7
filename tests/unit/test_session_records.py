"""Rank 0's metrics through a live regroup that changed rank 0: the points it died before storing are stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastrain.env import WorkerEnv
from elastrain.metrics import METRICS_FILENAME, read_metrics
from elastrain.session.config import OutputConfig
from elastrain.session.records import KEPT_POINTS, Records

ENV = WorkerEnv.from_environ({})


def _records(tmp_path: Path) -> Records:
    return Records(OutputConfig(), str(tmp_path))


def _losses(tmp_path: Path) -> dict[int, float]:
    return dict(read_metrics(tmp_path / METRICS_FILENAME).series("loss"))


@pytest.mark.parametrize(
    ("old_rank0_logged", "agreed", "stored"),
    [
        (28, 28, []),  # rank 0 stored every step the world kept: nothing to add
        (27, 28, [28]),  # it died after step 28, before its point: the new rank 0 stores it
        (24, 28, [25, 26, 27, 28]),  # an object store's buffer lost several
        (27, 27, []),  # the world goes on from 27: 28 is computed again and logged then
        (29, 28, []),  # rank 0 logged a step the world gave up: superseded, nothing added
    ],
)
def test_the_new_rank_0_stores_the_points_the_file_lacks_up_to_the_agreed_step(
    tmp_path: Path, old_rank0_logged: int, agreed: int, stored: list[int]
) -> None:
    old, other = _records(tmp_path), _records(tmp_path)
    old.open(ENV, "seg-a", 0)
    for step in range(1, 30):
        if step <= old_rank0_logged:
            old.log(step, {"loss": torch.tensor(float(step))})
        other.log(step, {"loss": torch.tensor(float(step)), "lr": 0.1})  # not rank 0: keeps, writes nothing
    old.close_writers()
    assert max(_losses(tmp_path)) == old_rank0_logged
    other.reopen(0, ENV, "seg-b", agreed, source=0)  # the regroup made it rank 0; it sent the agreed state
    losses = _losses(tmp_path)
    assert sorted(s for s in losses if s > old_rank0_logged) == stored
    assert all(losses[s] == float(s) for s in losses)
    other.close_writers()


@pytest.mark.parametrize("source", [1, None])
def test_the_points_are_stored_once_by_the_state_source(tmp_path: Path, source: int | None) -> None:
    """A worker replaced alone takes its rank (0) back, cold: it kept nothing. The survivor that sends it the state
    stores the points as a point writer of the new segment; nothing is stored twice."""
    old, survivor, cold = _records(tmp_path), _records(tmp_path), _records(tmp_path)
    old.open(ENV, "seg-a", 0)
    for step in range(1, 11):
        if step <= 8:
            old.log(step, {"loss": float(step)})
        survivor.log(step, {"loss": float(step)})
    old.close_writers()
    cold.reopen(0, ENV, "seg-b", 10, source=source)  # the replaced worker: rank 0 again, nothing kept
    survivor.reopen(1, ENV, "seg-b", 10, source=source)
    history = read_metrics(tmp_path / METRICS_FILENAME)
    steps = sorted(p.step for p in history.active)
    # With no live source (a world that read its checkpoint) nothing is recovered: the steps are computed again.
    assert steps == list(range(1, 11) if source == 1 else range(1, 9))
    cold.close_writers()


def test_a_rank_keeps_a_bounded_number_of_points_and_forgets_them_once_it_wrote(tmp_path: Path) -> None:
    r = _records(tmp_path)
    for step in range(1, KEPT_POINTS + 11):
        r.log(step, {"loss": 1.0})
    r.reopen(0, ENV, "seg-a", KEPT_POINTS + 10, source=0)
    stored = sorted(_losses(tmp_path))
    assert stored == list(range(11, KEPT_POINTS + 11))
    r.reopen(1, ENV, "seg-b", KEPT_POINTS + 10, source=1)  # rank 1 now: nothing written, nothing kept from before
    r.reopen(0, ENV, "seg-c", KEPT_POINTS + 10, source=0)
    assert sorted(_losses(tmp_path)) == stored


def test_a_kept_loss_holds_no_autograd_graph(tmp_path: Path) -> None:
    w = torch.ones(3, requires_grad=True)
    r = _records(tmp_path)
    r.log(1, {"loss": (w * 2).sum()})
    [(_, values)] = list(r._kept)
    assert values["loss"].grad_fn is None and values["loss"].item() == 6.0
