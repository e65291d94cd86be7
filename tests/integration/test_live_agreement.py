"""Agreed state and given-up collectives with real gloo groups (elastrain.live), several processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.processes import PYTHON, free_port, printed_fields, reaped, run_ranks, worker_env

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "live_agreement_worker.py")


def _lines(outs: list[str], prefix: str) -> list[dict[str, str]]:
    return [printed_fields(line) for out in outs for line in out.splitlines() if line.startswith(prefix + " ")]


def test_a_rank_ahead_rolls_back_and_a_rank_without_state_receives_it() -> None:
    outs = run_ranks(WORKER, "agree", 3, str(free_port()))
    at_k = {x["rank"]: x["hash"] for x in _lines(outs, "AT_K")}
    agreed = _lines(outs, "AGREED")
    assert len(agreed) == 3, outs
    # Step 5 (rank 0 applied 6; rank 2 had nothing), sent by rank 1, the lowest rank at step 5.
    assert {(a["step"], a["source"]) for a in agreed} == {("5", "1")}, agreed
    # Bit-identical everywhere, and equal to the state every rank had at step 5.
    assert {a["hash"] for a in agreed} == {at_k["1"]} == set(at_k.values()), (agreed, at_k)
    assert len({x["hash"] for x in _lines(outs, "NEXT")}) == 1, outs


def test_a_collective_a_departed_peer_never_joins_is_given_up_and_the_process_exits_cleanly() -> None:
    outs = run_ranks(WORKER, "abort", 2, str(free_port()), str(free_port()))
    given_up = _lines(outs, "ABORT")
    assert [g["result"] for g in given_up] == ["given_up"], outs
    assert {r["sum"] for r in _lines(outs, "ROUND1")} == {"3"}, outs  # the next round's group works
    assert len(_lines(outs, "EXIT")) == 2, outs  # and both exit 0 (checked in _run_ranks)


def test_a_worker_whose_given_up_collective_never_ends_still_exits_at_once_with_its_own_code(tmp_path: Path) -> None:
    """The worker's close waits a few seconds for the given-up collective, not its group's 10-minute timeout (a CI run
    saw a survivor's worker wait there at its exit after a neighbour's SIGKILL, and its node with it); its group,
    kept, never joins the thread that runs that collective as the process ends (a plain gloo group destroyed so
    hangs in ``~ProcessGroupGloo``; this worker's is not destructed at finalisation either way)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [PYTHON, WORKER, "stuck", str(rank), "2", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=worker_env({"STUCK_PID_FILE": str(tmp_path / "rank0.pid")}),
            start_new_session=True,
        )
        for rank in range(2)
    ]
    with reaped(*procs):
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    detail = "\n".join(outs)
    assert [p.returncode for p in procs] == [3, 0], detail
    assert "ABORT rank=0 result=given_up" in outs[0], detail
    assert "event=group_drain_timeout pending=1" in outs[0], detail  # the collective was still pending
    assert _lines(outs, "EXIT") and "PEER_GONE rank=1" in outs[1], detail
