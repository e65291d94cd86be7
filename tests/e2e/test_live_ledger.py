"""--live: exact-once data and the uninterrupted run's losses through a joiner, a SIGKILL and a SIGTERM leave,
in one job whose workers are never restarted (the restart-mode versions: test_ledger.py, test_equivalence.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from support.ledger_chain import (
    GLOBAL_BATCH,
    LIVE_MAX_STEPS,
    LIVE_WORLD_SIZES,
    SAMPLES,
    assert_each_sample_once_per_epoch,
    assert_matches,
    leave_during_save_run,
    ledger_steps,
    live_run,
    steps_at,
    two_live_nodes,
    uninterrupted,
)
from support.processes import events_in, kill_tree, wait_for

from elastrain.log import parse_event_line

pytestmark = pytest.mark.slow


def _events(log: str, name: str) -> list[dict[str, str]]:
    out = [parse_event_line(line) for line in log.splitlines()]
    return [e for e in out if e is not None and e.get("event") == name]


def test_live_membership_changes_train_every_sample_exactly_once_without_a_restart() -> None:
    run = live_run()
    detail = "\n".join(f"--- {n} ---\n{log[-4000:]}" for n, log in run.node_logs.items())
    assert run.codes["a"] == 0 and run.codes["c"] == 0, detail
    for name, log in run.node_logs.items():
        assert not _events(log, "workers_restarting") and not _events(log, "regroup_fallback"), detail
        assert len(_events(log, "workers_started")) == 1, f"{name}'s workers were started again\n{detail}"
    assert _events(run.node_logs["c"], "workers_warm"), detail  # c was built before it joined

    steps = ledger_steps(run.out / "ledger.jsonl")
    missing = sorted(set(range(1, LIVE_MAX_STEPS + 1)) - set(steps.ids))
    extra = sorted(set(steps.ids) - set(range(1, LIVE_MAX_STEPS + 1)))
    assert not missing and not extra, f"steps missing {missing}, unexpected {extra}\n{detail}"
    mixed = {s: sorted(w) for s, w in steps.worlds.items() if len(w) != 1}
    assert not mixed, f"steps trained in more than one world: {mixed}\n{detail}"
    order = [next(iter(steps.worlds[s])) for s in sorted(steps.ids)]
    sizes = [w for i, w in enumerate(order) if i == 0 or w != order[i - 1]]
    # --nnodes 1:3: the first node to be ready may train alone until the second joins.
    tail, head = tuple(sizes[-len(LIVE_WORLD_SIZES) :]), set(sizes[: -len(LIVE_WORLD_SIZES)])
    assert tail == LIVE_WORLD_SIZES and head <= {1}, f"world sizes in order: {sizes}\n{detail}"
    assert_each_sample_once_per_epoch(steps)
    whole = (GLOBAL_BATCH, SAMPLES % GLOBAL_BATCH)
    odd = {s: len(ids) for s, ids in steps.ids.items() if len(ids) not in whole}
    assert not odd, f"steps of another size than the global batch: {odd}"


def test_live_membership_changes_end_where_the_uninterrupted_run_ends() -> None:
    assert_matches(live_run(), uninterrupted(LIVE_MAX_STEPS), LIVE_MAX_STEPS)


@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "blocking-save"])
def test_a_node_asked_to_leave_while_a_step_is_saved_leaves_at_the_next_step_boundary(
    tmp_path: Path, async_save: bool
) -> None:
    """Two nodes, --live, a Session saving every 4 steps; one node's agent is SIGTERMed after a save step's gradients
    were agreed, so its checkpoint request reaches the workers while that step is saved. Training goes on from that
    save without holding, so it does not answer the request (its answer would stop the leaving node's worker in the
    middle of the next step, its peer's too). The ranks save the next step for the request and hold; the node leaves
    there, and its peer regroups on the notice: no step broken, every sample once."""
    max_steps = 24
    run = leave_during_save_run(tmp_path, term_at=8, max_steps=max_steps, async_save=async_save)
    detail = "\n".join(f"--- {n} ---\n{log[-5000:]}" for n, log in run.node_logs.items())
    assert run.codes == {"a": 0, "b": 0}, detail
    found = re.search(r"^LEDGER_TERM step=(\d+)$", run.node_logs["b"], re.M)
    assert found, detail
    term = int(found.group(1))
    acked = [e["step"] for e in events_in(run.node_logs["b"], "checkpoint_acked")]
    assert acked == [str(term + 1)], f"SIGTERM at step {term}'s save: the leave's checkpoint {acked}\n{detail}"
    regroups = [e for e in events_in(run.node_logs["a"], "regroup_started")]
    assert [e["cause"] for e in regroups] == ["notice"] * len(regroups), detail  # no collective broke
    assert regroups and regroups[-1]["step"] == str(term + 1), detail
    steps = ledger_steps(run.out / "ledger.jsonl")
    assert sorted(steps.ids) == list(range(1, max_steps + 1)), detail
    # b's worker SIGTERMs its agent at a save step it trains in a world of two (however late b joined on a busy box).
    assert all(steps.worlds[s] == {2} for s in range(term, term + 2)), steps.worlds
    assert all(steps.worlds[s] == {1} for s in range(term + 2, max_steps + 1)), steps.worlds
    assert_each_sample_once_per_epoch(steps)


def test_a_node_whose_every_process_gets_the_sigterm_leaves_at_a_step_boundary_with_its_checkpoint(
    tmp_path: Path,
) -> None:
    """A VM's shutdown, or Slurm's, signals every process of the node at once. The workers defer the signal to their
    agent's leave (``worker_sigterm_deferred``), save at their next step boundary when it asks, and are stopped by it
    there: the peer regroups on the notice, and trains every sample once. (A worker that died of the signal saved
    nothing, and the agent waited out the save timeout while its peer waited for it: 24 s here.)"""
    max_steps = 30

    def sigterm_every_process_of_b(procs: dict[str, subprocess.Popen[bytes]], ledger: Path) -> None:
        wait_for(lambda: steps_at(ledger, 2) >= 6, timeout=150, what="6 steps in a world of two")
        kill_tree(procs["b"].pid, signal.SIGTERM)

    # A DataLoader worker process too: the worker's forked process must not die of the signal either.
    run = two_live_nodes(tmp_path, max_steps, ("--num-workers", "1"), during=sigterm_every_process_of_b)
    detail = "\n".join(f"--- {n} ---\n{log[-5000:]}" for n, log in run.node_logs.items())
    assert run.codes == {"a": 0, "b": 0}, detail
    b = run.node_logs["b"]
    assert events_in(b, "worker_sigterm_deferred") and events_in(b, "checkpoint_acked"), detail
    assert not events_in(b, "worker_sigterm") and not events_in(b, "checkpoint_unanswered"), detail
    regroups = events_in(run.node_logs["a"], "regroup_started")
    assert regroups and [e["cause"] for e in regroups] == ["notice"] * len(regroups), detail  # no collective broke
    steps = ledger_steps(run.out / "ledger.jsonl")
    assert sorted(steps.ids) == list(range(1, max_steps + 1)), detail
    assert_each_sample_once_per_epoch(steps)


def test_a_node_whose_workers_die_as_it_is_asked_to_leave_leaves_without_waiting_for_a_checkpoint(
    tmp_path: Path,
) -> None:
    """The workers die (SIGKILL) as their agent gets its SIGTERM: no checkpoint can come. The agent sees them gone
    and leaves at once (``checkpoint_unanswered``) instead of waiting out the save timeout while its peer waits for
    it; the peer trains every sample once from the step it had."""
    max_steps = 30

    def kill_workers_and_sigterm_agent_of_b(procs: dict[str, subprocess.Popen[bytes]], ledger: Path) -> None:
        wait_for(lambda: steps_at(ledger, 2) >= 6, timeout=150, what="6 steps in a world of two")
        (started,) = events_in((ledger.parent.parent / "b.log").read_text(errors="replace"), "workers_started")
        for pid in started["pids"].split(","):
            os.kill(int(pid), signal.SIGKILL)
        procs["b"].send_signal(signal.SIGTERM)

    run = two_live_nodes(tmp_path, max_steps, during=kill_workers_and_sigterm_agent_of_b)
    detail = "\n".join(f"--- {n} ---\n{log[-5000:]}" for n, log in run.node_logs.items())
    assert run.codes["a"] == 0, detail
    b = run.node_logs["b"]
    assert events_in(b, "checkpoint_unanswered") and not events_in(b, "checkpoint_timeout"), detail
    assert events_in(b, "node_left"), detail
    steps = ledger_steps(run.out / "ledger.jsonl")
    assert sorted(steps.ids) == list(range(1, max_steps + 1)), detail
    assert_each_sample_once_per_epoch(steps)
