"""--live: exact-once data and the uninterrupted run's losses through a joiner, a SIGKILL and a SIGTERM leave,
in one job whose workers are never restarted (the restart-mode versions: test_ledger.py, test_equivalence.py)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from ledger_chain import GLOBAL_BATCH, LIVE_MAX_STEPS, LIVE_WORLD_SIZES, SAMPLES, live_run, uninterrupted

from elastrain.log import parse_event_line
from elastrain.metrics import read_metrics

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

    h = read_metrics(run.out / "ledger.jsonl")
    steps: dict[int, list[int]] = defaultdict(list)
    worlds: dict[int, set[int]] = defaultdict(set)
    epochs: dict[int, int] = {}
    for p in h.active:
        steps[p.step].extend(p.values["ids"])
        worlds[p.step].add(p.values["world_size"])
        epochs[p.step] = p.values["epoch"]
    assert sorted(steps) == list(range(1, LIVE_MAX_STEPS + 1))
    assert all(len(w) == 1 for w in worlds.values())
    order = [next(iter(worlds[s])) for s in sorted(steps)]
    sizes = [w for i, w in enumerate(order) if i == 0 or w != order[i - 1]]
    # --nnodes 1:3: the first node to be ready may train alone until the second joins.
    assert tuple(sizes[-len(LIVE_WORLD_SIZES) :]) == LIVE_WORLD_SIZES and set(sizes[: -len(LIVE_WORLD_SIZES)]) <= {1}

    by_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for step, ids in steps.items():
        by_epoch[epochs[step]].update(ids)
    last = max(by_epoch)
    for epoch, counts in by_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch} repeated samples: {[i for i, c in counts.items() if c > 1]}"
        if epoch < last:
            assert sorted(counts) == list(range(SAMPLES)), f"epoch {epoch} skipped samples"
    assert all(len(ids) in (GLOBAL_BATCH, SAMPLES % GLOBAL_BATCH) for ids in steps.values())


def test_live_membership_changes_end_where_the_uninterrupted_run_ends() -> None:
    run, reference = live_run(), uninterrupted(LIVE_MAX_STEPS)
    assert run.result()["step"] == reference.result()["step"] == LIVE_MAX_STEPS
    assert run.result()["final_loss"] == pytest.approx(reference.result()["final_loss"], rel=1e-4)
    got = read_metrics(run.ckpt / "metrics.jsonl").series("loss")
    want = read_metrics(reference.ckpt / "metrics.jsonl").series("loss")
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4)
