"""A crafted ``.metadata`` in the newest committed step, with a commit marker patched to match, never runs code.

Whoever can write the checkpoint root can also write a matching marker (the CRCs are recomputed, as an
attacker would), so the marker does not help: the loader must refuse the file before it builds anything
from it. The restarted ``elastrain-run`` falls back to the previous step, says loudly which step was
refused and why (``event=checkpoint_tampered``), and finishes; the payload's file never appears.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from support.crafted_pickle import creates_file, spawns
from support.processes import REPO, elastrain_cmd, run

from elastrain.checkpoint import layout
from elastrain.log import parse_event_line

WORKER = str(REPO / "tests" / "workers" / "checkpoint_worker.py")
pytestmark = pytest.mark.slow


def events(text: str, name: str) -> list[dict[str, str]]:
    parsed = (parse_event_line(line) for line in text.splitlines())
    return [e for e in parsed if e is not None and e.get("event") == name]


def restored_step(out: str) -> int | None:
    line = next(line for line in out.splitlines() if line.startswith("RESTORED "))
    info = json.loads(line.split(" ", 1)[1])
    return None if info is None else int(info["step"])


def tamper(step_dir: Path, payload: bytes) -> None:
    """Replace the step's ``.metadata`` with ``payload`` and patch the commit marker to match it."""
    (step_dir / ".metadata").write_bytes(payload)
    marker_path = step_dir / layout.MARKER
    marker = json.loads(marker_path.read_text())
    marker["files"][".metadata"] = {"size": len(payload), "crc32": zlib.crc32(payload)}
    marker_path.write_text(json.dumps(marker))
    layout.verify_step(str(step_dir))  # the marker vouches for the payload: CRCs cannot tell


def test_a_crafted_metadata_never_runs_and_the_run_falls_back_loudly(tmp_path: Path) -> None:
    ckpt, sentinel = tmp_path / "ckpt", tmp_path / "PWNED"
    base = ["--nproc-per-node=2", f"--checkpoint-dir={ckpt}", WORKER, "--interval=2", "--keep-last=3"]
    first = run(elastrain_cmd(*base, "--steps=6"), timeout=140)
    assert first.returncode == 0, first.stdout + first.stderr
    assert [d.step for d in layout.list_step_dirs(str(ckpt)) if d.committed] == [2, 4, 6]

    # io.FileIO creates the file the moment it is resolved and called; Popen would run `touch` after it.
    payload = creates_file(str(sentinel))[:-1] + b"0" + spawns(["touch", str(sentinel)])[2:]
    tamper(ckpt / layout.step_dir_name(6), payload)

    second = run(elastrain_cmd(*base, "--steps=8"), timeout=140)
    out = second.stdout + second.stderr
    assert not sentinel.exists(), f"the crafted .metadata ran code:\n{out}"
    assert second.returncode == 0, out
    assert restored_step(out) == 4, out
    tampered = events(out, "checkpoint_tampered")
    assert tampered, out
    assert {e["step"] for e in tampered} == {"6"}
    assert all(e["bad"] == str(ckpt / layout.step_dir_name(6)) for e in tampered)
    assert all("io.FileIO" in e["reason"] and "never holds" in e["reason"] for e in tampered), tampered
    assert not [e for e in events(out, "checkpoint_fallback") if e["bad"].endswith(layout.step_dir_name(6))]
    assert "DONE 8" in out
    assert not sentinel.exists()
