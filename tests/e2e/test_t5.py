"""The T5 example end to end: it learns, it runs from a saved model, and it survives a node's SIGKILL.

The preemption test runs the example as 2 local elastrain-run nodes under the chaos harness: node 1
is SIGKILLed mid-run and started again. The job must reach --max-steps, record the world-size
changes, use every sample exactly once per epoch, and end within 2% of the uninterrupted run's
eval loss (same seed); with the constant policy and token-normalised loss it is in fact ~1e-5.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from support.processes import PYTHON, REPO, free_port, run, worker_env

from elastrain.chaos import ChaosHarness, MetricsProgress, elastrain_node_command, trace_from_dict
from elastrain.metrics import read_metrics

TRAIN = str(REPO / "examples" / "t5" / "train.py")
STEPS = 90
TRAIN_LIMIT = 480  # 30 steps per epoch at global batch 16: the ledger covers 3 epochs
COMMON = [
    "--preset", "tiny", "--max-steps", str(STEPS), "--global-batch-size", "16", "--seed", "0",
    "--train-limit", str(TRAIN_LIMIT), "--eval-size", "64", "--eval-every", "0", "--rouge-samples", "4",
    "--save-every", "10", "--ledger",
]  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stdlib pairs and tokenizer, built once for every run in this module."""
    d = tmp_path_factory.mktemp("t5-data")
    code = f"import sys; sys.path.insert(0, 'examples/t5'); import data; data.prepare({str(d)!r}, eval_size=64)"
    out = run([PYTHON, "-c", code], timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return d


@pytest.fixture(scope="module")
def baseline(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: one plain process (world size 1)."""
    out = tmp_path_factory.mktemp("baseline")
    res = run([PYTHON, TRAIN, *COMMON, "--data-dir", str(data_dir), "--output-dir", str(out)], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _ledger_by_epoch(out: Path) -> dict[int, collections.Counter[int]]:
    """Sample ids per epoch, counting each step once, as run by the last segment that ran it."""
    order = {seg: i for i, seg in enumerate(read_metrics(out / "metrics.jsonl").segments)}
    rows = [json.loads(line) for f in out.glob("ledger-rank*.jsonl") for line in f.read_text().splitlines() if line]
    final_segment: dict[int, str] = {}
    for r in rows:
        if r["step"] not in final_segment or order[r["segment"]] > order[final_segment[r["step"]]]:
            final_segment[r["step"]] = r["segment"]
    epochs: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in rows:
        if final_segment[r["step"]] == r["segment"]:
            epochs[r["epoch"]].update(r["ids"])
    return epochs


def _assert_exactly_once(out: Path) -> None:
    epochs = _ledger_by_epoch(out)
    assert sorted(epochs) == list(range(STEPS * 16 // TRAIN_LIMIT))
    for epoch, counts in epochs.items():
        assert set(counts) == set(range(TRAIN_LIMIT)), f"epoch {epoch} missed samples"
        assert max(counts.values()) == 1, f"epoch {epoch} repeated {[i for i, c in counts.items() if c > 1][:10]}"


def test_the_example_learns(baseline: Path, data_dir: Path) -> None:
    s = _summary(baseline)
    assert s["global_step"] == STEPS and s["samples_seen"] == STEPS * 16
    assert s["world_sizes"] == [1] and s["restarts"] == 0 and s["resumes"] == []
    losses = read_metrics(baseline / "metrics.jsonl").series("loss")
    first = sum(v for _, v in losses[:5]) / 5
    assert s["final_eval_loss"] < first - 1.0, (first, s["final_eval_loss"])
    assert 0.0 <= s["final_rouge_l"] <= 1.0
    assert (data_dir / "tokenizer.json").exists() and (baseline / "checkpoints").is_dir()
    _assert_exactly_once(baseline)


@pytest.mark.timeout(420)
def test_sigkill_of_a_node_mid_run(baseline: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "elastic"
    trace = trace_from_dict(
        {
            "nodes": 2,
            "events": [
                {"after_step": 30, "action": "kill", "node": 1},
                {"after_step": 50, "action": "start", "node": 1},
            ],
        }
    )
    script = [TRAIN, *COMMON, "--data-dir", str(data_dir), "--output-dir", str(out)]
    port = free_port()
    # A starved (not dead) node stays in on a busy CI box; --checkpoint-dir: a save before the node rejoins.
    # Restart mode: the node's return restarts both (live mode's joins: test_live_ledger.py, bench/goodput.py).
    launcher = ["--checkpoint-dir", str(out / "checkpoints"), "--live", "false"]

    def node_command(_: int) -> list[str]:
        return elastrain_node_command(script, 2, port, "t5-e2e", launcher)

    harness = ChaosHarness(
        trace,
        node_command,
        out / "chaos",
        env=worker_env(),
        progress=MetricsProgress(out / "metrics.jsonl"),
        host_port=port,  # node 0 hosts the c10d store; the trace kills node 1
    )
    result = harness.run(timeout_s=360)
    logs = "\n".join(p.read_text()[-4000:] for p in sorted((out / "chaos").glob("node-*.log")))
    assert result.succeeded, logs
    assert result.leftover_pids == [], "nodes still running at the end"
    actions = [(e["action"], e.get("node")) for e in result.timeline]
    assert actions.count(("kill", 1)) == 1 and actions.count(("start", 1)) == 2

    s = _summary(out)
    assert s["global_step"] == STEPS and s["samples_seen"] == STEPS * 16
    sizes = s["world_sizes"]
    assert sizes[0] == 2 and 1 in sizes and 2 in sizes[sizes.index(1) :], sizes
    assert s["resumes"][0]["world_size_before"] == 2 and s["resumes"][0]["world_size_after"] == 1
    assert 0 < s["resumes"][0]["step"] <= 30
    _assert_exactly_once(out)
    base = _summary(baseline)["final_eval_loss"]
    assert abs(s["final_eval_loss"] - base) / base < 0.02, (s["final_eval_loss"], base)

    # The demo's report reads both runs.
    res = run([PYTHON, str(REPO / "examples" / "t5" / "report.py"), "--baseline", str(baseline), "--elastic", str(out),
               "--out", str(tmp_path / "report")], timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "SIGKILL" in page and "steps lost" in page
    assert all((tmp_path / "report" / f).stat().st_size > 10_000 for f in ("world_size.png", "loss.png"))


def test_model_from_a_local_pretrained_directory(data_dir: Path, tmp_path: Path) -> None:
    """``--model PATH`` goes through from_pretrained (offline: a tiny T5 saved with save_pretrained)."""
    saved = tmp_path / "t5-local"
    code = (
        "import sys; sys.path.insert(0, 'examples/t5'); import data, model; "
        f"tok = data.load_tokenizer({str(data_dir / 'tokenizer.json')!r}); m = model.build_model('tiny', tok); "
        f"m.save_pretrained({str(saved)!r}); tok.save_pretrained({str(saved)!r})"
    )
    res = run([PYTHON, "-c", code], timeout=180, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run"
    args = ["--model", str(saved), "--max-steps", "4", "--eval-size", "16", "--rouge-samples", "2", "--eval-every", "0"]
    res = run([PYTHON, TRAIN, *args, "--data-dir", str(data_dir), "--output-dir", str(out)], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = _summary(out)
    assert s["model"] == str(saved) and s["global_step"] == 4


def test_running_the_same_command_again_resumes(baseline: Path, data_dir: Path) -> None:
    """After the whole job is gone, the same command restores its newest checkpoint (here: the final one)."""
    res = run([PYTHON, TRAIN, *COMMON, "--data-dir", str(data_dir), "--output-dir", str(baseline)], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = _summary(baseline)
    assert s["global_step"] == STEPS and s["restarts"] == 1 and s["world_sizes"] == [1, 1]
    (resume,) = s["resumes"]
    assert (resume["step"], resume["world_size_before"], resume["world_size_after"]) == (STEPS, 1, 1)
