"""Worker start of the T5 example with and without the zygote: from ``workers_started`` to the first step.

    python bench/zygote.py                 # 3 runs per mode, alternating (≈ 5 min on 2 idle cores)
    python bench/zygote.py --repeat 1 --modes false,true

One node, one worker (``elastrain-run --standalone --nproc-per-node 1 --max-restarts 1``), the
T5 example (``examples/t5/train.py --preset tiny``), OMP_NUM_THREADS=1. Once the worker has logged
its 5th step the bench SIGKILLs it: the agent restarts it, the restart path of every membership
change without ``--live``. Per run it reads the agent's ``workers_started`` lines (``t=``) and the
first ``metrics.jsonl`` point after each, and prints:

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
a top-level reader cannot see it). The ratio is ``false`` over each zygote mode (medians).
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
from elastrain.log import parse_event_line  # noqa: E402

MODES = ("false", "true", "true-top")
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


def run_once(mode: str, out: Path, data_dir: Path, steps: int, timeout_s: float) -> Sample:
    out.mkdir(parents=True)
    script = str(T5 / "train.py")
    if mode == "true-top":
        variant = out / "train_top_level.py"
        variant.write_text(TOP_LEVEL_VARIANT.format(t5=str(T5), script=script))
        script = str(variant)
    cmd = [sys.executable, "-m", "elastrain", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
           "--zygote", "false" if mode == "false" else "true",
           script, "--preset", "tiny", "--max-steps", str(steps), "--global-batch-size", "16", "--seed", "0",
           "--data-dir", str(data_dir), "--eval-every", "0", "--rouge-samples", "0", "--save-every", "1000",
           "--output-dir", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = out / "agent.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    killed = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not killed and any(s >= KILL_AT_STEP for _, s in _points(out / "metrics.jsonl")):
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
    points = sorted(_points(out / "metrics.jsonl"))

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
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default 30)")
    p.add_argument("--out", type=Path, default=None, help="default runs/zygote/<time>")
    p.add_argument("--timeout", type=float, default=300.0, help="give up on a run after this many seconds")
    a = p.parse_args()
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    out = (a.out or REPO / "runs" / "zygote" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=False)
    print(f"[zygote] building the code→docstring pairs and the tokenizer in {out / 'data'}", flush=True)
    prepare_data(out / "data")
    load_before = os.getloadavg()[0]
    samples: list[Sample] = []
    for i in range(a.repeat):
        for mode in modes:
            s = run_once(mode, out / f"{mode}-{i}", out / "data", a.steps, a.timeout)
            samples.append(s)
            failed = "" if s.ok else "  (FAILED: see its agent.log)"
            print(f"[zygote] --zygote {mode} run {i}: first start {_f(s.first_s)} s, restart {_f(s.restart_s)} s, "
                  f"zygote ready {_f(s.ready_s)} s{failed}", flush=True)  # fmt: skip
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"\nT5 tiny, 1 worker, OMP_NUM_THREADS=1; {a.repeat} run(s) per mode; {load} ({os.cpu_count()} cores)")
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
