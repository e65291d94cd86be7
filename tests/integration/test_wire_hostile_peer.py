"""What a peer sends is parsed, never unpickled: the checkpoint's collectives, live state transfer, the Session.

A hostile rank sends a pickle that would run ``touch`` through torch's ``broadcast_object_list`` /
``all_gather_object`` (what every one of these places used, and what a peer, or whoever reaches the group's
sockets, can send); the honest rank, in elastrain's collective for that place, refuses it with a
``WireFormatError`` and the command never runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, run

WORKER = str(REPO / "tests" / "workers" / "hostile_peer_worker.py")
PLACES = ("checkpoint broadcast", "checkpoint all_gather", "live state transfer", "session segment")
pytestmark = pytest.mark.slow


def test_a_hostile_peer_cannot_run_code_through_object_collectives(tmp_path: Path) -> None:
    sentinel = tmp_path / "PWNED"
    proc = run(elastrain_cmd("--nproc-per-node=2", WORKER, str(sentinel)), timeout=180)
    out = proc.stdout + proc.stderr
    assert not sentinel.exists(), f"a peer's pickle ran:\n{out}"
    assert proc.returncode == 0, out
    refused = dict(re.findall(r"^REFUSED ([a-z_ ]+): (.*)$", out, re.M))
    assert sorted(refused) == sorted(PLACES), out
    assert all("not a well-formed message" in why for why in refused.values()), refused
    assert "ACCEPTED" not in out
    assert "DONE rank=0" in out and "DONE rank=1" in out
