"""A newcomer whose job's store is gone before it joined a round (c10d, real TCPStores, real processes).

The world's store is published with its fencing claim in the checkpoint root; a node that starts later
finds it there. When that world dies (its one member, which hosted the store, SIGKILLed) before the
newcomer joined a round, the newcomer knows no successor: it keeps looking for a live published store
for ``refound_after``, then starts the job over at its ``--rdzv-endpoint`` under the next generation.
When that world *finished* instead (its store's host left with the close), the close is recorded beside the
claims and the newcomer ends with the job, at once; a later run of the same command in the same folder is not
taken for a node of the finished run. When its last member *left* it (a notice), that is recorded beside the
claims too, and the newcomer starts the job over at once instead of waiting ``refound_after``.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.processes import PYTHON, LiveNode, descendants, free_port, reaped, wait_for, worker_env
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastrain import fence
from elastrain.rendezvous.backends.c10d import C10dStores, create_c10d_handler
from elastrain.rendezvous.handler import ElastrainRendezvousHandler

FAST = {"heartbeat_interval": "0.1", "heartbeat_timeout": "1", "last_call_timeout": "0.3"}

WORLD = textwrap.dedent(
    """
    import json, os, sys, time
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
    from elastrain.rendezvous.backends.c10d import create_c10d_handler
    params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="refound", min_nodes=1, max_nodes=2,
                                  local_addr="127.0.0.1", is_host="true", checkpoint_root=sys.argv[2],
                                  heartbeat_interval="0.1", heartbeat_timeout="1", last_call_timeout="0.3",
                                  **json.loads(sys.argv[4]))
    h = create_c10d_handler(params)
    if len(sys.argv) > 5:  # its store is up: the round waits until the test says
        print("STORE_UP", flush=True)
        gated = time.monotonic() + 600
        while not os.path.exists(sys.argv[5]) and time.monotonic() < gated:
            time.sleep(0.05)
    h.next_rendezvous()
    print("WORLD_FORMED", h.generation, flush=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if open(sys.argv[3]).read() == "leave":  # a notice: the one member leaves (as elastrain-run does on SIGTERM)
        h.leave("SIGTERM")
        print("WORLD_LEFT", flush=True)
    else:
        h.shutdown()  # the job finished: close the rendezvous (as elastrain-run does after its workers succeeded)
        print("WORLD_CLOSED", flush=True)
    """
)


def start_world(
    tmp_path: Path, name: str = "world", port: int = 0, gate: Path | None = None, **conf: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A world of one member, which hosts the store at ``port`` (default: a free one; checkpoint root ``tmp_path``);
    it finishes once the returned file exists. With ``gate``, its round waits until that file exists."""
    log, finish = tmp_path / f"{name}.log", tmp_path / f"{name}.finish"
    args = [f"127.0.0.1:{port or free_port()}", str(tmp_path), str(finish), json.dumps(conf)]
    args += [str(gate)] if gate is not None else []
    world = subprocess.Popen(
        [PYTHON, "-c", WORLD, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=worker_env(),
        start_new_session=True,
    )  # fmt: skip
    return world, log, finish


def job_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret-of-the-job-0123456789abcdef")
    secret.chmod(0o600)
    return secret


def params(port: int, root: Path, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id="refound",
        min_nodes=1,
        max_nodes=2,
        local_addr="127.0.0.1",
        is_host="true",
        checkpoint_root=str(root),
        **{**FAST, **conf},
    )


def newcomer_of(world_log: Path, generation: int, root: Path, **conf: str) -> ElastrainRendezvousHandler:
    """Once the world of ``generation`` formed, a newcomer that finds its store (published with its claim)."""
    formed = f"WORLD_FORMED {generation}"
    wait_for(lambda: formed in world_log.read_text(), 60, what=f"the world to form: {world_log}")
    newcomer = create_c10d_handler(params(free_port(), root, **conf))
    assert isinstance(newcomer, ElastrainRendezvousHandler)
    published = fence.newest(str(root))
    assert published is not None and published.generation == generation
    assert newcomer._store_address == published.store  # it came to join the running job
    return newcomer


@pytest.mark.parametrize("end", ["killed", "stopped", "left"])
def test_a_newcomer_whose_job_is_gone_with_its_store_starts_it_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, end: str
) -> None:
    """The world's one member, which hosts the store, is SIGKILLed: every node the newcomer knows of (from the state
    it found the store with) refuses its probe, and it starts the job over after ``heartbeat_timeout``. Frozen
    (SIGSTOP) instead, it proves nothing (its ports still accept): the newcomer looks for a live store for
    ``refound_after`` first. When the member leaves, its mark says so: at once. ``refound_after`` is as long as the
    join where it must not decide, and so is the last call: a job started over does not wait for nodes launched with
    it."""
    world, log, leave = start_world(tmp_path)
    with reaped(world):
        # Frozen: short store timeouts, so that each bounded call to the frozen store costs seconds, not tens.
        frozen = {"refound_after": "4", "read_timeout": "1", "store_op_timeout": "2"} if end == "stopped" else {}
        newcomer = newcomer_of(log, 0, tmp_path, **{"refound_after": "600", **frozen}, join_timeout="600",
                               last_call_timeout="600")  # fmt: skip
        published = newcomer._store_address
        try:
            if end == "killed":
                world.send_signal(signal.SIGKILL)  # before the newcomer joined a round
                world.wait(timeout=10)
            elif end == "stopped":
                world.send_signal(signal.SIGSTOP)
            else:
                leave.write_text("leave")
                assert world.wait(timeout=30) == 0, log.read_text()
                assert "WORLD_LEFT" in log.read_text()
            mark = fence.vacated(str(tmp_path), 0)  # whether nobody is left in generation 0's world, by its mark
            assert (mark is not None and mark.run_id == "refound") is (end == "left")
            with caplog.at_level(logging.INFO, logger="elastrain"):
                info = newcomer.next_rendezvous()
            assert (info.world_size, info.rank) == (1, 0)
            assert newcomer.generation == 1  # the next fencing generation: the gone world's claims are stale
            top = fence.newest(str(tmp_path))
            assert top is not None and top.generation == 1 and top.store == newcomer._store_address != published
            events = [r.getMessage() for r in caplog.records]
            refounded = [e for e in events if "event=job_refounded" in e]
            assert len(refounded) == 1, events
            silent = float(refounded[0].split("silent_s=")[1].split()[0])
            if end == "killed":
                assert silent >= 1.0 and "every node and store of the job it knew of is gone" in refounded[0], events
            elif end == "stopped":
                assert silent >= 4.0 and "published store is silent" in refounded[0], events  # it looked for one
            else:
                assert "last node left" in refounded[0], events
            assert fence.newest_closed(str(tmp_path)) is None  # gone, not finished
        finally:
            newcomer.shutdown()
            if end == "stopped":
                world.send_signal(signal.SIGKILL)


def test_a_newcomer_that_a_world_formed_without_knows_it_gone_by_its_stores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newcomer starts when no world of the job runs, on the endpoint's store (hosted by a node launched with
    it: the newcomer may host it too, as every node of a job may), and a world forms there before the newcomer's
    first round (its workers still warm). That world dies with its store (SIGKILL) before the newcomer read its
    state: it knows no node of it, but every store the newest world ran refuses, and it starts the job over after
    ``heartbeat_timeout``, not ``refound_after`` (a soak's newcomer waited 60 s there)."""
    port, gate = free_port(), tmp_path / "gate"
    world, log, _ = start_world(tmp_path, port=port, gate=gate)
    with reaped(world):
        wait_for(lambda: "STORE_UP" in log.read_text(), 60, what=f"the world's store: {log}")
        conf = {**FAST, "refound_after": "600", "join_timeout": "600", "last_call_timeout": "600"}
        newcomer = create_c10d_handler(
            RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="refound", min_nodes=1,
                                 max_nodes=2, local_addr="127.0.0.1", checkpoint_root=str(tmp_path), **conf)
        )  # fmt: skip
        assert isinstance(newcomer, ElastrainRendezvousHandler)
        try:
            assert fence.generations(str(tmp_path)) == []  # it started where no world ran
            gate.touch()
            wait_for(lambda: "WORLD_FORMED 0" in log.read_text(), 60, what=f"the world to form: {log}")
            world.send_signal(signal.SIGKILL)
            world.wait(timeout=10)
            with caplog.at_level(logging.INFO, logger="elastrain"):
                info = newcomer.next_rendezvous()
            assert (info.world_size, info.rank, newcomer.generation) == (1, 0, 1)
            events = [r.getMessage() for r in caplog.records]
            refounded = [e for e in events if "event=job_refounded" in e]
            assert len(refounded) == 1 and "every node and store of the job it knew of is gone" in refounded[0], events
            assert float(refounded[0].split("silent_s=")[1].split()[0]) >= 1.0  # after heartbeat_timeout
        finally:
            newcomer.shutdown()


def test_a_newcomer_whose_job_finished_before_it_joined_ends_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world, log, finish = start_world(tmp_path)
    with reaped(world):
        # refound_after as long as the join: a newcomer that took the silent store for a dead job would hang here.
        newcomer = newcomer_of(log, 0, tmp_path, refound_after="600", join_timeout="600")
        try:
            finish.touch()  # the job finishes before the newcomer joins a round (its workers were still warming)
            assert world.wait(timeout=30) == 0, log.read_text()
            assert "WORLD_CLOSED" in log.read_text()
            with caplog.at_level(logging.INFO, logger="elastrain"), pytest.raises(RendezvousClosedError):
                newcomer.next_rendezvous()
            events = [r.getMessage() for r in caplog.records]
            assert not [e for e in events if "event=job_refounded" in e or "event=store_failover" in e], events
            assert fence.generations(str(tmp_path)) == [0]  # it claimed nothing: no second run of the job
            mark = fence.newest_closed(str(tmp_path))
            assert mark is not None and (mark.generation, mark.run_id) == (0, "refound")
        finally:
            newcomer.shutdown()


def test_a_later_run_in_the_same_folder_is_not_taken_for_the_finished_one(tmp_path: Path) -> None:
    world, log, finish = start_world(tmp_path)
    with reaped(world):
        wait_for(lambda: "WORLD_FORMED 0" in log.read_text(), 60, what=f"the first world to form: {log}")
        finish.touch()
        assert world.wait(timeout=30) == 0, log.read_text()
    assert fence.newest_closed(str(tmp_path)) is not None
    # The same command again, in the same checkpoint folder: a new run of the job, under the next generation.
    again, log, _ = start_world(tmp_path, name="again")
    with reaped(again):
        newcomer = newcomer_of(log, 1, tmp_path, refound_after="4", join_timeout="60")  # of the second run
        try:
            again.send_signal(signal.SIGKILL)  # the second run dies with its store, without a close of its own
            again.wait(timeout=10)
            info = newcomer.next_rendezvous()  # the first run's close is not this run's end: it starts it over
            assert (info.world_size, newcomer.generation) == (1, 2)
        finally:
            newcomer.shutdown()


@pytest.mark.parametrize(("forged", "untrusted"), [(fence.Closed, "fence_close_untrusted"),
                                                  (fence.Vacated, "fence_vacate_untrusted")])  # fmt: skip
def test_a_mark_not_signed_with_the_jobs_secret_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, forged: type[fence.Closed], untrusted: str
) -> None:
    """A forged close would end the newcomer with a job that died; a forged vacating would start a live job over."""
    secret = job_secret(tmp_path)
    world, log, _ = start_world(tmp_path, secret_file=str(secret))
    with reaped(world):
        newcomer = newcomer_of(log, 0, tmp_path, refound_after="600", join_timeout="60", secret_file=str(secret))
        try:
            world.send_signal(signal.SIGKILL)  # the job dies with its store; a forged mark says it finished, or left
            world.wait(timeout=10)
            assert fence.mark_closed(str(tmp_path), forged(0, "refound", 0.0, mac="0" * 64))
            with caplog.at_level(logging.INFO, logger="elastrain"):
                info = newcomer.next_rendezvous()
            assert (info.world_size, newcomer.generation) == (1, 1)  # started the job over, as for a dead job
            events = [r.getMessage() for r in caplog.records]
            assert [e for e in events if f"event={untrusted}" in e], events
            refounded = [e for e in events if "event=job_refounded" in e]
            # Started over on the proof it has (every node it knew of refused its probe), not on the forged mark.
            assert len(refounded) == 1 and "every node and store of the job it knew of is gone" in refounded[0], events
            assert float(refounded[0].split("silent_s=")[1].split()[0]) >= 1.0  # after heartbeat_timeout
        finally:
            newcomer.shutdown()


def test_a_close_by_a_superseded_world_is_not_the_jobs_end(tmp_path: Path) -> None:
    world, log, _ = start_world(tmp_path)
    with reaped(world):
        newcomer = newcomer_of(log, 0, tmp_path, refound_after="4", join_timeout="60")
        try:
            world.send_signal(signal.SIGKILL)  # the job dies with its store
            world.wait(timeout=10)
            # Generation 0's world "finished" after another world had claimed generation 1 (a stale world whose
            # workers ran to their end): that is not the end of the job the newest claim belongs to.
            assert fence.claim(str(tmp_path), fence.Claim(1, "refound", 1, ""))
            assert fence.mark_closed(str(tmp_path), fence.Closed(0, "refound"))
            info = newcomer.next_rendezvous()
            assert (info.world_size, newcomer.generation) == (1, 2)  # started the job over, as for a dead job
        finally:
            newcomer.shutdown()


def test_a_published_store_where_nothing_listens_is_passed_over_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that starts after the job's store died (a whole-job restart) reads a refused connection as proof that
    nothing is there: it goes to the endpoint without a client's connect retries (the read timeout, 5 s)."""
    dead = f"127.0.0.1:{free_port()}"
    assert fence.claim(str(tmp_path), fence.Claim(0, "refound", 0, dead))
    started = params(free_port(), tmp_path, read_timeout="30")
    stores = C10dStores(started)
    with caplog.at_level(logging.INFO, logger="elastrain"):
        store, hosts, address = stores.first(started)
    assert hosts and address != dead
    assert not stores.answers(dead, 30.0) and stores.vouches(dead, 30.0) == set()
    events = [r.getMessage() for r in caplog.records]
    assert [e for e in events if "event=published_store_silent" in e and "error=refused" in e], events
    del store


LIVE_WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "live_worker.py")


def test_a_node_whose_workers_still_warm_when_the_job_finishes_exits_with_it(tmp_path: Path) -> None:
    """Through elastrain-run --live: b's workers warm (a slow build) while a's job finishes; b ends at once, 0."""
    port, ckpt = free_port(), tmp_path / "ckpt"
    stop, built = tmp_path / "stop", tmp_path / "built"
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.02", "LW_STOP_FILE": str(stop), "LW_BUILD_UNTIL_FILE": str(built)}

    def node(name: str) -> LiveNode:
        return LiveNode(name, tmp_path, port, LIVE_WORKER, env, rdzv_id="late-node", nnodes="1:2", last_call_s=1,
                        collective_timeout=20, extra=("--checkpoint-dir", str(ckpt)))  # fmt: skip

    built.touch()  # a builds at once
    a = node("a")
    with reaped(a.proc):
        wait_for(lambda: bool(a.lines("LW_STEP")), 90, what="a to train\n" + a.dump())
        built.unlink()  # b's workers build until the test says
        b = node("b")
        with reaped(b.proc):
            wait_for(lambda: bool(b.events("workers_warming")), 90, what="b's workers to warm\n" + b.dump())
            assert b.events("published_store_found"), b.dump()  # b came to join a's running job
            stop.write_text("0")  # a's job finishes while b has not joined a round
            assert a.proc.wait(timeout=90) == 0, a.dump()
            assert a.events("job_close_recorded"), a.dump()
            built.touch()  # b's workers are warm now: its agent looks for the job's store, which left with the close
            assert b.proc.wait(timeout=90) == 0, b.dump()
            assert b.events("job_finished_elsewhere"), b.dump()
            assert not b.events("job_refounded") and not b.lines("LW_START"), b.dump()
            assert not descendants(b.proc.pid), b.dump()
    assert fence.generations(str(ckpt)) == [0]  # one world of one run: b founded no second one


def test_a_node_warming_when_the_jobs_last_node_leaves_starts_the_job_over_from_its_checkpoint(tmp_path: Path) -> None:
    """Through elastrain-run --live: b's workers warm while a, the job's one node, leaves on SIGTERM (a notice,
    after its leave's checkpoint). b starts the job over at once (``refound_after`` is 600 here) and goes on from
    the step a saved."""
    port, ckpt = free_port(), tmp_path / "ckpt"
    stop, built = tmp_path / "stop", tmp_path / "built"
    env = {"LW_MAX_STEPS": "100000", "LW_SLEEP": "0.02", "LW_STOP_FILE": str(stop), "LW_BUILD_UNTIL_FILE": str(built)}

    def node(name: str) -> LiveNode:
        conf = ("--rdzv-conf", "last_call_timeout=1,refound_after=600,join_timeout=600")
        return LiveNode(name, tmp_path, port, LIVE_WORKER, env, rdzv_id="left-job", nnodes="1:2", last_call_s=1,
                        collective_timeout=20, extra=("--checkpoint-dir", str(ckpt), *conf))  # fmt: skip

    built.touch()
    a = node("a")
    with reaped(a.proc):
        wait_for(lambda: len(a.lines("LW_STEP")) >= 5, 90, what="a to train\n" + a.dump())
        built.unlink()
        b = node("b")
        with reaped(b.proc):
            wait_for(lambda: bool(b.events("workers_warming")), 90, what="b's workers to warm\n" + b.dump())
            assert b.events("published_store_found"), b.dump()  # b came to join a's running job
            a.proc.send_signal(signal.SIGTERM)
            assert a.proc.wait(timeout=90) == 0, a.dump()
            assert a.events("agent_left") and a.events("world_vacated_recorded"), a.dump()
            left_at = max(int(s["step"]) for s in a.lines("LW_STEP"))
            built.touch()  # b's workers are warm now: its agent finds that the job's world was left
            wait_for(lambda: len(b.lines("LW_STEP")) >= 3, 120, what="b to start the job over\n" + b.dump())
            stop.write_text(str(max(int(s["step"]) for s in b.lines("LW_STEP")) + 3))
            assert b.proc.wait(timeout=90) == 0, b.dump()
            detail = a.dump() + b.dump()
            refounded = b.events("job_refounded")
            assert len(refounded) == 1 and "last node left" in refounded[0]["why"], detail
            first = min(int(s["step"]) for s in b.lines("LW_STEP"))
            assert first == left_at + 1, detail  # from a's leave checkpoint: no step lost, none computed twice
    assert fence.generations(str(ckpt)) == [0, 1]  # a's world, then b's, which fenced it
