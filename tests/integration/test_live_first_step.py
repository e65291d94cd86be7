"""A new world's first step waits for its slowest member longer than --collective-timeout: a joiner whose model is
``torch.compile``d compiles it in its first forward pass (tens of seconds, minutes for a large model), while the
members already training wait for it in that step's gradient all-reduce. Before, they gave the step up after
--collective-timeout, found every peer alive, waited for a regroup notice that never came and failed: the node that
had trained the job left it. From the world's second step on, --collective-timeout holds again.

The joiner sits the world's first step out while the state streams to it (a catch-up): its first forward pass is
in the world's second step, so the longer wait lasts until a step every member trained has ended. Both nodes' models
are compiled (``Module.compile``; the compile's time is a sleep in the joiner's first forward pass): an eager model's
first step waits --collective-timeout, as any other (tests/unit/test_live_first_step_bound.py), unless
--first-step-timeout says otherwise: the same join with eager models whose joiner's first forward pass is as slow
(a script that compiles what elastrain does not see: a function) passes with that flag.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from support.processes import LiveNode, free_port, reaped, wait_for

from elastrain.live.group import FIRST_STEP_TIMEOUT_S

SCRIPT = str(Path(__file__).resolve().parents[1] / "workers" / "live_worker.py")
BOUND = 120.0  # only stops hangs
TIMEOUT_S = 3.0  # --collective-timeout
COMPILE_S = 12.0  # the joiner's first forward pass: four times --collective-timeout


FLAG_S = 90.0  # --first-step-timeout, in the eager case


@pytest.mark.parametrize("bound_by", ["compiled-model", "first-step-timeout"])
def test_the_running_member_waits_for_a_joiner_whose_first_forward_outlasts_the_collective_timeout(
    tmp_path: Path, bound_by: str
) -> None:
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_AT_WS": "2", "LW_EXTRA_STEPS": "12"}
    compiles = bound_by == "compiled-model"
    if compiles:
        env["LW_COMPILE"] = "1"
    extra = () if compiles else ("--first-step-timeout", f"{FLAG_S:g}")
    port = free_port()

    def node(name: str, **more: str) -> LiveNode:
        return LiveNode(
            name, tmp_path, port, SCRIPT, {**env, **more}, rdzv_id="first-step", nnodes="1:2", last_call_s=1,
            collective_timeout=TIMEOUT_S, extra=extra,
        )  # fmt: skip

    a = node("a")
    with reaped(a.proc):
        wait_for(lambda: len(a.lines("LW_STEP")) >= 3 or a.proc.poll() is not None, BOUND, what="a training")
        b = node("b", LW_FIRST_FORWARD_S=f"{COMPILE_S:g}")
        with reaped(b.proc):
            try:
                wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, BOUND, what="the job's end")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{a.dump()}\n{b.dump()}") from None
    nodes = [a, b]
    detail = "\n".join(n.dump() for n in nodes)
    for n in nodes:
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1, "a worker was restarted\n" + detail
        for failed in ("workers_restarting", "collectives_given_up", "regroup_notice_missing", "node_failed"):
            assert not n.events(failed), f"{n.name}: {failed}\n{detail}"
    assert b.lines("LW_COMPILING") and a.events("workers_regrouped"), detail
    # a waited in the step b compiled in, longer than --collective-timeout, and trained on in the same world.
    times = [float(s["t"]) for s in a.lines("LW_STEP")]
    longest = max(later - earlier for earlier, later in itertools.pairwise(times))
    assert longest > TIMEOUT_S + 2, f"a's longest step gap {longest:.2f} s\n{detail}"
    # Each world's collectives wait --collective-timeout from the end of a step every member trained: b's after its
    # first forward pass, not after the step it sat out.
    for n in nodes:
        settled = n.events("group_settled")
        assert settled and {float(e["collective_timeout_s"]) for e in settled} == {TIMEOUT_S}, detail
    lines = b.text().splitlines()
    compiled = next(i for i, line in enumerate(lines) if line.startswith("LW_COMPILING"))
    assert all(i > compiled for i, line in enumerate(lines) if "group_settled" in line), detail
    assert len(a.events("group_settled")) == 2, detail  # alone, then with b
    joined = [e.get("first_step_timeout_s") for n in nodes for e in n.events("group_joined")]
    want = FIRST_STEP_TIMEOUT_S if compiles else FLAG_S
    assert joined and all(s == f"{want:.3f}" for s in joined), joined
    done = [line for n in nodes for line in n.lines("LW_DONE")]
    assert len(done) == 2 and len({d["hash"] for d in done}) == 1 and len({d["step"] for d in done}) == 1, detail


def test_a_node_that_joins_while_a_member_compiles_leaves_that_member_to_finish_without_a_restart(
    tmp_path: Path,
) -> None:
    """Nodes come back in bursts: c joins while b, which joined just before, compiles in its first forward pass. The
    agents ask their workers to regroup, and a worker answers at a step boundary, so b answers once its compile is
    over, far past the agent's usual wait for an answer (--collective-timeout + 10 s). Before, b's agent gave up on it
    and restarted it (``regroup_fallback``): a cold start, a compile again, the world waiting for both. Now a worker
    in a compiled model's first step in its world says so, and its agent waits for it as long as that step may take
    (``regroup_ack_extended``)."""
    compile_s = 30.0  # b's first forward pass: longer than the agents' usual wait (2 + 10 s)
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_AT_WS": "3", "LW_EXTRA_STEPS": "12"}
    env["LW_COMPILE"] = "1"
    port = free_port()

    def node(name: str, **more: str) -> LiveNode:
        return LiveNode(
            name, tmp_path, port, SCRIPT, {**env, **more}, rdzv_id="first-step-burst", nnodes="1:3", last_call_s=1,
            collective_timeout=2.0,
        )  # fmt: skip

    a = node("a")
    with reaped(a.proc):
        wait_for(lambda: len(a.lines("LW_STEP")) >= 3 or a.proc.poll() is not None, BOUND, what="a training")
        b = node("b", LW_FIRST_FORWARD_S=f"{compile_s:g}")
        with reaped(b.proc):
            wait_for(lambda: b.lines("LW_COMPILING") or b.proc.poll() is not None, BOUND, what="b compiling")
            c = node("c")
            with reaped(c.proc):
                nodes = [a, b, c]
                try:
                    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 2 * BOUND, what="the job's end")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\n" + "\n".join(n.dump() for n in nodes)) from None
    detail = "\n".join(n.dump() for n in nodes)
    for n in nodes:
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1, "a worker was restarted\n" + detail
        for failed in ("workers_restarting", "regroup_fallback", "regroup_notice_missing", "node_failed"):
            assert not n.events(failed), f"{n.name}: {failed}\n{detail}"
    # c's round was announced while b compiled: b's agent waited past its usual bound for b's answer.
    assert b.events("regroup_ack_extended"), detail
    done = [line for n in nodes for line in n.lines("LW_DONE")]
    assert len(done) == 3 and len({d["hash"] for d in done}) == 1 and len({d["step"] for d in done}) == 1, detail
