"""A Trainer that stops early (transformers' ``EarlyStoppingCallback``) stops at the same step on every member when a
node joins after some evaluations: the joiner receives the callbacks' exported state (the patience counter) with the
Trainer's progress. Before, the joiner started at a patience of 0, so the members disagreed on when to stop: the
others stopped at step 20 while the joiner trained on alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import REPO, LiveNode, free_port, reaped, wait_for, worker_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
WORKER = str(REPO / "tests" / "workers" / "hf_early_stopping.py")
BOUND = 180.0  # only stops hangs


def test_a_joiner_stops_early_at_the_same_step_as_the_members_it_joins(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    env = worker_env({"ES_OUTPUT_DIR": str(tmp_path / "out"), "ES_STEP_SLEEP": "0.1", "ES_HOLD": str(hold)})
    port = free_port()

    def node(name: str) -> LiveNode:
        return LiveNode(
            name, tmp_path, port, WORKER, env, rdzv_id="early-stop", nnodes="1:2", last_call_s=1,
            collective_timeout=60, extra=("--checkpoint-dir", str(tmp_path / "ckpt")),
        )  # fmt: skip

    def evals(n: LiveNode) -> dict[int, dict[str, str]]:
        return {int(e["step"]): e for e in n.lines("ES_EVAL")}

    a = node("a")
    with reaped(a.proc):
        wait_for(lambda: 10 in evals(a) or a.proc.poll() is not None, BOUND, what="a's second evaluation")
        hold.touch()  # a waits 5 s a step until b trains with it (b must join before the stop at step 20)
        b = node("b")
        with reaped(b.proc):
            wait_for(lambda: bool(b.lines("ES_STEP")) or b.proc.poll() is not None, BOUND, what="b to train")
            hold.unlink()
            wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, BOUND, what="the job to end")
    detail = a.dump() + b.dump()
    assert a.proc.returncode == 0 and b.proc.returncode == 0, detail
    for n in (a, b):
        assert [x["step"] for x in n.lines("ES_DONE")] == ["20"], detail
    assert {s: e["patience"] for s, e in evals(a).items()} == {5: "0", 10: "1", 15: "2", 20: "3"}, detail
    joined = evals(b)
    assert joined and all(joined[s]["patience"] == evals(a)[s]["patience"] for s in joined), detail
    assert all(e["world"] == "2" for e in joined.values()), detail
