"""Worker start with and without the zygote: from ``workers_started`` to the first step.

    python bench/zygote.py                 # the T5 example, 3 runs per mode, alternating (≈ 5 min on 2 idle cores)
    python bench/zygote.py --repeat 1 --modes false,true
    python bench/zygote.py --workload hf   # Hugging Face's run_clm.py, unchanged (examples/hf), modes false,true

One node, one worker (``elastrain-run --standalone --nproc-per-node 1 --max-restarts 1``),
OMP_NUM_THREADS=1, and one of two workloads (``--workload``): the T5 example (``examples/t5/train.py
--preset tiny``: a Session script), or ``examples/hf/run_clm.py`` on a tiny GPT-2 (a Trainer script that imports
``datasets`` and ``transformers`` at its top, as every Hugging Face example does; its steps are read from the sample
ledger, bench/support/hf/ledger.py). Once the worker has finished its 5th step the bench SIGKILLs it: the agent
restarts it, the restart path of every membership change without ``--live``. Per run it reads the agent's
``workers_started`` lines (``t=``) and the first step after each, and prints:

- first start: the job's first worker, from ``workers_started`` to its first training step. With
  the zygote the agent waits for the zygote's preload before it starts a worker (the preload ran
  while the rendezvous did), so this is not the cost of a cold node;
- restart: the same for the restarted worker: what every restart costs, the figure the zygote cuts;
- zygote ready: seconds from the agent's start of the zygote to the end of its preload
  (``zygote_ready``: the interpreter, torch and the script's imports).

Modes (``--modes``): ``false`` (``--zygote false``: a new process imports torch, transformers and
everything else), ``true`` (the default: forked from a zygote that preloaded torch and the
script's top-level imports), and ``true-top`` (``true`` on a copy of the script that first imports
transformers at its top level; the example imports transformers inside ``model.build_model``, where
a top-level reader cannot see it; T5 only). The ratio is ``false`` over each zygote mode (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T5 = REPO / "examples" / "t5"
sys.path.insert(0, str(REPO))

from bench.support.t5_example import prepare_data  # noqa: E402
from bench.support.trainer_ledger import Ledger  # noqa: E402
from bench.support.trainer_workload import clm_script, make_assets, trainer_env  # noqa: E402
from elastrain.log import parse_event_line  # noqa: E402

MODES = ("false", "true", "true-top")
WORKLOADS = ("t5", "hf")
KILL_AT_STEP = 5

TOP_LEVEL_VARIANT = """\
# The T5 example with transformers imported at the top level (bench/zygote.py, mode true-top).
import sys
sys.path.insert(0, {t5!r})
import transformers
from transformers import T5Config, T5ForConditionalGeneration
__file__ = {script!r}
exec(compile(open(__file__).read(), __file__, "exec"))
"""


@dataclass
class Sample:
    mode: str
    first_s: float | None
    restart_s: float | None
    ready_s: float | None
    ok: bool


def _points(metrics: Path) -> list[tuple[float, int]]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("kind") == "point":
            out.append((float(rec["time"]), int(rec["step"])))
    return out


def _events(log: Path, name: str) -> list[dict[str, str]]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return [e for e in map(parse_event_line, text.splitlines()) if e is not None and e.get("event") == name]


def _t5(mode: str, out: Path, data_dir: Path, steps: int) -> tuple[list[str], dict[str, str]]:
    """The T5 example's command line and environment; its steps land in ``out/metrics.jsonl``."""
    script = str(T5 / "train.py")
    if mode == "true-top":
        variant = out / "train_top_level.py"
        variant.write_text(TOP_LEVEL_VARIANT.format(t5=str(T5), script=script))
        script = str(variant)
    args = [script, "--preset", "tiny", "--max-steps", str(steps), "--global-batch-size", "16", "--seed", "0",
            "--data-dir", str(data_dir), "--eval-every", "0", "--rouge-samples", "0", "--save-every", "1000",
            "--output-dir", str(out)]  # fmt: skip
    return args, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def _hf(out: Path, assets: Path, steps: int) -> tuple[list[str], dict[str, str]]:
    """run_clm.py's command line and environment; its steps land in the sample ledger ``out/ledger``."""
    return clm_script(assets, out / "model", steps, save_steps=1000), trainer_env(out / "ledger", out / "cache")


def _steps(workload: str, out: Path) -> list[tuple[float, int]]:
    """``(time, step)`` of every step the run's workers finished so far."""
    if workload == "hf":
        return Ledger.read(out / "ledger").step_ends() if (out / "ledger").exists() else []
    return _points(out / "metrics.jsonl")


def run_once(workload: str, mode: str, out: Path, data_dir: Path, steps: int, timeout_s: float) -> Sample:
    out.mkdir(parents=True)
    args, env = _hf(out, data_dir, steps) if workload == "hf" else _t5(mode, out, data_dir, steps)
    cmd = [sys.executable, "-m", "elastrain", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
           "--zygote", "false" if mode == "false" else "true", *args]  # fmt: skip
    log = out / "agent.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    killed = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not killed and any(s >= KILL_AT_STEP for _, s in _steps(workload, out)):
                (started,) = _events(log, "workers_started")[:1]
                for pid in started["pids"].split(","):  # the worker: this bench's own descendant
                    os.kill(int(pid), signal.SIGKILL)
                killed = True
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent's session: the agent and its zygote
        proc.wait(timeout=30)
    starts = [float(e["t"]) for e in _events(log, "workers_started")]
    points = sorted(_steps(workload, out))

    def to_first_step(t0: float) -> float | None:
        return next((round(t - t0, 2) for t, _ in points if t > t0), None)

    ready = _events(log, "zygote_ready")
    return Sample(
        mode,
        first_s=to_first_step(starts[0]) if starts else None,
        restart_s=to_first_step(starts[1]) if len(starts) > 1 else None,
        ready_s=float(ready[-1]["took_s"]) if ready else None,
        ok=proc.returncode == 0 and killed and len(starts) == 2,
    )


def _median(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return round(statistics.median(nums), 2) if nums else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs per mode, the modes alternating (default 3)")
    p.add_argument("--workload", choices=WORKLOADS, default="t5", help="the T5 example, or run_clm.py (default t5)")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(MODES)} (hf: false,true)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default 30)")
    p.add_argument("--out", type=Path, default=None, help="default runs/zygote/<time>")
    p.add_argument("--timeout", type=float, default=300.0, help="give up on a run after this many seconds")
    a = p.parse_args()
    allowed = MODES if a.workload == "t5" else MODES[:2]
    modes = (a.modes or ",".join(allowed)).split(",")
    if unknown := [m for m in modes if m not in allowed]:
        p.error(f"--modes: unknown for --workload {a.workload}: {unknown}; choose from {', '.join(allowed)}")
    out = (a.out or REPO / "runs" / "zygote" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=False)
    if a.workload == "hf":
        print(f"[zygote] building the tiny GPT-2, its tokenizer and text in {out / 'data'}", flush=True)
        make_assets(out / "data")
    else:
        print(f"[zygote] building the code→docstring pairs and the tokenizer in {out / 'data'}", flush=True)
        prepare_data(out / "data")
    load_before = os.getloadavg()[0]
    samples: list[Sample] = []
    for i in range(a.repeat):
        for mode in modes:
            s = run_once(a.workload, mode, out / f"{mode}-{i}", out / "data", a.steps, a.timeout)
            samples.append(s)
            failed = "" if s.ok else "  (FAILED: see its agent.log)"
            print(f"[zygote] --zygote {mode} run {i}: first start {_f(s.first_s)} s, restart {_f(s.restart_s)} s, "
                  f"zygote ready {_f(s.ready_s)} s{failed}", flush=True)  # fmt: skip
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    name = "run_clm.py, GPT-2 tiny" if a.workload == "hf" else "T5 tiny"
    print(f"\n{name}, 1 worker, OMP_NUM_THREADS=1; {a.repeat} run(s) per mode; {load} ({os.cpu_count()} cores)")
    print("seconds from the agent's workers_started to the worker's first training step (median)\n")
    print("| --zygote | first start | restart | zygote ready | restart: false / this |")
    print("|---|---|---|---|---|")
    medians = {m: _median([s.restart_s for s in samples if s.mode == m]) for m in modes}
    base = medians.get("false")
    for m in modes:
        runs = [s for s in samples if s.mode == m]
        ratio = f"{base / medians[m]:.2f}×" if base and medians[m] else "-"
        print(f"| {m} | {_f(_median([s.first_s for s in runs]))} | {_f(medians[m])} | "
              f"{_f(_median([s.ready_s for s in runs]))} | {ratio} |")  # fmt: skip
    (out / "zygote.json").write_text(json.dumps([s.__dict__ for s in samples], indent=1))
    return 0 if all(s.ok for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
