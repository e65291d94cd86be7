"""Live reconfiguration through the real elastrain-run (issue 14): nodes on 127.0.0.1, real SIGKILLs.

Each "node" is an elastrain-run agent with --live true and one gloo worker running live_worker.py (a
Session job that prints its pid and a hash of model + optimizer state at every step and after every
regroup). The checks are on behaviour: no worker process of a surviving node is restarted, every
member holds bit-identical state after the regroup, equal to an uninterrupted run's state at the agreed
step, and the job ends with every sample of every step learnt from once.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.processes import LiveNode, elastrain_cmd, free_port, kill_tree, reaped, spawn, wait_for, wait_logged

from elastrain.checkpoint.layout import list_step_dirs

SCRIPT = str(Path(__file__).resolve().parents[1] / "workers" / "live_worker.py")
BOUND = 90.0  # generous: only stops hangs (3 cold starts of torch on a loaded 2-core machine)
GLOBAL_BATCH = 24


class Node(LiveNode):
    def __init__(
        self,
        name: str,
        tmp: Path,
        port: int,
        nnodes: str,
        env: dict[str, str],
        collective_timeout: float = 20,
        extra: tuple[str, ...] = (),
        last_call_s: float = 1,
    ) -> None:
        super().__init__(
            name,
            tmp,
            port,
            SCRIPT,
            env,
            rdzv_id="live-test",
            nnodes=nnodes,
            last_call_s=last_call_s,
            collective_timeout=collective_timeout,
            extra=extra,
        )


def _run(tmp: Path, names: list[str], env: dict[str, str], nnodes: str) -> list[Node]:
    """Start the nodes (the first hosts the c10d store) and wait for every agent to end.

    The first round waits for all of them (a long last call: a node slow to start under load must not
    find a job that already trained without it; later rounds never wait for the last call)."""
    port = free_port()
    nodes: list[Node] = []
    try:
        for name in names:
            nodes.append(Node(name, tmp, port, nnodes, env, last_call_s=BOUND))
            time.sleep(0.3)
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            if all(n.proc.poll() is not None for n in nodes):
                return nodes
            time.sleep(0.1)
        raise AssertionError("the job did not end in time\n" + "\n".join(n.dump() for n in nodes))
    finally:
        with reaped(*(n.proc for n in nodes)):
            pass


def _hashes(nodes: list[Node]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for n in nodes:
        for s in n.lines("LW_STEP"):
            out.setdefault(int(s["step"]), set()).add(s["hash"])
    return out


def _train_at_two_then_stop(nodes: list[Node], tmp_path: Path, what: str) -> None:
    """Wait until ``nodes`` made 6 steps at world size 2, then ask them to stop 30 steps later and wait."""

    def at_two() -> list[int]:
        return [int(s["step"]) for n in nodes for s in n.lines("LW_STEP") if s["ws"] == "2"]

    wait_for(lambda: len(at_two()) >= 6, BOUND, what=what)
    tmp = tmp_path / "stop.tmp"
    tmp.write_text(str(max(at_two()) + 30))
    tmp.replace(tmp_path / "stop")
    for n in nodes:
        n.proc.wait(timeout=BOUND)


def test_sigkill_inside_backward_regroups_in_place_with_the_uninterrupted_state(tmp_path: Path) -> None:
    seed = random.Random().randrange(1000)
    rng = random.Random(seed)
    die_at, die_layer = rng.randint(4, 20), rng.choice([0, 2, 3, -1])
    max_steps = die_at + 12
    base = {"LW_MAX_STEPS": str(max_steps), "LW_SLEEP": "0.02"}

    # The uninterrupted run: the same 3-node job, nobody dies.
    (tmp_path / "ref").mkdir()
    ref = _run(tmp_path / "ref", ["r0", "r1", "r2"], base, "3:3")
    for n in ref:
        assert n.proc.returncode == 0, n.dump()
    reference = _hashes(ref)
    assert all(len(h) == 1 for h in reference.values()), reference  # DDP ranks agree at every step

    # node c's worker SIGKILLs its agent and itself inside step die_at's backward, between bucket all-reduces.
    (tmp_path / "kill").mkdir()
    env = {**base, "LW_DIE_AT_STEP": str(die_at), "LW_DIE_NODE": "2", "LW_DIE_LAYER": str(die_layer)}
    nodes = _run(tmp_path / "kill", ["a", "b", "c"], env, "2:3")
    victims = [n for n in nodes if n.lines("LW_START") and n.lines("LW_START")[0]["rank"] == "2"]
    assert len(victims) == 1, "\n".join(n.dump() for n in nodes)
    survivors = [n for n in nodes if n is not victims[0]]
    detail = f"seed={seed} die_at={die_at} die_layer={die_layer}\n" + "\n".join(n.dump() for n in nodes)
    for n in survivors:
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1, "a survivor's worker was restarted\n" + detail
        assert n.events("workers_regrouped") and not n.events("workers_restarting"), detail
        assert not n.events("regroup_fallback"), detail
    agreed = [line for n in survivors for line in n.lines("LW_AGREED")]
    assert len(agreed) == 2, detail
    # One agreed state, bit-identical on every survivor: the last step every member completed ...
    # (a death inside the backward pass stops every survivor before step die_at; one after it, with every
    # all-reduce done, lets them complete it and break at the next step's)
    expected = die_at - 1 if die_layer >= 0 else die_at
    assert {a["hash"] for a in agreed} == {agreed[0]["hash"]} and {a["step"] for a in agreed} == {str(expected)}
    # ... and equal to the uninterrupted run's state at that step.
    assert reference[expected] == {agreed[0]["hash"]}, detail
    # Only the step in flight was lost: the survivors went on at world size 2 and finished every step once.
    done = [line for n in survivors for line in n.lines("LW_DONE")]
    assert len(done) == 2 and {d["hash"] for d in done} == {done[0]["hash"]}, detail
    assert {d["step"] for d in done} == {str(max_steps)} and {d["samples"] for d in done} == {
        str(max_steps * GLOBAL_BATCH)
    }, detail
    steps = sorted(int(s["step"]) for n in survivors for s in n.lines("LW_STEP") if s["rank"] == "0")
    assert steps == list(range(1, max_steps + 1)), detail  # no step computed twice on rank 0, none skipped
    # Every step, before and after the regroup, took the next GLOBAL_BATCH samples of the stream (one epoch here).
    for n in nodes:
        for s in n.lines("LW_STEP"):
            assert int(s["cursor"]) == GLOBAL_BATCH * int(s["step"]), (s, detail)


@pytest.mark.parametrize(
    "saving",
    [None, "launcher", "workers", "phases", "phases-saving"],
    ids=["no-checkpoints", "a-save-every-step", "workers-fence", "state-in-phases", "state-in-phases-and-a-save"],
)
def test_a_joining_node_gets_the_state_by_broadcast_and_nobody_restarts(tmp_path: Path, saving: str | None) -> None:
    """``saving``: an asynchronous save at every step, so that one is in flight when the joiner's round claims the
    next fencing generation (its commit is then refused: given up by the old world, never a worker's death).
    ``workers``: the same into the Session's own checkpoint_dir, without --checkpoint-dir: the workers fence it,
    and the regrouped world claims the generation after its own (the joiner knows none). ``phases``: the state
    arrives over three steps (``catch_up_phase_bytes``), which the joiner sits out; ``phases-saving``: and a save
    every second step, which needs the whole state at once (every phase left is sent for it)."""
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_AT_WS": "3", "LW_EXTRA_STEPS": "15"}
    env["LW_LR_DECAY_SAMPLES"] = "500"  # the session sets the LR of every step: the joiner's first one too
    extra: tuple[str, ...] = ()
    if saving in ("phases", "phases-saving"):
        env["LW_PHASE_BYTES"] = "4096"
    if saving in ("launcher", "workers"):
        env["LW_SAVE_EVERY"] = "1"
    if saving == "phases-saving":
        env["LW_SAVE_EVERY"] = "2"
    if saving in ("launcher", "phases-saving"):
        extra = ("--checkpoint-dir", str(tmp_path / "ckpt"))
    if saving == "workers":
        env["LW_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")
    port = free_port()
    a = Node("a", tmp_path, port, "2:3", env, extra=extra)
    time.sleep(0.5)
    b = Node("b", tmp_path, port, "2:3", env, extra=extra)
    nodes = [a, b]
    with reaped(a.proc, b.proc):
        try:
            # c arrives once a and b train (their workers said they can regroup: no restart for c).
            wait_for(lambda: all(len(n.lines("LW_STEP")) >= 3 for n in (a, b)), BOUND, what="two nodes training")
            c = Node("c", tmp_path, port, "2:3", env, extra=extra)
            nodes.append(c)
            with reaped(c.proc):
                for n in nodes:
                    n.proc.wait(timeout=BOUND)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(n.dump() for n in nodes)) from None
    detail = "\n".join(n.dump() for n in nodes)
    for n in nodes:
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1, "a worker was restarted\n" + detail
        assert not n.events("workers_restarting"), detail
    for n in (a, b):
        assert n.events("workers_regrouped"), detail
    # Nobody left: a and b finish the step in flight and move at the same step, which they agreed on in that
    # step's gradient all-reduce; no collective is given up, no step abandoned.
    moves = [e for n in (a, b) for e in n.events("regroup_started")]
    assert len(moves) == 2 and {e["cause"] for e in moves} == {"notice"}, detail
    assert len({e["step"] for e in moves}) == 1, detail
    assert not any(n.events("collectives_given_up") for n in nodes), detail
    # Warm join: c's worker was built (imports, model, data) and waiting before c asked for a round.
    warm, joined = c.events("workers_warm"), c.events("rendezvous_joined")
    assert warm and joined and float(warm[0]["t"]) <= float(joined[0]["t"]), detail
    # ... and its memory made ready (the receive pool touched, the heap grown) before it said it was warm.
    ready, said = c.events("worker_memory_ready"), c.events("worker_warm")
    assert ready and said and float(ready[0]["t"]) <= float(said[0]["t"]), detail
    assert c.events("heap_grown"), detail
    assert c.events("worker_warm_joined"), detail
    regrouped = [e for n in (a, b) for e in n.events("regrouped")]
    assert regrouped and regrouped[0]["receivers"] == "1", detail  # c received model + optimizer + train state
    agreed = [line for n in (a, b) for line in n.lines("LW_AGREED")]
    assert len({x["hash"] for x in agreed}) == 1, detail
    done = [line for n in nodes for line in n.lines("LW_DONE")]
    assert len(done) == 3 and len({d["hash"] for d in done}) == 1 and len({d["step"] for d in done}) == 1, detail
    caught_up = [e for n in nodes for e in n.events("caught_up")]
    assert len(caught_up) == 1, detail
    if saving == "phases":  # every phase after the first started at a step boundary of the catch-up
        assert caught_up[0]["steps"] == "3", detail
        assert len(c.events("state_phase_started")) == 2, detail
        # The joiner's state is whole once the third phase has landed, in the third step it sat out.
        whole = [s["whole"] for s in c.lines("LW_STEP")]
        assert whole[:3] == ["0", "0", "1"] and set(whole[3:]) == {"1"}, detail
    if saving == "phases-saving":  # a save in the catch-up sent what was left of the state at once
        assert caught_up[0]["steps"] == "3" and len(c.events("state_phase_started")) <= 2, detail
        committed = [int(e["step"]) for n in (a, b) for e in n.events("checkpoint_committed")]
        after = int(caught_up[0]["step"]) - 3
        assert any(after < step < after + 3 for step in committed), detail
    if saving == "workers":
        claimed = sorted(int(e["generation"]) for n in nodes for e in n.events("generation_claimed"))
        assert claimed == [0, 1], detail  # the first world's, then the regrouped world's: the one after it
        assert not any(n.events("world_superseded") for n in nodes), detail


def test_a_round_whose_new_member_dies_before_joining_it_is_left_for_the_next_at_once(tmp_path: Path) -> None:
    """a and b train; c's warm worker is given a round with them and SIGKILLs its node as it starts to join that
    round's process group. a and b, waiting in that join for c, leave it as soon as their agents announce the round
    after it (without c), and train on in place: no worker restarted. Before, they waited in the join for c until
    their agents gave up on them (40 s, ``regroup_fallback``) and restarted them from a checkpoint (the T5 soak of
    seed 8823 stalled 41 s so)."""
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05", "LW_STOP_FILE": str(tmp_path / "stop")}
    port = free_port()
    a = Node("a", tmp_path, port, "2:3", env)
    time.sleep(0.5)
    b = Node("b", tmp_path, port, "2:3", env)
    nodes = [a, b]
    with reaped(a.proc, b.proc):
        wait_for(lambda: all(len(n.lines("LW_STEP")) >= 3 for n in nodes), BOUND, what="two nodes training")
        c = Node("c", tmp_path, port, "2:3", {**env, "LW_DIE_JOINING": "1"})
        with reaped(c.proc):
            wait_for(lambda: c.proc.poll() is not None, BOUND, what="c to die as it joins\n" + c.dump())
            died = time.time()

            def trains_again() -> bool:
                return all(any(float(s["t"]) > died for s in n.lines("LW_STEP")) for n in nodes)

            wait_for(trains_again, 30, what="a and b to train again\n" + "\n".join(n.dump() for n in (*nodes, c)))
            _train_at_two_then_stop(nodes, tmp_path, "a and b training at two")
    detail = "\n".join(n.dump() for n in (*nodes, c))
    assert c.proc.returncode == -signal.SIGKILL, detail  # (its worker's last lines went with its agent)
    for n in nodes:
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1, "a worker was restarted\n" + detail
        assert not n.events("regroup_fallback") and not n.events("workers_restarting"), detail
    # They left c's round's join: given up as the next round came (and a member whose round's store left with the
    # rank 0 that gave up first sees that store close).
    left = [e["error"] for n in nodes for e in n.events("regroup_failed")]
    assert any("JoinAbandonedError" in e for e in left), detail


def test_a_frozen_node_is_evicted_and_the_survivors_get_out_of_their_collective_at_once(tmp_path: Path) -> None:
    """SIGSTOP: the peer's sockets stay open, so only the agent's regroup notice ends the survivors' all-reduce."""
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.02", "LW_STOP_AT_WS": "0", "LW_EXTRA_STEPS": "0"}
    port = free_port()
    nodes = []
    for name in "abc":  # a starts first and hosts the c10d store; c (frozen below) hosts nothing
        nodes.append(
            Node(name, tmp_path, port, "2:3", {**env, "LW_STOP_FILE": str(tmp_path / "stop")}, last_call_s=BOUND)
        )
        time.sleep(0.5)
    a, b, c = nodes
    with reaped(*(n.proc for n in nodes)):
        try:
            wait_for(lambda: len(c.lines("LW_STEP")) >= 5, BOUND, what="three nodes training")
            victims = [c.proc.pid, int(c.lines("LW_START")[0]["pid"])]
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: all(n.lines("LW_AGREED") for n in (a, b)), BOUND, what="the survivors to regroup")
            kill_tree(c.proc.pid)
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL without being continued
            _train_at_two_then_stop([a, b], tmp_path, "the survivors to train at world size 2")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(n.dump() for n in nodes)) from None
    detail = "\n".join(n.dump() for n in nodes)
    for n in (a, b):
        assert n.proc.returncode == 0, detail
        assert len(n.lines("LW_START")) == 1 and n.events("workers_regrouped"), detail
        assert not n.events("regroup_fallback") and not n.events("workers_restarting"), detail
    agreed = [line for n in (a, b) for line in n.lines("LW_AGREED")]
    assert len({x["hash"] for x in agreed}) == 1 and {x["ws"] for x in agreed} == {"2"}, detail
    done = [line for n in (a, b) for line in n.lines("LW_DONE")]
    assert len(done) == 2 and len({d["hash"] for d in done}) == 1, detail


def test_a_node_frozen_while_the_job_trained_on_whose_store_then_died_carries_on_from_the_newest_checkpoint(
    tmp_path: Path,
) -> None:
    """b is frozen whole (agent and worker); a (the store host) evicts it, trains on alone and commits, then is
    SIGKILLed whole. b thaws into a dead store: it fails over, forms a round alone, and never saw a's rounds. Its
    state in memory is a superseded world's: it must drop it, restore a's newest checkpoint and claim the root
    afresh (the workers fence it: no --checkpoint-dir), not keep it and lose the root's claim to a dead world."""
    env = {
        "LW_MAX_STEPS": "100000",
        "LW_SLEEP": "0.05",
        "LW_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "LW_SAVE_EVERY": "3",
        "LW_STOP_FILE": str(tmp_path / "stop"),
    }
    port = free_port()
    a = Node("a", tmp_path, port, "1:2", env, last_call_s=BOUND)  # hosts the c10d store
    time.sleep(0.3)
    b = Node("b", tmp_path, port, "1:2", env, last_call_s=BOUND)

    def steps(n: Node, ws: str) -> list[dict[str, str]]:
        return [s for s in n.lines("LW_STEP") if s["ws"] == ws]

    with reaped(a.proc, b.proc):
        try:
            wait_for(lambda: len(steps(b, "2")) >= 3, BOUND, what="two nodes training")
            frozen = kill_tree(b.proc.pid, signal.SIGSTOP)
            frozen_at = int(b.lines("LW_STEP")[-1]["step"])
            wait_for(lambda: len(steps(a, "1")) >= 8, BOUND, what="a to train on alone past a checkpoint")
            kill_tree(a.proc.pid)
            a.proc.wait(timeout=BOUND)
            a_last = int(a.lines("LW_STEP")[-1]["step"])
            # What a committed, read on disk: a SIGKILL can come between a commit and its log line.
            committed = [d.step for d in list_step_dirs(str(tmp_path / "ckpt")) if d.committed]
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            wait_for(lambda: len(steps(b, "1")) >= 3, BOUND, what="b to train on alone")
            (tmp_path / "stop.tmp").write_text(str(int(b.lines("LW_STEP")[-1]["step"]) + 3))
            (tmp_path / "stop.tmp").replace(tmp_path / "stop")
            b.proc.wait(timeout=BOUND)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + a.dump() + "\n" + b.dump()) from None
    detail = a.dump() + "\n" + b.dump()
    assert b.proc.returncode == 0, detail
    assert not b.events("world_superseded") and len(b.lines("LW_START")) == 1, detail  # in place, not restarted
    (started,) = [e for e in b.events("regroup_started") if e["round"].endswith("->1")]
    assert started["state"].startswith("dropped"), detail
    # Only the regroup's restore: b may have been rank 0 of the first round and logged its fresh start too.
    restores = [e for e in b.events("checkpoint_restored") if float(e["t"]) >= float(started["t"])]
    assert len(restores) == 1, detail
    (restored,) = restores
    assert committed and int(restored["step"]) == max(committed) > frozen_at, detail  # the job's newest, not b's own
    # b goes on from a's state at that step, bit for bit, and trains the steps a had made after it as a did (both
    # alone at world size 1, the same data).
    a_hash = {s["step"]: s["hash"] for s in a.lines("LW_STEP")}
    (agreed,) = [x for x in b.lines("LW_AGREED") if x["ws"] == "1"]
    assert agreed["step"] == restored["step"] and agreed["hash"] == a_hash[agreed["step"]], detail
    again = [s for s in steps(b, "1") if int(s["step"]) <= a_last]
    assert all(a_hash[s["step"]] == s["hash"] for s in again), detail


def test_a_worker_that_does_not_answer_the_notice_is_restarted_into_the_round_and_gets_the_state(
    tmp_path: Path,
) -> None:
    """The fallback: node b's worker is deaf (asleep in the script) when c dies; b's agent restarts it into the
    round that a's live worker already joined, and it receives a's state by broadcast."""
    # Whichever node gets group rank 1 is deaf at step 8; the node at group rank 2 is killed meanwhile.
    env = {
        "LW_MAX_STEPS": "100000",
        "LW_SLEEP": "0.02",
        "LW_HANG_NODE": "1",
        "LW_HANG_AT_STEP": "8",
        "LW_HANG_S": "120",
    }
    port = free_port()
    nodes = []
    for name in "abc":
        # The first round waits for all three (a long last call): under load c can start after a and b trained.
        nodes.append(
            Node(name, tmp_path, port, "2:3", {**env, "LW_STOP_FILE": str(tmp_path / "stop")}, 5, last_call_s=BOUND)
        )
        time.sleep(0.5)
    with reaped(*(n.proc for n in nodes)):
        try:
            wait_for(lambda: all(n.lines("LW_START") for n in nodes), BOUND, what="three workers")
            by_rank = {n.lines("LW_START")[0]["rank"]: n for n in nodes}
            deaf, victim, live = by_rank["1"], by_rank["2"], by_rank["0"]
            wait_for(lambda: bool(deaf.lines("LW_HANG")), BOUND, what="the deaf worker to fall asleep")
            kill_tree(victim.proc.pid)
            wait_for(lambda: bool(live.lines("LW_AGREED")), BOUND, what="the live worker to regroup")
            _train_at_two_then_stop([live, deaf], tmp_path, "both to train at world size 2")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(n.dump() for n in nodes)) from None
    detail = "\n".join(n.dump() for n in nodes)
    assert live.proc.returncode == 0 and deaf.proc.returncode == 0, detail
    assert len(live.lines("LW_START")) == 1 and live.events("workers_regrouped"), detail
    assert deaf.events("regroup_fallback") and len(deaf.lines("LW_START")) == 2, detail
    regrouped = live.events("regrouped")
    assert regrouped and regrouped[0]["receivers"] == "1", detail  # the restarted worker got the state from a
    done = [line for n in (live, deaf) for line in n.lines("LW_DONE")]
    assert len(done) == 2 and len({d["hash"] for d in done}) == 1, detail


def test_a_node_leaving_on_sigterm_costs_no_step(tmp_path: Path) -> None:
    """An announced change: the leaver's checkpoint request makes every rank save at one step boundary, the
    survivors stop holding when the regroup notice comes, and go on from exactly that step."""
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.02", "LW_SAVE_EVERY": "50", "LW_STOP_FILE": str(tmp_path / "stop")}
    port = free_port()
    nodes = []
    for name in "abc":
        ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"))
        nodes.append(Node(name, tmp_path, port, "2:3", env, extra=ckpt, last_call_s=BOUND))
        time.sleep(0.5)
    a, b, c = nodes
    with reaped(*(n.proc for n in nodes)):
        try:
            wait_for(lambda: len(a.lines("LW_STEP")) >= 10, BOUND, what="three nodes training")
            c.proc.send_signal(signal.SIGTERM)
            assert c.proc.wait(timeout=BOUND) == 0
            wait_for(lambda: all(n.lines("LW_AGREED") for n in (a, b)), BOUND, what="the survivors to regroup")

            def at_two() -> list[int]:
                return [int(s["step"]) for n in (a, b) for s in n.lines("LW_STEP") if s["ws"] == "2"]

            wait_for(lambda: len(at_two()) >= 6, BOUND, what="the survivors to train at world size 2")
            tmp = tmp_path / "stop.tmp"
            tmp.write_text(str(max(at_two()) + 20))
            tmp.replace(tmp_path / "stop")
            for n in (a, b):
                n.proc.wait(timeout=BOUND)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(n.dump() for n in nodes)) from None
    detail = "\n".join(n.dump() for n in nodes)
    assert c.events("agent_left"), detail
    for n in (a, b):
        assert n.proc.returncode == 0 and len(n.lines("LW_START")) == 1, detail
        assert n.events("workers_regrouped") and not n.events("regroup_fallback"), detail
    agreed = [line for n in (a, b) for line in n.lines("LW_AGREED")]
    assert len({x["hash"] for x in agreed}) == 1, detail
    steps = [int(s["step"]) for n in nodes for s in n.lines("LW_STEP") if s["rank"] == "0"]
    assert sorted(steps) == list(range(1, max(steps) + 1)), detail  # no step computed twice, none skipped
    regrouped = [e for n in (a, b) for e in n.events("regrouped")]
    assert regrouped and regrouped[0]["rolled_back"] == "0", detail


pytestmark = pytest.mark.slow


PLAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"PLAIN rank={dist.get_rank()} ws={dist.get_world_size()} sum={int(t.item())}", flush=True)
dist.destroy_process_group()
"""


def test_a_plain_script_under_live_starts_after_the_rendezvous(tmp_path: Path) -> None:
    """--live starts the workers of Session and Trainer scripts warm (before a round); a plain script is started
    after the rendezvous, as in restart mode (it would train alone): the job runs."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    port = free_port()
    nodes: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / "p0.log", tmp_path / "p1.log"]
    for log in logs:
        cmd = elastrain_cmd(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "plain-live", "--max-restarts", "0", "--live", "true", str(script),
        )  # fmt: skip
        nodes.append(spawn(cmd, log))
    with reaped(*nodes):
        codes = wait_logged(list(zip(nodes, logs, strict=True)), timeout=BOUND)
    texts = [log.read_text(errors="replace") for log in logs]
    detail = "\n".join(texts)
    assert codes == [0, 0], detail
    for text in texts:
        assert "script=other" in text and "event=workers_warming" not in text, detail
        assert "sum=2" in text and "ws=2" in text, detail


def test_a_node_told_to_leave_while_its_workers_warm_up_leaves_at_once(tmp_path: Path) -> None:
    """SIGTERM during the warm start: nothing trains yet, so no checkpoint is asked for; the node leaves, the job
    it never joined goes on."""
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.05"}
    port = free_port()
    a = Node("a", tmp_path, port, "1:2", env)
    with reaped(a.proc):
        wait_for(lambda: len(a.lines("LW_STEP")) >= 3, BOUND, what="a training alone\n" + a.dump())
        b = Node("b", tmp_path, port, "1:2", {**env, "LW_BUILD_S": "120"})
        with reaped(b.proc):
            wait_for(lambda: bool(b.events("workers_warming")), BOUND, what="b warming up\n" + b.dump())
            b.proc.send_signal(signal.SIGTERM)
            try:
                b.proc.wait(timeout=BOUND)
            except subprocess.TimeoutExpired:
                raise AssertionError("b did not leave\n" + b.dump()) from None
        steps = len(a.lines("LW_STEP"))
        wait_for(lambda: len(a.lines("LW_STEP")) > steps + 3, BOUND, what="a training on\n" + a.dump())
    detail = a.dump() + "\n" + b.dump()
    assert b.proc.returncode == 0, detail
    assert b.events("agent_left") and not b.events("checkpoint_requested"), detail
    assert not b.events("rendezvous_joined") and not a.events("regroup_announced")[1:], detail


def _release_once(node: Node, event: str, hold: Path) -> None:
    """Once ``node`` logged ``event``, let its closing worker end (``LW_END_HOLD_FILE``), and wait for the node."""
    wait_for(lambda: bool(node.events(event)), BOUND, what=f"{node.name}: {event}\n" + node.dump())
    hold.write_text("")
    try:
        node.proc.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{node.name} did not end\n" + node.dump()) from None


def test_a_node_told_to_leave_while_its_workers_close_lets_them_end_and_loses_nothing(tmp_path: Path) -> None:
    """A SIGTERM after the training loop ended, while the worker still runs (its script's end: an upload, say):
    the agent's save request is never answered (the final save is the worker's newest state), the worker is let
    end, and its exit without an answer is no error (``checkpoint_not_needed``, not ``checkpoint_unanswered``)."""
    hold = tmp_path / "hold"
    env = {"LW_MAX_STEPS": "8", "LW_SLEEP": "0.02", "LW_END_HOLD_FILE": str(hold)}
    a = Node("a", tmp_path, free_port(), "1:2", env, extra=("--checkpoint-dir", str(tmp_path / "ckpt")))
    with reaped(a.proc):
        wait_for(lambda: bool(a.lines("LW_CLOSED")), BOUND, what="a's worker closing\n" + a.dump())
        a.proc.send_signal(signal.SIGTERM)
        _release_once(a, "checkpoint_requested", hold)
    detail = a.dump()
    assert len(a.lines("LW_START")) == 1 and len(a.lines("LW_DONE")) == 1, detail
    assert a.events("checkpoint_not_needed") and a.events("agent_left"), detail
    assert not a.events("checkpoint_unanswered") and not a.events("checkpoint_timeout"), detail


def test_a_node_arriving_while_the_workers_close_waits_for_them_to_end(tmp_path: Path) -> None:
    """A node joins after the training loop ended but before the worker exited: the finished worker is neither
    asked for a save nor moved nor restarted (a restart would redo the whole job); its node ends with success."""
    hold = tmp_path / "hold"
    env = {"LW_MAX_STEPS": "8", "LW_SLEEP": "0.02", "LW_END_HOLD_FILE": str(hold)}
    port = free_port()
    a = Node("a", tmp_path, port, "1:2", env)
    with reaped(a.proc):
        wait_for(lambda: bool(a.lines("LW_CLOSED")), BOUND, what="a's worker closing\n" + a.dump())
        b = Node("b", tmp_path, port, "1:2", {**env, "LW_END_HOLD_FILE": ""})
        with reaped(b.proc):
            _release_once(a, "membership_change_deferred", hold)
    detail = a.dump() + "\n" + b.dump()
    assert a.proc.returncode == 0, detail
    assert len(a.lines("LW_START")) == 1 and len(a.lines("LW_DONE")) == 1, detail
    for name in ("checkpoint_requested", "regroup_announced", "workers_restarting", "regroup_fallback"):
        assert not a.events(name)[1 if name == "regroup_announced" else 0 :], f"{name}\n{detail}"
    assert a.events("job_succeeded"), detail
