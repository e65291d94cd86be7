"""An unmodified Trainer script (examples/hf/run_clm.py) under elastrain-run: what a restart finds.

transformers' own ``get_last_checkpoint`` picks a ``checkpoint-N`` folder a restart cut short (optimizer and
scheduler written, no model weights), and ``trainer.train(resume_from_checkpoint=...)`` then fails on every
restart with ``Can't find a valid checkpoint``: the job dies. Under elastrain-run such a folder is never
resumed from; the newest committed one is. And with ``--live false`` a SIGKILLed node costs a restart from the
newest committed checkpoint, at the same data position and global batch.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support.processes import elastrain_cmd, events_in, run
from support.trainer_trace import (
    COMMON,
    LEDGER,
    SCRIPTS,
    TEST_TIMEOUT_S,
    Event,
    Ledger,
    References,
    Workload,
    causal_lm,
    causal_lm_streaming,
    sft_lora,
    trace,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


@pytest.fixture
def assets(hf_assets: Path) -> Path:
    return hf_assets


def _standalone(assets: Path, out: Path, max_steps: int) -> list[str]:
    w = causal_lm(assets, max_steps)
    script = [str(SCRIPTS / w.script), *w.args, "--output_dir", str(out), *COMMON]
    return elastrain_cmd("--standalone", "--nproc-per-node", "1", *script)


def test_a_checkpoint_cut_short_is_never_resumed_from(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    for name in ("ledger1", "ledger2"):
        (tmp_path / name).mkdir()
    env = {"LEDGER_DIR": str(tmp_path / "ledger1"), "PYTHONPATH": str(LEDGER)}
    first = run(_standalone(assets, out, 80), timeout=240, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    # A restart cut checkpoint-80 short: its weights and the commit marker never made it to disk.
    cut = out / "checkpoint-80"
    (cut / "model.safetensors").unlink()
    (cut / "elastrain-commit.json").unlink()
    env["LEDGER_DIR"] = str(tmp_path / "ledger2")
    again = run(_standalone(assets, out, 120), timeout=240, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-6000:]
    assert "trainer_checkpoint_skipped" in again.stderr, again.stderr[-4000:]  # the script asked for it, got 40
    resumed = sorted({r["step"] for r in Ledger.read(tmp_path / "ledger2").rows})
    assert resumed == list(range(41, 121)), resumed[:5]
    assert (out / "checkpoint-120" / "elastrain-commit.json").exists()


@pytest.mark.parametrize(
    "make", [causal_lm, causal_lm_streaming, sft_lora], ids=["map-style", "iterable", "trl-sft-lora"]
)
def test_restart_mode_resumes_from_the_newest_committed_checkpoint_at_the_same_data_position(
    assets: Path, hf_references: References, tmp_path: Path, make: Callable[[Path], Workload]
) -> None:
    """An iterable training set (``--streaming``) resumes at the place in it the checkpoint noted, with no sample
    before it read again. LoRA adapters (peft, under TRL's SFTTrainer) resume from checkpoints that hold only them."""
    streaming = make is causal_lm_streaming
    w = make(assets)  # as the e2e trace runs it: the uninterrupted run is shared (hf_references)
    events = [Event("kill", "b", at=70, world=2), Event("start", "b", at=70), Event("wait", "b", world=2)]
    got = trace(w, tmp_path / "trace", events, extra=("--live", "false"))
    detail = f"events: {got.events}\n{got.dump()}"
    assert got.codes["a"] == 0 and got.codes["b2"] == 0, detail
    want = hf_references.get(w).ledger.steps()
    assert got.ledger.steps() == want, detail  # every step trained the same samples as the uninterrupted run
    assert "workers_restarting" in got.logs["a"], detail
    # Steps since the last committed checkpoint (save_steps 40) ran again, and no more.
    assert 0 < len(got.ledger.redone()) <= 40 + 1, detail
    if streaming:
        restarted = events_in(got.logs["a"], "trainer_stream_resumed")
        assert restarted and int(restarted[-1]["to"]) > 0, detail
        assert not events_in(got.logs["a"], "trainer_stream_skipped"), detail


def test_without_the_integration_the_trainer_runs_unchanged(assets: Path, tmp_path: Path) -> None:
    cmd = _standalone(assets, tmp_path / "model", 20)
    cmd.insert(cmd.index("--standalone"), "--trainer-integration")
    cmd.insert(cmd.index("--standalone"), "false")
    proc = run(cmd, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "trainer_integrated" not in proc.stderr
    assert not (tmp_path / "model" / "checkpoint-20" / "elastrain-commit.json").exists()
    shutil.rmtree(tmp_path / "model")
