"""The Trainer causal-LM workload of the benches: examples/hf/run_clm.py, unchanged, on tiny local assets.

:func:`make_assets` runs examples/hf/make_assets.py once (a 4-layer GPT-2 with d_model 64, a byte-level BPE
tokenizer and a text file, from the standard library's source); :func:`clm_script` is the script's command line
(the arguments of the issue-24 run: ``save_steps 50``, a global batch of 8 at 2 nodes); :func:`trainer_env` the
environment that makes every rank write the sample ledger (bench/support/hf/ledger.py) and, with ``step_sleep``,
pace every step. The scripts run as subprocesses: nothing here imports from examples/ or tests/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.support.trainer_ledger import PACE_FILE, ledger_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "hf" / "run_clm.py"
PER_DEVICE_BATCH = 4
SAVE_STEPS = 50


def make_assets(out: Path, timeout_s: float = 600.0) -> Path:
    """Build the tiny models and data in ``out`` once (``out/done`` marks a finished build)."""
    if not (out / "done").exists():
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(REPO / "examples" / "hf" / "make_assets.py"), str(out)]
        subprocess.run(cmd, check=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
        (out / "done").write_text("ok")
    return out


def clm_script(
    assets: Path, output_dir: Path, max_steps: int, save_steps: int = SAVE_STEPS, eval_steps: int = 0
) -> list[str]:
    """run_clm.py's command line: per-device batch 4 (a global batch of 8 at the first world size, 2 nodes);
    ``eval_steps``: also evaluate on the validation text every that many steps, and once after training."""
    evaluate = [
        "--do_eval", "--validation_file", str(assets / "text" / "validation.txt"), "--eval_strategy", "steps",
        "--eval_steps", str(eval_steps),
    ] if eval_steps else []  # fmt: skip
    return [
        str(SCRIPT), "--model_name_or_path", str(assets / "gpt2"), "--train_file", str(assets / "text" / "train.txt"),
        "--block_size", "32", "--per_device_train_batch_size", str(PER_DEVICE_BATCH), "--learning_rate", "2e-3",
        "--save_steps", str(save_steps), "--logging_steps", "10", "--max_steps", str(max_steps),
        "--output_dir", str(output_dir), "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--seed", "0", "--do_train", *evaluate,
    ]  # fmt: skip


def evaluation_steps(state: dict[str, Any]) -> list[int]:
    """The steps of the evaluations in a ``trainer_state.json``'s log history, in order."""
    return [int(h["step"]) for h in state.get("log_history", []) if "eval_loss" in h]


def trainer_env(ledger_dir: Path, cache_dir: Path, step_sleep: float = 0.0) -> dict[str, str]:
    """The environment of every node: the ledger under ``ledger_dir`` (and its pace file: ``step_sleep`` seconds
    after each step), one thread per process, the datasets cache in ``cache_dir``."""
    ledger_dir.mkdir(parents=True, exist_ok=True)
    if step_sleep > 0:
        (ledger_dir / PACE_FILE).write_text(f"{step_sleep:g}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_DATASETS_CACHE": str(cache_dir)}
    env.update(ledger_env(ledger_dir, os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))))
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def trainer_state(output_dir: Path) -> dict[str, Any]:
    """The Trainer's final ``trainer_state.json`` in the script's output_dir ({} when the script never ended)."""
    path = output_dir / "trainer_state.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def final_loss(output_dir: Path) -> tuple[int | None, float | None]:
    """The last training loss the Trainer logged (its log history) and its step."""
    logged = [h for h in trainer_state(output_dir).get("log_history", []) if "loss" in h]
    return (int(logged[-1]["step"]), float(logged[-1]["loss"])) if logged else (None, None)


def train_samples(output_dir: Path) -> int | None:
    """The training set's size, as the script reported it (``train_samples`` in train_results.json)."""
    path = output_dir / "train_results.json"
    return int(json.loads(path.read_text())["train_samples"]) if path.exists() else None
