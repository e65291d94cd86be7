"""The workers' own fence (no --checkpoint-dir at the launcher): a world claims its root before it restores or
saves, a newer world's claim supersedes it at its next save, and a superseded world exits with EX_CONFIG."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elastrain import env as env_vars
from elastrain import fence
from elastrain.checkpoint import Checkpointer, layout
from elastrain.checkpoint.commit import Commit
from elastrain.checkpoint.group import Group
from elastrain.env import WorkerEnv
from elastrain.errors import EX_CONFIG, CheckpointSaveError, StaleGenerationError, WorldSupersededExit
from elastrain.log import lifecycle, parse_event_line
from elastrain.storage import LocalStorage

ELASTRAIN = {env_vars.AGENT_PID: "1", env_vars.RUN_ID: "job", env_vars.ROUND: "4"}


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test is its own set of worlds: no generation remembered from another test, no launcher variables."""
    for name in (*env_vars.ALL_VARIABLES, env_vars.GENERATION, "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(fence, "_HELD", {})
    yield


@pytest.fixture
def events() -> Iterator[list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            parsed = parse_event_line(record.getMessage())
            if parsed:
                seen.append(parsed)

    handler, logger = Handler(), logging.getLogger("elastrain")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.mark.parametrize(
    ("environ", "root", "claims"),
    [
        ({}, "/ckpt", False),  # no elastrain-run: plain torchrun, a notebook, an evaluation script
        (ELASTRAIN, "/ckpt", True),  # elastrain-run without --checkpoint-dir
        ({**ELASTRAIN, env_vars.CHECKPOINT_DIR: "/ckpt", env_vars.GENERATION: "3"}, "/ckpt", False),  # the launcher's
        ({**ELASTRAIN, env_vars.CHECKPOINT_DIR: "/ckpt", env_vars.GENERATION: "3"}, "/ckpt/", False),
        ({**ELASTRAIN, env_vars.CHECKPOINT_DIR: "/ckpt", env_vars.GENERATION: "3"}, "/elsewhere", True),
        ({**ELASTRAIN, env_vars.CHECKPOINT_DIR: "file:///ckpt", env_vars.GENERATION: "3"}, "/ckpt", False),
    ],
)
def test_who_fences_the_root(environ: dict[str, str], root: str, claims: bool) -> None:
    world = fence.worker_world(WorkerEnv.from_environ(environ), root)
    assert (world is not None) is claims
    if world is not None:
        assert world == fence.World("job", 4)


def proto(root: Path) -> Commit:
    return Commit(str(root), LocalStorage(), Group(), kind="test", claim_as=fence.World("job", 0), log=lifecycle)


def test_a_world_claims_before_it_restores_and_a_newer_world_supersedes_it(
    tmp_path: Path, events: list[dict[str, str]]
) -> None:
    old = proto(tmp_path)
    assert old.restore(lambda d, m: m.step) is None  # nothing to restore, but the root is claimed first
    assert old.generation == 0 and fence.generations(str(tmp_path)) == [0]
    path = old.prepare(1)
    assert path is not None
    old.commit(1, path, {})

    fence._HELD.clear()  # the newer world's workers are other processes: they know no parent
    new = proto(tmp_path)
    assert new.restore(lambda d, m: m.step) == 1 and new.generation == 1

    with pytest.raises(WorldSupersededExit) as err:
        old.prepare(2)
    assert err.value.code == EX_CONFIG
    assert "superseded by generation 1 (run 'job', round 0" in str(err.value)
    assert not (tmp_path / layout.step_dir_name(2)).exists()  # a stale world writes nothing
    superseded = [e for e in events if e["event"] == "world_superseded"]
    assert len(superseded) == 1 and "EX_CONFIG" in superseded[0]["action"]
    assert new.prepare(2) is not None  # the newer world goes on


def test_a_world_that_goes_on_in_place_claims_after_its_own_and_loses_to_another_world(tmp_path: Path) -> None:
    first = proto(tmp_path)
    first.claim()
    assert first.generation == 0
    again = proto(tmp_path)  # the same processes, regrouped in place (--live): they descend from generation 0
    again.claim()
    assert again.generation == 1
    fence._HELD.clear()
    proto(tmp_path).claim()  # another world of fresh workers takes generation 2
    fence._HELD[str(tmp_path)] = 1
    with pytest.raises(WorldSupersededExit, match="superseded by generation 2"):
        proto(tmp_path).claim()  # a regroup of the first lineage finds generation 2 taken: it must not go on


def test_a_process_that_dropped_its_state_claims_afresh_instead_of_losing_to_the_world_that_trained_on(
    tmp_path: Path,
) -> None:
    first = proto(tmp_path)
    first.claim()  # this node's world, generation 0
    fence._HELD.clear()
    proto(tmp_path).claim()  # the job trained on without it: another world took generation 1
    fence._HELD[str(tmp_path)] = 0
    fence.disown_claims()  # left behind: its state dropped (it restores the newest checkpoint)
    back = proto(tmp_path)
    back.claim()
    assert back.generation == 2  # a world of its own, after the one that trained on: not a stale descendant


def test_a_root_where_no_claim_can_be_written_fails_naming_it(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("not a directory")
    with pytest.raises(CheckpointSaveError, match=r"cannot claim this world's fencing generation in .*root"):
        proto(tmp_path / "root").claim()


def test_the_launchers_fence_still_raises_a_stale_generation_error(tmp_path: Path) -> None:
    fence.claim_fresh(str(tmp_path), "job", 0, "s", ())
    fence.claim_fresh(str(tmp_path), "job", 1, "s", ())
    c = Commit(str(tmp_path), LocalStorage(), Group(), kind="test", generation=0)
    with pytest.raises(StaleGenerationError):
        c.prepare(1)


def test_a_checkpointer_under_elastrain_run_without_checkpoint_dir_fences_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ELASTRAIN.items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(2, 1)
    old = Checkpointer(tmp_path, async_save=True, interval_steps=1)
    old.register(model=model)
    assert old.restore() is None
    assert old.save(1, blocking=True)

    fence._HELD.clear()
    new = Checkpointer(tmp_path, async_save=False)
    new.register(model=torch.nn.Linear(2, 1))
    info = new.restore()
    assert info is not None and info.step == 1
    with pytest.raises(WorldSupersededExit):
        old.save(2)  # the fence is checked before anything is written
    assert [d.step for d in layout.list_step_dirs(str(tmp_path)) if d.committed] == [1]
    assert new.save(2, blocking=True)
    new.close()
