"""A world that lost the fencing claim to a world that then died whole (c10d, real TCPStores, real processes).

Two nodes form a world; the store's host, ``a``, is frozen (SIGSTOP); ``b`` fails the store over to itself,
trains on alone and claims the next fencing generation. When ``b`` dies whole (SIGKILL) before ``a`` thaws, ``a``
thaws into a world that lost the claim to a dead one: nothing listens at the winner's store any more. After
``refound_after`` of refused connections, ``a`` starts its lineage over under the job's next generation, instead
of waiting for the dead winner until ``join_timeout`` (the soak's seed 91127 stalled 180 s there). When ``b`` is
only frozen (a partition looks the same from ``a``: connections go unanswered, none is refused), ``a`` keeps
waiting and claims nothing, then joins ``b``'s world once ``b`` answers: a cut-off node never fences a live world.
When the winner's store moves while ``a`` waits for it (its host frozen, and another node of the winning world fails
the store over to itself), ``a`` follows it there at once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from support.processes import PYTHON, events_in, free_port, kill_tree, reaped, wait_for, worker_env

from elastrain import fence

BOUND = 60.0  # only stops hangs; a node that waited for the dead winner would wait join_timeout (120 s here)
REFOUND_AFTER = 4.0
CONF = {
    "heartbeat_interval": "0.1",
    "heartbeat_timeout": "1",
    "last_call_timeout": "0.3",
    "claim_grace": "1",
    "refound_after": str(REFOUND_AFTER),
    "store_lost_timeout": "2",
    "read_timeout": "3",
    "store_op_timeout": "3",
    "join_timeout": "120",
}

NODE = textwrap.dedent(
    """
    import json, logging, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from elastrain.rendezvous.backends.c10d import create_c10d_handler
    params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="gone", min_nodes=1,
                                  max_nodes=int(sys.argv[4]), local_addr="127.0.0.1", checkpoint_root=sys.argv[2],
                                  **json.loads(sys.argv[3]))
    h = create_c10d_handler(params)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        info = h.next_rendezvous()
        formed = {"generation": h.generation, "world": info.world_size, "store": h._store_address}
        print("FORMED", json.dumps(formed), flush=True)
        while h.num_nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    """
)


class Node:
    def __init__(self, name: str, tmp: Path, port: int, max_nodes: int = 2) -> None:
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen(
            [PYTHON, "-c", NODE, f"127.0.0.1:{port}", str(tmp / "root"), json.dumps(CONF), str(max_nodes)],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True,
        )  # fmt: skip

    def formed(self) -> list[dict[str, object]]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("FORMED ")]

    def events(self, name: str) -> list[dict[str, str]]:
        return events_in(self.log.read_text(errors="replace"), name)

    def dump(self) -> str:
        return f"--- {self.log.name} ---\n{self.log.read_text(errors='replace')[-15000:]}"


def _a_frozen_and_b_trained_on(tmp_path: Path, a: Node, b: Node) -> dict[str, object]:
    """Both nodes in one world; ``a`` (the store's host) frozen; ``b`` alone under a newer generation."""
    wait_for(lambda: any(f["world"] == 2 for f in a.formed()), BOUND, what="a world of both nodes")
    wait_for(lambda: any(f["world"] == 2 for f in b.formed()), BOUND, what="b in the world of both nodes")
    together = b.formed()[-1]
    kill_tree(a.proc.pid, signal.SIGSTOP)
    wait_for(lambda: b.formed()[-1]["world"] == 1, BOUND, what="b to fail the store over and train on alone")
    alone = b.formed()[-1]
    assert int(str(alone["generation"])) > int(str(together["generation"]))
    assert alone["store"] != together["store"]  # b hosts the store now
    return alone


def test_a_node_whose_winner_died_whole_starts_its_lineage_over(tmp_path: Path) -> None:
    port = free_port()
    a = Node("a", tmp_path, port)  # hosts the store at the endpoint
    wait_for(lambda: bool(a.formed()), BOUND, what="a's first world")
    b = Node("b", tmp_path, port)
    with reaped(a.proc, b.proc):
        try:
            won = _a_frozen_and_b_trained_on(tmp_path, a, b)
            kill_tree(b.proc.pid)  # the winning world dies whole, with its store
            b.proc.wait(timeout=10)
            thawed_at = time.monotonic()
            kill_tree(a.proc.pid, signal.SIGCONT)
            newer = int(str(won["generation"])) + 1
            wait_for(lambda: a.formed()[-1]["generation"] == newer, BOUND, what="a to start its lineage over")
            took = time.monotonic() - thawed_at
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{a.dump()}\n{b.dump()}") from None
        detail = f"{a.dump()}\n{b.dump()}"
        last = a.formed()[-1]
        assert last["world"] == 1, detail  # alone, under the job's next generation
        top = fence.newest(str(tmp_path / "root"))
        assert top is not None and top.generation == last["generation"] and top.store == last["store"], detail
        # Given up on only after refound_after of refused connections (once when its fence check found the newer
        # claim, again when its own claim lost to it: the second time at once).
        gone = a.events("winner_gone")
        assert gone and all(g["store"] == won["store"] for g in gone), detail
        assert float(gone[0]["refused_s"]) >= REFOUND_AFTER, detail
        assert took < BOUND, detail


def test_a_node_whose_winner_is_only_silent_waits_and_joins_it(tmp_path: Path) -> None:
    port = free_port()
    a = Node("a", tmp_path, port)
    wait_for(lambda: bool(a.formed()), BOUND, what="a's first world")
    b = Node("b", tmp_path, port)
    with reaped(a.proc, b.proc):
        try:
            won = _a_frozen_and_b_trained_on(tmp_path, a, b)
            kill_tree(b.proc.pid, signal.SIGSTOP)  # the winner is cut off (frozen): alive, but it answers nothing
            seen = len(a.formed())
            kill_tree(a.proc.pid, signal.SIGCONT)
            wait_for(lambda: len(a.events("redirect_waiting")) >= 2, BOUND, what="a to look for the winner's store")
            time.sleep(3 * REFOUND_AFTER)
            detail = f"{a.dump()}\n{b.dump()}"
            assert not a.events("winner_gone") and len(a.formed()) == seen, detail  # it waits, and forms nothing
            top = fence.newest(str(tmp_path / "root"))
            assert top is not None and top.generation == won["generation"], detail  # and claims nothing
            kill_tree(b.proc.pid, signal.SIGCONT)
            wait_for(lambda: len(a.formed()) > seen and a.formed()[-1]["world"] == 2, BOUND,
                     what="a to join the winner's world")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{a.dump()}\n{b.dump()}") from None
        detail = f"{a.dump()}\n{b.dump()}"
        assert a.formed()[-1]["store"] == won["store"], detail  # on the winner's store
        assert not a.events("winner_gone"), detail


def test_a_node_follows_the_winners_store_where_it_moved_while_it_waited(tmp_path: Path) -> None:
    port = free_port()
    a = Node("a", tmp_path, port, max_nodes=3)  # hosts the store at the endpoint
    wait_for(lambda: bool(a.formed()), BOUND, what="a's first world")
    b, c = Node("b", tmp_path, port, max_nodes=3), Node("c", tmp_path, port, max_nodes=3)
    nodes = (a, b, c)

    def detail() -> str:
        return "\n".join(n.dump() for n in nodes)

    with reaped(a.proc, b.proc, c.proc):
        try:
            wait_for(lambda: all(n.formed() and n.formed()[-1]["world"] == 3 for n in nodes), BOUND,
                     what="a world of the three nodes")  # fmt: skip
            kill_tree(a.proc.pid, signal.SIGSTOP)
            wait_for(lambda: all(n.formed()[-1]["world"] == 2 for n in (b, c)), BOUND,
                     what="b and c to fail the store over and train on")  # fmt: skip
            host, other = (b, c) if b.events("store_move_recorded") else (c, b)
            assert host.events("store_move_recorded"), "neither b nor c hosts the store"
            won = host.formed()[-1]
            # The winner's store host freezes: ``a``, thawed, finds it silent, while ``other`` fails the store over
            # to itself and claims the job's next generation, with its store there.
            kill_tree(host.proc.pid, signal.SIGSTOP)
            kill_tree(a.proc.pid, signal.SIGCONT)
            wait_for(lambda: other.formed()[-1]["world"] == 1, BOUND, what="the other node to train on alone")
            moved = other.formed()[-1]
            assert moved["store"] != won["store"]
            wait_for(lambda: a.formed()[-1]["store"] == moved["store"] and a.formed()[-1]["world"] >= 2, BOUND,
                     what="a to follow the winner's store where it moved")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{detail()}") from None
        assert not a.events("winner_gone"), detail()
        top = fence.newest(str(tmp_path / "root"))
        assert top is not None and top.store == moved["store"], detail()  # ``a`` claimed nothing of its own
