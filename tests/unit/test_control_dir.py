"""Whether a control directory's owner is proved gone (elastrain.launcher.control_dir): by its PID, its process's
start (in ticks since boot, which no clock step moves) and its PID namespace, never on a guess."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from elastrain.launcher import control_dir

ME = psutil.Process()
NS = os.stat("/proc/self/ns/pid").st_ino
TICKS = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # start, ticks since boot
NO_SUCH_PID = 4_194_304 + 17  # above Linux's largest PID (pid_max is at most 2^22)


@pytest.mark.parametrize(
    ("owner", "gone"),
    [
        ({"pid": ME.pid, "started": ME.create_time(), "pid_namespace": NS}, False),  # alive: this process
        ({"pid": ME.pid, "started": ME.create_time() - 60, "pid_namespace": NS}, True),  # its PID, another process
        ({"pid": ME.pid, "started": ME.create_time() + 0.6, "pid_namespace": NS}, False),  # read after a clock step
        ({"pid": ME.pid, "started": ME.create_time() + 60, "start_ticks": TICKS, "pid_namespace": NS}, False),
        ({"pid": ME.pid, "started": ME.create_time(), "start_ticks": TICKS - 1, "pid_namespace": NS}, True),
        ({"pid": NO_SUCH_PID, "started": 1.0, "pid_namespace": NS}, True),  # no such process
        ({"pid": NO_SUCH_PID, "started": 1.0, "pid_namespace": NS + 1}, False),  # another namespace: not judged
        ({"pid": NO_SUCH_PID, "started": 1.0}, False),  # no namespace recorded
        ({"pid": "x", "started": 1.0, "pid_namespace": NS}, False),  # malformed
        ({}, False),
    ],
)
def test_an_owner_is_gone_only_when_proved(owner: dict[str, object], gone: bool) -> None:
    assert control_dir.gone(owner) is gone


def test_a_sweep_removes_only_directories_of_owners_proved_gone(tmp_path: Path) -> None:
    def made(name: str, owner: object | None) -> Path:
        d = tmp_path / f"{control_dir.PREFIX}{name}"
        d.mkdir()
        if owner is not None:
            (d / control_dir.OWNER).write_text(json.dumps(owner))
        return d

    dead = made("dead", {"pid": NO_SUCH_PID, "started": 1.0, "pid_namespace": NS})
    alive = made("alive", {"pid": ME.pid, "started": ME.create_time(), "pid_namespace": NS})
    unowned = made("unowned", None)  # no owner recorded (an older elastrain, or one being made)
    garbled = made("garbled", None)
    (garbled / control_dir.OWNER).write_text("{not json")
    other = tmp_path / "not-a-control-dir"
    other.mkdir()
    (tmp_path / f"{control_dir.PREFIX}file").write_text("a file, not a directory")
    assert control_dir.sweep(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and unowned.exists() and garbled.exists() and other.exists()


def test_a_new_directory_names_this_process_as_its_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    made = control_dir.make()
    try:
        owner = json.loads((made / control_dir.OWNER).read_text())
        assert made.parent == tmp_path and not control_dir.gone(owner)
        assert owner["pid"] == os.getpid()
    finally:
        control_dir.remove(made, os.getpid())
    assert not made.exists()
