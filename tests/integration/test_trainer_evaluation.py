"""A Trainer's ``evaluate()`` outside ``train()`` under elastrain-run's defaults (live mode), with an unmodified
Hugging Face-style script (tests/workers/hf_evaluate_first.py: it evaluates the model it starts from, fine-tunes it,
and evaluates it again).

Live workers set up as one process until they join their round. In the job's first round every member runs the
script from the top, so an evaluation before ``train()`` joins the round there and runs over it as under torchrun:
each rank evaluates its shard, one process writes the results, and the script runs once (before, an
evaluation-only script ran twice: alone in each warm worker, then again, alone, after the rendezvous). A node that
joins a job that trains on evaluates alone: its peers are in ``train()`` and never run that evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from support.processes import REPO, elastrain_cmd, events_in, run, torchrun_cmd
from support.trainer_trace import TEST_TIMEOUT_S, Event, Workload, trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

SCRIPT = REPO / "tests" / "workers" / "hf_evaluate_first.py"
SUBCLASS = REPO / "tests" / "workers" / "hf_evaluate_subclass.py"
SETTINGS = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]


def _data(assets: Path) -> list[str]:
    return [
        "--model_name_or_path", str(assets / "gpt2"), "--train_file", str(assets / "text" / "train.txt"),
        "--validation_file", str(assets / "text" / "validation.txt"), "--per_device_eval_batch_size", "4",
    ]  # fmt: skip


def _training(assets: Path, steps: int, save_steps: int) -> Workload:
    return Workload(
        str(SCRIPT),
        (
            *_data(assets), "--per_device_train_batch_size", "4", "--learning_rate", "2e-3",
            "--save_steps", str(save_steps), "--logging_steps", "10", "--max_steps", str(steps),
        ),
        steps,
    )  # fmt: skip


def _results(folder: Path) -> dict[str, float]:
    return json.loads((folder / "all_results.json").read_text())


def _once_over_the_first_round(args: list[str], tmp_path: Path) -> tuple[CompletedProcess[str], CompletedProcess[str]]:
    """The script under elastrain-run and under torchrun, one node of two workers each (output in ``ours`` and
    ``theirs``); checks that elastrain ran it once, over the first round's two ranks."""
    ours = run(
        elastrain_cmd("--standalone", "--nproc-per-node", "2", *args, "--output_dir", str(tmp_path / "ours")),
        timeout=240,
        cwd=tmp_path,
    )
    assert ours.returncode == 0, ours.stderr[-6000:]
    theirs = run(
        torchrun_cmd("--standalone", "--nproc-per-node", "2", *args, "--output_dir", str(tmp_path / "theirs")),
        timeout=240,
        cwd=tmp_path,
    )
    assert theirs.returncode == 0, theirs.stderr[-6000:]
    log = ours.stderr + ours.stdout
    assert len(events_in(log, "workers_started")) == 1, log[-6000:]  # the script ran once
    assert not events_in(log, "warm_start_unsupported") and not events_in(log, "trainer_loop_alone"), log[-6000:]
    joined = events_in(log, "trainer_group_joined")
    assert sorted(int(e["rank"]) for e in joined) == [0, 1] and {e["world"] for e in joined} == {"2"}, log[-6000:]
    return ours, theirs


def test_an_evaluation_only_script_evaluates_once_over_the_first_round_as_under_torchrun(
    hf_assets: Path, tmp_path: Path
) -> None:
    args = [str(SCRIPT), *_data(hf_assets), *SETTINGS]
    ours, _ = _once_over_the_first_round(args, tmp_path)
    assert ours.stdout.count("PERPLEXITY") == 1, ours.stdout[-6000:]  # one writer, as under torchrun
    mine, reference = _results(tmp_path / "ours"), _results(tmp_path / "theirs")
    for key in ("base_loss", "eval_loss"):
        assert mine[key] == pytest.approx(reference[key], rel=1e-5), (mine, reference)


def test_a_trainer_subclass_that_evaluates_and_predicts_its_own_way_does_so_once_over_the_first_round(
    hf_assets: Path, tmp_path: Path
) -> None:
    """tests/workers/hf_evaluate_subclass.py: ``evaluate()`` and ``predict()`` overridden as transformers'
    QuestionAnsweringTrainer overrides them (their own DataLoader and ``evaluation_loop``, never the Trainer's
    ``evaluate()``). Before, the warm workers evaluated and predicted alone, each over the whole set and each as the
    writer, ended, and the agent ran the script again after the rendezvous."""
    args = [
        str(SUBCLASS), "--model_name_or_path", str(hf_assets / "gpt2"),
        "--validation_file", str(hf_assets / "text" / "validation.txt"), "--per_device_eval_batch_size", "4",
        "--do_eval", "--do_predict", *SETTINGS,
    ]  # fmt: skip
    ours, theirs = _once_over_the_first_round(args, tmp_path)
    printed = [line for line in ours.stdout.splitlines() if line.startswith("PREDICTED")]
    assert printed == [line for line in theirs.stdout.splitlines() if line.startswith("PREDICTED")], ours.stdout
    assert len(printed) == 1, ours.stdout[-6000:]  # one writer, as under torchrun
    mine, reference = _results(tmp_path / "ours"), _results(tmp_path / "theirs")
    for key in ("eval_loss", "eval_accuracy", "eval_samples", "predict_accuracy", "predict_samples"):
        assert mine[key] == pytest.approx(reference[key], rel=1e-5), (key, mine, reference)


def test_a_script_that_evaluates_first_does_so_over_the_first_round_and_a_joiner_alone_without_losing_a_step(
    hf_assets: Path, tmp_path: Path
) -> None:
    steps = 60
    w = _training(hf_assets, steps, save_steps=40)
    events = [Event("start", "c", at=10, world=2), Event("wait", "c", at=10, world=3)]
    ran = trace(w, tmp_path / "trace", events, nnodes="1:3")
    assert ran.codes == {"a": 0, "b": 0, "c": 0}, ran.dump()
    for founder in ("a", "b"):  # the first round evaluated the base model over both ranks, then trained
        log = ran.logs[founder]
        assert not events_in(log, "trainer_loop_alone"), ran.dump()
        assert events_in(log, "trainer_group_joined")[0]["world"] == "2", ran.dump()
    alone = events_in(ran.logs["c"], "trainer_loop_alone")
    assert [e["loop"] for e in alone] == ["evaluate"], ran.dump()
    assert ran.ledger.last_step() == steps, ran.dump()
    assert all(ran.ledger.complete().values()) and not ran.ledger.redone(), ran.dump()
    assert 3 in ran.ledger.world_sizes() and 2 in ran.ledger.world_sizes(), ran.ledger.world_sizes()
    printed = [line for log in ran.logs.values() for line in log.splitlines() if line.startswith("PERPLEXITY")]
    assert len(printed) == 1, printed  # the last evaluation ran over the world of three: one writer


def test_a_spare_started_with_the_founders_evaluates_alone_once_the_job_formed_without_it(
    hf_assets: Path, tmp_path: Path
) -> None:
    """Three nodes start together for a job of exactly two: each waits at its first evaluation to know whether it
    founds the job. The two of the first round evaluate over it; the third, a spare, is told that the job formed
    without it, evaluates alone while it stands by, and waits for a round where it trains (it gets none).

    On a loaded box the third may start its workers only after the job formed: its agent then tells them so at
    once, and they evaluate alone without waiting to know (no ``worker_not_founding``)."""
    steps = 40
    w = _training(hf_assets, steps, save_steps=20)
    ran = trace(w, tmp_path / "trace", [], first=("a", "b", "c"), nnodes="2:2", extra=("--rdzv-backend", "c10d"))
    spares = [name for name, log in ran.logs.items() if events_in(log, "standby")]
    assert len(spares) == 1, ran.dump()
    spare = ran.logs[spares[0]]
    assert events_in(spare, "trainer_loop_alone"), ran.dump()
    founders = set(ran.logs) - set(spares)
    # The spare's agent asks whether the job formed as its workers warm; before either founder joined a round, it
    # had not formed: its workers waited to know, and were told.
    asked_at = float(events_in(spare, "workers_warming")[0]["t"])
    if asked_at < min(float(events_in(ran.logs[n], "rendezvous_joined")[0]["t"]) for n in founders):
        assert events_in(spare, "worker_not_founding"), ran.dump()
    for name in founders:
        log = ran.logs[name]
        assert not events_in(log, "trainer_loop_alone") and not events_in(log, "worker_not_founding"), ran.dump()
        assert events_in(log, "trainer_group_joined")[0]["world"] == "2", ran.dump()
    assert ran.codes == {"a": 0, "b": 0, "c": 0}, ran.dump()
    assert ran.ledger.last_step() == steps and set(ran.ledger.world_sizes()) == {2}, ran.dump()
    assert all(ran.ledger.complete().values()) and not ran.ledger.redone(), ran.dump()
