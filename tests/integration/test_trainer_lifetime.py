"""A Trainer's life under elastrain-run ends as under torchrun: a script that trains one Trainer after another (a
k-fold or a sweep) gets each one's memory back as it drops it, and a training DataLoader's persistent workers are
shut down with it, not terminated under the exiting worker (torch reports that as a failed DataLoader worker). A node
lost while such a script trains its second model is a live regroup, as in its first: the end of the first training
does not make the agents wait for the workers to end."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from support.processes import REPO, LiveNode, elastrain_cmd, free_port, kill_tree, reaped, run, wait_for, worker_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
WORKER = str(REPO / "tests" / "workers" / "hf_sequential_trainers.py")
BOUND = 180.0  # only stops hangs


@pytest.mark.parametrize("live", ["true", "false"])
def test_a_script_that_trains_one_trainer_after_another_gets_each_ones_memory_back(live: str, tmp_path: Path) -> None:
    cmd = elastrain_cmd(
        "--standalone", "--nproc-per-node=2", f"--live={live}", f"--checkpoint-dir={tmp_path / 'ckpt'}", WORKER,
        f"--output-dir={tmp_path / 'out'}",
    )  # fmt: skip
    proc = run(cmd, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # Two workers print to one stream: a line may follow another's text on the same line.
    # Freed by its reference count as the script drops it, its DataLoader's workers shut down with it: before,
    # elastrain's side of the Trainer held it in a reference cycle, and the collection that freed it waited 5 s for
    # each DataLoader worker.
    freed = re.findall(r"FOLD_FREED (\w+) (\d+)", out)
    assert freed == [("True", "0"), ("True", "0")], f"the first fold's model outlived its Trainer: {freed}\n{out}"
    done = sorted(re.findall(r"DONE (\d) (\d+) (\d+)", out))
    assert done == [("0", "6", "6"), ("1", "6", "6")], out
    assert "killed by signal" not in out and "Exception ignored" not in out, out


@pytest.mark.parametrize("when", ["in the second fold, then a node joins", "between the folds"])
def test_a_node_lost_while_the_script_trains_its_second_model_is_a_live_regroup(when: str, tmp_path: Path) -> None:
    """The first Trainer's end says the worker's training is over (a change then waits for the worker to exit);
    the second's start must take that back, or the survivor's agent waits for a worker that trains on, and the
    survivor waits in the broken step until --collective-timeout, then every worker restarts. Lost between the
    folds, the peer is missing from the second Trainer's first agreement: a regroup too, not a failed worker.

    A node that joins in the second fold runs the script from the top: its first Trainer is not the one the job
    trains, and can take neither the job's state nor give its own. It leaves with one line (EX_CONFIG), and the job
    trains on; before, it took the second model's state into the first, and both nodes failed on the checkpoint
    directory's check."""
    between = when == "between the folds"
    hold = tmp_path / "hold"  # the survivor, alone, waits after a step while it exists: the joiner meets its fold
    settings = {"SEQ_MAX_STEPS": "40", "SEQ_STEP_SLEEP": "0.15", "SEQ_FOLD_PAUSE": "4", "SEQ_HOLD_FILE": str(hold)}
    env = worker_env({"SEQ_OUTPUT_DIR": str(tmp_path / "out"), **settings})
    port = free_port()

    def node(name: str) -> LiveNode:
        return LiveNode(
            name, tmp_path, port, WORKER, env, rdzv_id="sequential", nnodes="1:2", last_call_s=2,
            collective_timeout=90, extra=("--checkpoint-dir", str(tmp_path / "ckpt")),
        )  # fmt: skip

    def in_fold(n: LiveNode, fold: int, world: int) -> list[dict[str, str]]:
        return [x for x in n.lines("FOLD_STEP") if x["fold"] == str(fold) and x["world"] == str(world)]

    def paused(n: LiveNode) -> bool:
        return "FOLD_FREED" in n.text()

    a = node("a")
    b = node("b")
    joiner: LiveNode | None = None
    with reaped(a.proc, b.proc):
        if between:
            wait_for(lambda: (paused(a) and paused(b)) or a.proc.poll() is not None, BOUND, what="the pause")
        else:
            wait_for(lambda: len(in_fold(a, 1, 2)) >= 3 or a.proc.poll() is not None, BOUND, what="the second fold")
        assert a.proc.poll() is None, a.dump() + b.dump()
        if not between:
            hold.touch()
        kill_tree(b.proc.pid, signal.SIGKILL)
        if not between:
            wait_for(lambda: bool(in_fold(a, 1, 1)), BOUND, what="a to train alone")
            joiner = node("c")
            with reaped(joiner.proc):
                # However long the joiner takes to start, the survivor is still in its second fold when it arrives.
                wait_for(
                    lambda: bool(joiner.events("rendezvous_joined")) or joiner.proc.poll() is not None,
                    BOUND,
                    what="the joiner to arrive",
                )
                hold.unlink()
                wait_for(lambda: joiner.proc.poll() is not None, BOUND, what="the joiner to leave")
        wait_for(lambda: a.proc.poll() is not None, BOUND, what="a to end")
    detail = a.dump() + (joiner.dump() if joiner else "")
    assert a.proc.returncode == 0, detail
    assert re.findall(r"DONE \d (\d+) (\d+)", a.text()) == [("40", "40")], detail
    assert not a.events("workers_restarting") and not a.events("regroup_notice_missing"), detail
    assert a.events("regrouped"), detail
    alone = in_fold(a, 1, 1)
    assert alone and alone[-1]["step"] == "40", detail
    if joiner is not None:
        assert in_fold(a, 1, 2), detail
        assert not a.events("membership_change_deferred"), detail
        assert joiner.proc.returncode != 0 and joiner.events("trainer_other_training"), detail
        assert "takes joining nodes only with --live false" in joiner.text(), detail
        assert not joiner.lines("FOLD_STEP"), detail  # it trained nothing with the job
    else:
        assert not in_fold(a, 1, 2), detail
