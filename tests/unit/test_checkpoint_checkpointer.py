"""The Checkpointer in one process (no torch.distributed): round trips, fallback, mismatch, requests."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain import env as env_vars
from elastrain.checkpoint import Checkpointer, layout
from elastrain.control import ControlChannel, SaveCause
from elastrain.errors import CheckpointError, CheckpointMismatchError
from elastrain.log import parse_event_line
from elastrain.step_flags import StepFlags


class Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        parsed = parse_event_line(record.getMessage())
        if parsed:
            self.events.append(parsed)

    def named(self, name: str) -> list[dict[str, str]]:
        return [e for e in self.events if e["event"] == name]


@pytest.fixture
def events() -> Iterator[Events]:
    handler = Events()
    logger = logging.getLogger("elastrain")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in env_vars.ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.history = sd["n"], list(sd["history"])


class Job:
    def __init__(self, width: int = 8) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2)
        self.counter = Counter()

    def step(self, i: int) -> None:
        self.model(torch.randn(3, 4)).pow(2).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.counter.n = i
        self.counter.history.append(i)

    def checkpointer(self, root: Path | str, **kw: Any) -> Checkpointer:
        ckpt = Checkpointer(root, **kw)
        ckpt.register(model=self.model, optimizer=self.opt, scheduler=self.sched, counter=self.counter)
        return ckpt

    def snapshot(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "adam": [{k: v.clone() for k, v in self.opt.state[p].items()} for p in self.model.parameters()],
            "sched": self.sched.state_dict(),
            "counter": self.counter.state_dict(),
        }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    for sa, sb in zip(a["adam"], b["adam"], strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["sched"] == b["sched"] and a["counter"] == b["counter"]


def train(job: Job, ckpt: Checkpointer, first: int, last: int) -> dict[int, dict[str, Any]]:
    snaps = {}
    for i in range(first, last + 1):
        job.step(i)
        if ckpt.maybe_save(i):
            snaps[i] = job.snapshot()
    return snaps


def test_no_directory_names_the_flag() -> None:
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        Checkpointer()


def test_directory_comes_from_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_vars.CHECKPOINT_DIR, str(tmp_path / "c"))
    with Checkpointer() as ckpt:
        assert ckpt.root == str(tmp_path / "c")


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_is_bit_exact_and_resumes_the_rng(tmp_path: Path, async_save: bool, events: Events) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_steps=3, async_save=async_save) as ckpt:
        assert ckpt.restore() is None
        snaps = train(job, ckpt, 1, 6)
        after = (torch.rand(1), random.random())
        job.step(7)  # changes parameters and AdamW state while step 6 may still be copied / written
    assert sorted(snaps) == [3, 6]
    committed = events.named("checkpoint_committed")
    assert [e["step"] for e in committed] == ["3", "6"] and "stall_s" in committed[0] and "total_s" in committed[0]

    fresh = Job(width=8)
    with fresh.checkpointer(tmp_path) as ckpt:
        info = ckpt.restore()
    assert info is not None and (info.step, info.world_size) == (6, 1)
    assert_same(snaps[6], fresh.snapshot())
    assert torch.equal(torch.rand(1), after[0]) and random.random() == after[1]
    assert events.named("checkpoint_restored")[-1]["step"] == "6"


def test_corrupt_shard_falls_back_with_a_warning_naming_it(tmp_path: Path, events: Events) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_steps=2) as ckpt:
        snaps = train(job, ckpt, 1, 4)
    shard = next((tmp_path / layout.step_dir_name(4)).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length, one flipped byte
    shard.write_bytes(bytes(data))
    fresh = Job()
    with fresh.checkpointer(tmp_path) as ckpt:
        info = ckpt.restore()
    assert info is not None and info.step == 2
    assert_same(snaps[2], fresh.snapshot())
    fallback = events.named("checkpoint_fallback")
    assert fallback[0]["bad"] == str(tmp_path / layout.step_dir_name(4)) and "CRC-32" in fallback[0]["reason"]


def test_missing_marker_and_vanished_files_fall_back(tmp_path: Path, events: Events) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_steps=1, keep_last=5) as ckpt:
        train(job, ckpt, 1, 3)
    (tmp_path / layout.step_dir_name(3) / layout.MARKER).unlink()
    (tmp_path / layout.step_dir_name(2) / ".metadata").unlink()
    with Job().checkpointer(tmp_path) as ckpt:
        info = ckpt.restore()
    assert info is not None and info.step == 1
    reasons = [e["reason"] for e in events.named("checkpoint_fallback")]
    assert "no commit marker" in reasons[0] and ".metadata is missing" in reasons[1]


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    job = Job(width=8)
    with job.checkpointer(tmp_path, interval_steps=1) as ckpt:
        train(job, ckpt, 1, 1)
    other = Job(width=16)
    before = [p.detach().clone() for p in other.model.parameters()]
    with other.checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError) as err:
        ckpt.restore()
    assert "model/0.weight (saved (8, 4), model has (16, 4))" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.model.parameters(), strict=True))  # nothing loaded


def test_unsaved_registered_object_is_a_clear_error(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_steps=1) as ckpt:
        train(job, ckpt, 1, 1)
    again = Job()
    with again.checkpointer(tmp_path) as ckpt:
        ckpt.register(sampler=Counter())
        with pytest.raises(CheckpointMismatchError, match="no state for sampler"):
            ckpt.restore()


def test_retention_keeps_the_newest_and_never_overwrites(tmp_path: Path, events: Events) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_steps=1, keep_last=2) as ckpt:
        train(job, ckpt, 1, 5)
        ckpt.wait()
        assert [d.step for d in layout.list_step_dirs(str(tmp_path))] == [4, 5]
        marker = (tmp_path / layout.step_dir_name(5) / layout.MARKER).read_bytes()
        assert ckpt.save(5, blocking=True) is False
        assert (tmp_path / layout.step_dir_name(5) / layout.MARKER).read_bytes() == marker
    assert {e["removed"] for e in events.named("checkpoint_purged")} == {
        str(tmp_path / layout.step_dir_name(s)) for s in (1, 2, 3)
    }


def test_save_on_request_at_the_next_step_and_ack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "control"
    monkeypatch.setenv(env_vars.CONTROL_DIR, str(control))
    agent = ControlChannel(control)
    job = Job()
    with job.checkpointer(tmp_path / "c") as ckpt:
        job.step(1)
        assert not ckpt.maybe_save(1)
        request = agent.request_save(SaveCause.LEAVE, "SIGTERM")
        job.step(2)
        assert ckpt.maybe_save(2)
        ack = agent.wait_ack(request.request_id, timeout_s=30)
        job.step(3)
        assert not ckpt.maybe_save(3)  # handled once
    assert ack is not None and ack.step == 2 and ack.checkpoint == str(tmp_path / "c" / layout.step_dir_name(2))


def test_a_deferred_hold_waits_for_the_next_step_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Session defers the hold after a requested save until its next step, so the saved step's metrics point
    # (and its mean loss, a collective) is done before the launcher hears of the save: it acts on the answer
    # (a restart, a node leaving) and may cut the process off.
    control = tmp_path / "control"
    monkeypatch.setenv(env_vars.CONTROL_DIR, str(control))
    agent = ControlChannel(control)
    job = Job()
    caplog.set_level(logging.INFO, logger="elastrain")
    with job.checkpointer(tmp_path / "c", hold_after_request_s=0.2) as ckpt:
        job.step(1)
        request = agent.request_save(SaveCause.SCALE_UP, "waiting")
        assert ckpt.maybe_save(1, hold=False)
        assert "event=checkpoint_hold " not in caplog.text  # saved, not holding yet
        assert agent.wait_ack(request.request_id, timeout_s=0.2) is None  # nor answered
        ckpt.hold_if_requested()
        ack = agent.wait_ack(request.request_id, timeout_s=30)
        assert ack is not None and ack.step == 1
        assert "event=checkpoint_hold " in caplog.text and "event=checkpoint_hold_over " in caplog.text
        caplog.clear()
        ckpt.hold_if_requested()  # once only
        assert "checkpoint_hold" not in caplog.text


def test_a_deferred_answer_is_given_at_close_when_no_step_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop may end at the step that answered a request (its last step): closing answers it.
    control = tmp_path / "control"
    monkeypatch.setenv(env_vars.CONTROL_DIR, str(control))
    agent = ControlChannel(control)
    job = Job()
    with job.checkpointer(tmp_path / "c", hold_after_request_s=0.2) as ckpt:
        job.step(1)
        request = agent.request_save(SaveCause.LEAVE, "leave: SIGTERM")
        assert ckpt.maybe_save(1, hold=False)
        assert agent.wait_ack(request.request_id, timeout_s=0.2) is None
    ack = agent.wait_ack(request.request_id, timeout_s=30)
    assert ack is not None and ack.step == 1


@pytest.mark.parametrize("async_save", [True, False])
def test_an_interval_save_answers_no_request_made_after_its_step_was_agreed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    # A node asked to leave while an interval save is written must not be told that save answers it: training goes
    # on from it without holding, and the agent would stop this node's workers in the middle of the next step. The
    # next step's save answers it (the Session's ranks agree at each step's gradient sync: StepFlags).
    control = tmp_path / "control"
    monkeypatch.setenv(env_vars.CONTROL_DIR, str(control))
    agent = ControlChannel(control)
    job, flags = Job(), StepFlags()

    def agreed_step(i: int) -> None:  # the step's gradient sync raises and agrees the flags (one process here)
        flags.begin_step()
        flags.agree(lambda raised: None, torch.device("cpu"))
        job.step(i)

    with job.checkpointer(tmp_path / "c", interval_steps=2, async_save=async_save, hold_after_request_s=0.1) as ckpt:
        ckpt.agree_through(flags)
        agreed_step(1)
        assert not ckpt.maybe_save(1, hold=False)
        agreed_step(2)
        leave = agent.request_save(SaveCause.LEAVE, "leave: SIGTERM")  # after step 2's agreement
        assert ckpt.maybe_save(2, hold=False) and ckpt.last_request is None
        ckpt.wait()
        assert agent.ack_for(leave) is None and agent.latest_ack().step == 2  # type: ignore[union-attr]
        ckpt.hold_if_requested()  # nothing to hold for
        agreed_step(3)
        assert ckpt.maybe_save(3, hold=False) and ckpt.last_request == leave
        ckpt.hold_if_requested()
        ack = agent.ack_for(leave)
        assert ack is not None and ack.step == 3
        agreed_step(4)
        last = agent.request_save(SaveCause.LEAVE, "leave: SIGTERM")  # during the last step's interval save
        assert ckpt.maybe_save(4, hold=False) and ckpt.last_request is None
        ckpt.wait()
        assert agent.ack_for(last) is None
    ack = agent.ack_for(last)  # training ended at step 4: its save answers the request at close
    assert ack is not None and ack.step == 4


def test_interval_in_seconds(tmp_path: Path) -> None:
    job = Job()
    with job.checkpointer(tmp_path, interval_seconds=0.05) as ckpt:
        job.step(1)
        assert not ckpt.maybe_save(1)
        time.sleep(0.1)
        job.step(2)
        assert ckpt.maybe_save(2)
        assert not ckpt.maybe_save(2)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(CheckpointError, match="interval_steps"):
        Checkpointer(tmp_path, interval_steps=0)


def test_fsspec_url_round_trip() -> None:
    pytest.importorskip("fsspec")
    root = f"memory://elastrain-ckpt-{time.monotonic_ns()}"
    job = Job()
    with job.checkpointer(root, interval_steps=2, keep_last=1) as ckpt:
        snaps = train(job, ckpt, 1, 4)
    assert [d.step for d in layout.list_step_dirs(root)] == [4]
    fresh = Job()
    with fresh.checkpointer(root) as ckpt:
        info = ckpt.restore()
    assert info is not None and info.path == f"{root}/{layout.step_dir_name(4)}"
    assert_same(snaps[4], fresh.snapshot())


@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_a_superseded_generation_never_commits_whatever_on_save_error_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_save_error: str
) -> None:
    from elastrain import fence
    from elastrain.errors import StaleGenerationError

    root = tmp_path / "c"
    assert fence.claim(str(root), fence.Claim(1, "run", 0, "")) is not None
    monkeypatch.setenv(env_vars.GENERATION, "1")
    job = Job()
    with job.checkpointer(root, interval_steps=1, on_save_error=on_save_error) as ckpt:
        job.step(1)
        assert ckpt.save(1, blocking=True)
        marker = layout.read_commit_marker(str(root / layout.step_dir_name(1)))
        assert marker.generation == 1
        assert fence.claim(str(root), fence.Claim(2, "run", 1, ""))  # a newer world took over
        job.step(2)
        with pytest.raises(StaleGenerationError, match="superseded by generation 2"):
            ckpt.save(2, blocking=True)
    assert not (root / layout.step_dir_name(2) / layout.MARKER).exists()


def test_an_unwritable_root_fails_the_save_naming_path_and_cause(tmp_path: Path) -> None:
    from elastrain.errors import CheckpointSaveError

    root = tmp_path / "c"
    job = Job()
    with job.checkpointer(root, interval_steps=1) as ckpt:
        job.step(1)
        assert ckpt.maybe_save(1)
        ckpt.wait()
        root.rename(tmp_path / "moved")
        root.write_text("a file now")  # the checkpoint root is no directory any more
        job.step(2)
        with pytest.raises(CheckpointSaveError, match=rf"step 2 in {root}/step-0000000002 failed: .*NotADirectory"):
            ckpt.maybe_save(2)


@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_a_failed_background_save_surfaces_at_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: Events, on_save_error: str
) -> None:
    from elastrain.checkpoint import dcp_write
    from elastrain.errors import CheckpointSaveError

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    job = Job()
    ckpt = job.checkpointer(tmp_path, interval_steps=1, on_save_error=on_save_error)
    monkeypatch.setattr(dcp_write, "dcp_save", full_disk)  # the writer thread's write fails
    job.step(1)
    assert ckpt.save(1)  # asynchronous: returns before the write
    job.step(2)
    if on_save_error == "raise":
        with pytest.raises(CheckpointSaveError, match=r"step 1 in .*step-0000000001 failed: OSError: .*No space left"):
            ckpt.maybe_save(2)
        ckpt.close()  # nothing left to raise
    else:
        assert ckpt.maybe_save(2)  # step 1's failure is logged, and training goes on trying
        ckpt.close()  # step 2 fails too: logged, not raised
        assert ckpt.last_error is not None and "step 2" in str(ckpt.last_error)
    failed = events.named("checkpoint_save_failed")
    assert len(failed) == (1 if on_save_error == "raise" else 2)
    assert "No space left" in failed[0]["error"] and failed[0]["on_save_error"] == on_save_error


def test_a_file_url_is_the_local_path_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, root = tmp_path / "cwd", tmp_path / "ckpt"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    job = Job()
    with job.checkpointer(f"file://{root}", async_save=False, interval_steps=1) as ckpt:
        train(job, ckpt, 1, 2)
    assert list(cwd.iterdir()) == []  # nothing written relative to the working directory (./file:/...)
    assert [d.step for d in layout.list_step_dirs(f"file://{root}") if d.committed] == [1, 2]
    with job.checkpointer(f"file://localhost{root}") as again:
        info = again.restore()
    assert info is not None and info.step == 2 and info.path == str(root / layout.step_dir_name(2))
