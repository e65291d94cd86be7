"""--live: exact-once data and the uninterrupted run's losses through a joiner, a SIGKILL and a SIGTERM leave,
in one job whose workers are never restarted (the restart-mode versions: test_ledger.py, test_equivalence.py)."""

from __future__ import annotations

import pytest
from support.ledger_chain import (
    GLOBAL_BATCH,
    LIVE_MAX_STEPS,
    LIVE_WORLD_SIZES,
    SAMPLES,
    assert_each_sample_once_per_epoch,
    assert_matches,
    ledger_steps,
    live_run,
    uninterrupted,
)

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
    assert sorted(steps.ids) == list(range(1, LIVE_MAX_STEPS + 1))
    assert all(len(w) == 1 for w in steps.worlds.values())
    order = [next(iter(steps.worlds[s])) for s in sorted(steps.ids)]
    sizes = [w for i, w in enumerate(order) if i == 0 or w != order[i - 1]]
    # --nnodes 1:3: the first node to be ready may train alone until the second joins.
    assert tuple(sizes[-len(LIVE_WORLD_SIZES) :]) == LIVE_WORLD_SIZES and set(sizes[: -len(LIVE_WORLD_SIZES)]) <= {1}
    assert_each_sample_once_per_epoch(steps)
    assert all(len(ids) in (GLOBAL_BATCH, SAMPLES % GLOBAL_BATCH) for ids in steps.ids.values())


def test_live_membership_changes_end_where_the_uninterrupted_run_ends() -> None:
    assert_matches(live_run(), uninterrupted(LIVE_MAX_STEPS), LIVE_MAX_STEPS)
