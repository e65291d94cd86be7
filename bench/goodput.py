"""Goodput under the issue-14 trace: the T5 example (or a Trainer script) as 2 local nodes, one table.

    python bench/goodput.py                          # 700 steps, all five modes (≈ 12-15 min on 2 cores)
    python bench/goodput.py --steps 600 --modes uninterrupted,live
    python bench/goodput.py --workload trainer       # examples/hf/run_clm.py, 2,000 steps, four modes

``--workload trainer`` runs the Hugging Face Trainer causal-LM script, unchanged, on tiny local assets, in the
modes uninterrupted, default (no launcher flag but the torchrun-style ones and --checkpoint-dir), restart
(``--live false``) and torchrun, under the same trace: bench/goodput_trainer.py says what it measures.
The rest of this text is the T5 workload's.

The modes, run one after the other with the same script, data and seed:

- ``uninterrupted``: ``elastrain-run``, no events (the reference of every ratio);
- ``restart``: ``elastrain-run --zygote false --live false`` (every change restarts every worker);
- ``restart+zygote``: ``--zygote true`` (restarted workers are forked from a process that imported torch);
- ``live``: ``--live true`` (workers regroup in place; README "Live reconfiguration");
- ``torchrun``: plain ``torchrun`` with the same flags and c10d rendezvous, ``--max-restarts 100``
  (it restarts every worker on every change; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without
  which a returning node hangs, see FACTS).

The trace (elastrain/chaos): node 1 (agent and workers) SIGKILLed once the job logged 25% of the
steps, started again 8 s later with the same command; SIGTERMed (15 s notice) at 60% of the steps,
but no sooner than 30 s (``--settle``) after it came back, so that it is a training member again
(a worker's cold start here is 10-15 s), and started again 8 s after the signal (or once it has
left, if later). Node 0 hosts the c10d store and is never touched.

700 steps by default: at ~5 steps/s with 2 nodes and ~9 with one, the returning node needs
≈ 8 + 15 s (≈ 200 steps alone) to train again, and both returns must land well before the end; the
five modes then take ≈ 15 min here. ``--steps`` goes bigger: a faster machine (20 steps/s on a quiet day
here) ends the job before the trace does; the bench then says which modes and the ``--steps`` it needs.

Per mode, from the job's ``metrics.jsonl`` point records and the harness's ``timeline.json``:

- stall per event: the longest time without a logged training step that the event caused: a gap
  between two steps belongs to the first event fired inside it, or else to the last one fired
  before it began (a joiner's regroup comes seconds after its node started);
- redone: completed steps logged again (a restart going back to its checkpoint, a live rollback),
  per event: the first event after the step's first computation. The step in flight when a node dies is partial work
  and is not counted, in any mode;
- stopped s: the sum of every gap longer than 3 median steps, less a median step each (one node
  alone steps faster than two on this machine, which flatters the wall time of a run that spent
  a while at world size 1);
- train s: first to last training step; ×: that over the uninterrupted run's;
- goodput: samples of committed steps (the final ``samples_seen``) per node-second (each node from
  its start to its exit), and relative to the uninterrupted run;
- the final eval loss and ``samples_seen`` from the script's ``summary.json``;
- worker starts: worker processes the elastrain agents started (their ``workers_started`` lines).

Everything stays under ``--out`` (one folder per mode: ``chaos/node-*.log``, ``metrics.jsonl``,
``events.jsonl``, ``summary.json``; ``goodput.json`` has the table's figures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T5 = REPO / "examples" / "t5"
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import goodput_trainer  # noqa: E402
from membership import free_port  # noqa: E402

from bench.support.t5_example import T5Run, load_run, prepare_data  # noqa: E402
from bench.support.trainer_workload import make_assets  # noqa: E402
from elastrain.chaos import (  # noqa: E402
    Action,
    ChaosHarness,
    MetricsProgress,
    Trace,
    TraceEvent,
    elastrain_node_command,
)
from elastrain.chaos.analysis import redone, stalls, workers_started  # noqa: E402
from elastrain.chaos.harness import new_run_id  # noqa: E402
from elastrain.metrics import read_events  # noqa: E402

GLOBAL_BATCH = 16
VICTIM = 1  # node 0 hosts the c10d store: killing it ends a c10d job in any mode
EVENT_LABELS = ("kill", "back", "term", "back")


@dataclass(frozen=True)
class Mode:
    name: str
    launcher_args: tuple[str, ...] = ()
    torchrun: bool = False
    events: bool = True


MODES = (
    Mode("uninterrupted", ("--zygote", "false", "--live", "false"), events=False),
    Mode("restart", ("--zygote", "false", "--live", "false")),
    Mode("restart+zygote", ("--zygote", "true", "--live", "false")),
    Mode("live", ("--live", "true")),
    Mode("torchrun", torchrun=True),
)


def issue_trace(steps: int, back_s: float, notice_s: float, settle_s: float) -> Trace:
    """SIGKILL of node 1 at 25% of the steps, back ``back_s`` later; SIGTERM at 60% (and ``settle_s``
    after the node came back at the earliest), back ``back_s`` later."""
    return Trace(
        nodes=2,
        events=(
            TraceEvent(0.0, Action.KILL, VICTIM, after_step=steps // 4),
            TraceEvent(0.0, Action.START, VICTIM, gap_s=back_s),
            TraceEvent(0.0, Action.TERM, VICTIM, notice_s=notice_s, after_step=steps * 6 // 10, gap_s=settle_s),
            TraceEvent(0.0, Action.START, VICTIM, gap_s=back_s),
        ),
    )


def node_command(mode: Mode, script: Sequence[str], port: int, run_id: str, checkpoints: Path) -> list[str]:
    """One node's command. torchrun gets the same launcher flags: elastrain-run is a drop-in for it."""
    if mode.torchrun:
        cmd = elastrain_node_command(script, 2, port, run_id, ["--monitor-interval=0.1"])
        return [sys.executable, "-m", "torch.distributed.run", *cmd[3:]]  # cmd[:3]: python -m elastrain
    # --checkpoint-dir lets an agent ask for a save before an announced change (SIGTERM, a node joining).
    return elastrain_node_command(script, 2, port, run_id, [*mode.launcher_args, f"--checkpoint-dir={checkpoints}"])


@dataclass
class Result:
    mode: str
    ok: bool
    fired: int = 0  # trace events that fired before the job ended
    stalls: list[float | None] = field(default_factory=list)
    redone: list[int] = field(default_factory=list)
    train_s: float | None = None
    node_s: float | None = None
    samples_seen: int | None = None
    eval_loss: float | None = None
    worker_starts: int | None = None
    stopped_s: float | None = None
    rolled_back: int = 0
    elapsed_s: float = 0.0
    step_sizes: dict[int, int] = field(default_factory=dict)
    epochs: int = 0

    def exact(self, steps: int) -> bool:
        """Every committed step took one full global batch, except an epoch's tail (``epoch_end='partial'``
        skips a tail smaller than the world size of that moment, so a run whose epoch ended at another world
        size than the uninterrupted run's differs by that tail), and ``samples_seen`` counts each once."""
        sizes = [self.step_sizes.get(n) for n in range(1, steps + 1)]
        if self.samples_seen is None or any(size is None for size in sizes):
            return False
        short = [size for size in sizes if size != GLOBAL_BATCH]
        ok_sizes = all(0 < size < GLOBAL_BATCH for size in short) and len(short) <= max(self.epochs, 1)
        return ok_sizes and self.samples_seen == sum(size for size in sizes if size is not None)

    def exact_cell(self, steps: int) -> str:
        if self.samples_seen is None:
            return "-"
        short = sorted(size for size in self.step_sizes.values() if size != GLOBAL_BATCH)
        tail = f" (epoch tail: a step of {', '.join(map(str, short))})" if short else ""
        return f"{self.samples_seen}{tail}" + ("" if self.exact(steps) else " NOT EXACT")


def run_mode(mode: Mode, out: Path, steps: int, data_dir: Path, trace: Trace, timeout_s: float) -> Result:
    """Run train.py as 2 local nodes under ``trace`` (or none) and measure it."""
    out.mkdir(parents=True)
    script = [str(T5 / "train.py"), "--preset", "tiny", "--max-steps", str(steps),
              "--global-batch-size", str(GLOBAL_BATCH), "--seed", "0", "--data-dir", str(data_dir),
              "--eval-every", "0", "--rouge-samples", "0", "--output-dir", str(out)]  # fmt: skip
    port, run_id = free_port(), new_run_id()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    if mode.torchrun:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    harness = ChaosHarness(
        trace if mode.events else Trace(nodes=2),
        lambda _: node_command(mode, script, port, run_id, out / "checkpoints"),
        out / "chaos",
        env=env,
        progress=MetricsProgress(out / "metrics.jsonl"),
        host_port=port,
    )
    print(f"[goodput] {mode.name}: {steps} steps; logs in {out / 'chaos'}", flush=True)
    chaos = harness.run(timeout_s=timeout_s, stall_s=240.0)
    print(f"[goodput] {mode.name}: {'done' if chaos.succeeded else 'FAILED'} in {chaos.elapsed_s:.0f} s", flush=True)
    return collect(mode, out)


def collect(mode: Mode, out: Path) -> Result:
    """The figures of one finished mode, from what its run left in ``out``."""
    timeline_file = out / "chaos" / "timeline.json"
    done = json.loads(timeline_file.read_text()).get("result", {}) if timeline_file.exists() else {}
    ok = bool(done.get("succeeded")) and (out / "summary.json").exists()
    events = json.loads(timeline_file.read_text()).get("events", []) if timeline_file.exists() else []
    fired = sum(1 for e in events if e.get("action") == "fired")
    result = Result(mode.name, ok, fired=fired, elapsed_s=float(done.get("elapsed_s", 0.0)))
    if (out / "metrics.jsonl").exists() and (out / "summary.json").exists():
        measure(mode, load_run(out), result, out)
    return result


def stopped(times: Sequence[float]) -> float:
    """Seconds without a step beyond the usual: the sum of the gaps longer than 3 median steps, less a
    median step each (on this machine one node alone steps faster than two, so wall time flatters a
    run that trained at world size 1; this does not)."""
    gaps = sorted(b - a for a, b in itertools.pairwise(sorted(times)))
    if not gaps:
        return 0.0
    usual = gaps[len(gaps) // 2]
    return sum(g - usual for g in gaps if g > 3 * usual)


def measure(mode: Mode, run: T5Run, result: Result, out: Path) -> None:
    points = run.points  # (time, step) of loss points
    done = {int(e["index"]): float(e["wall"]) for e in run.fired()}
    events = [done[i] for i in sorted(done)]
    if points:
        times = [t for t, _ in points]
        per_event = dict(zip(sorted(done), stalls(times, events), strict=True))
        result.stalls = [per_event.get(i) for i in range(len(EVENT_LABELS))] if done else []
        result.redone = redone(points, events)
        result.stopped_s = round(stopped(times), 1)
        result.train_s = round(times[-1] - times[0], 1)
    result.node_s = round(run.node_seconds(), 1)
    result.samples_seen = run.summary.get("samples_seen")
    result.epochs = int(run.summary.get("epoch") or 0)
    result.step_sizes = step_sizes(out / "metrics.jsonl")
    result.eval_loss = run.summary.get("final_eval_loss")
    logs = sorted((out / "chaos").glob("node-*.log"))
    result.worker_starts = len(workers_started(logs)) if logs and not mode.torchrun else None
    events_file = out / "events.jsonl"
    if events_file.exists():
        result.rolled_back = sum(int(e.get("rolled_back") or 0) for e in read_events(events_file, "regroup"))


def step_sizes(metrics: Path) -> dict[int, int]:
    """Samples per committed step, from the ``samples`` (samples_seen) of each step's last point record."""
    seen: dict[int, int] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "point" and "samples" in record.get("values", {}):
            seen[int(record["step"])] = int(record["values"]["samples"])  # a re-run step's later point wins
    return {n: seen[n] - seen.get(n - 1, 0) for n in sorted(seen) if n == 1 or n - 1 in seen}


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _redone_cell(counts: Sequence[int]) -> str:
    if not counts:
        return "-"
    total, *per_event = counts
    return f"{total} ({'/'.join(map(str, per_event))})" if per_event else str(total)


def table(results: Sequence[Result], steps: int) -> str:
    base = next((r for r in results if r.mode == "uninterrupted" and r.ok), None)
    head = [
        "mode", *(f"stall {e} s" for e in EVENT_LABELS), "redone (kill/back/term/back)", "stopped s", "train s",
        "× train", "goodput samples/node-s", "× goodput", "eval loss", "Δ eval", "samples_seen", "worker starts",
    ]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in results:
        goodput = r.samples_seen / r.node_s if r.samples_seen and r.node_s else None
        base_goodput = base.samples_seen / base.node_s if base and base.samples_seen and base.node_s else None
        delta = 100 * (r.eval_loss / base.eval_loss - 1) if base and base.eval_loss and r.eval_loss else None
        cells = [
            r.mode + ("" if r.ok else " (FAILED)"),
            *(_f(s) for s in (r.stalls or [None] * len(EVENT_LABELS))),
            _redone_cell(r.redone),
            _f(r.stopped_s),
            _f(r.train_s),
            _f(r.train_s / base.train_s if base and base.train_s and r.train_s else None, "{:.2f}"),
            _f(goodput, "{:.2f}"),
            _f(goodput / base_goodput if goodput and base_goodput else None, "{:.2f}"),
            _f(r.eval_loss, "{:.4f}"),
            _f(delta, "{:+.2f}%"),
            r.exact_cell(steps),
            "-" if r.worker_starts is None else str(r.worker_starts),
        ]
        if not r.stalls and r.mode == "uninterrupted":
            cells[1 : 1 + len(EVENT_LABELS)] = ["—"] * len(EVENT_LABELS)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def live_targets(live: Result, base: Result | None, steps: int) -> list[str]:
    """Issue 14's "done when" for live mode, each with what was measured."""

    def line(ok: bool, what: str, got: str) -> str:
        return f"  [{'PASS' if ok else 'FAIL'}] {what}: {got}"

    measured = [x for x in live.stalls if x is not None]
    per_event = live.redone[1:] if live.redone else []
    kills = [n for n, label in zip(per_event, EVENT_LABELS, strict=False) if label == "kill"]
    announced = [n for n, label in zip(per_event, EVENT_LABELS, strict=False) if label != "kill"]
    ratio = live.train_s / base.train_s if base and base.train_s and live.train_s else None
    delta = abs(live.eval_loss / base.eval_loss - 1) if base and base.eval_loss and live.eval_loss else None
    return [
        "issue 14 targets, live mode:",
        line(len(measured) == len(EVENT_LABELS) and max(measured) <= 2.0, "no stall over 2 s",
             ", ".join(_f(x) for x in live.stalls) + " s"),
        line(len(per_event) == len(EVENT_LABELS) and max(kills) <= 1 and not any(announced),
             "redone <= 1 per SIGKILL, 0 for announced changes", _redone_cell(live.redone)),
        line(ratio is not None and ratio <= 1.25, "train wall time <= 1.25x uninterrupted", _f(ratio, "{:.2f}x")),
        line(delta is not None and delta <= 0.01, "eval loss within 1%", _f(delta and 100 * delta, "{:.2f}%")),
        line(live.exact(steps), "samples_seen exact (every step a full global batch but an epoch's tail)",
             live.exact_cell(steps)),
    ]  # fmt: skip


# Seconds of training the trace needs after its first event at 25%: back (8) + the return's cold start and
# --settle (30) + notice (15) + back (8) + the second return's cold start, with a margin.
TRACE_NEEDS_S = 100.0


def unfinished_trace(short: Sequence[Result], base: Result | None, steps: int) -> str:
    """One line: which modes ended before their trace did, and the ``--steps`` that gives it time here."""
    modes = ", ".join(f"{r.mode} ({r.fired} of {len(EVENT_LABELS)})" for r in short)
    rate = steps / base.train_s if base and base.train_s else None
    hint = f"--steps {int(rate * TRACE_NEEDS_S) // 100 * 100 + 100}" if rate else "a larger --steps"
    speed = f" (the uninterrupted run trained {rate:.0f} steps/s)" if rate else ""
    return (
        f"the trace did not finish before the job ended in: {modes} events fired; their figures are not the "
        f"issue's trace. This machine is faster than {steps} steps assume{speed}: run again with {hint}."
    )


def _folder(mode: Mode) -> str:
    return mode.name.replace("+", "-")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("t5", "trainer"), default="t5", help="the T5 example or run_clm.py (t5)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (700; trainer: 2000)")
    p.add_argument("--modes", default=None, help="comma-separated subset, in order (default: all the workload's)")
    p.add_argument("--step-sleep", type=float, default=None, help="trainer: seconds of sleep per step (0.05)")
    p.add_argument("--assets", type=Path, default=None, help="trainer: make_assets.py's folder (built in --out)")
    p.add_argument("--out", type=Path, default=None, help="default runs/goodput/<time>")
    p.add_argument("--back", type=float, default=8.0, help="seconds until a node comes back (default 8)")
    p.add_argument("--notice", type=float, default=15.0, help="seconds of notice of the SIGTERM (default 15)")
    p.add_argument("--settle", type=float, default=30.0, help="the SIGTERM waits this long after the return (30)")
    p.add_argument("--report", type=Path, default=None, help="only print the table of an earlier run's --out")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a mode after this many seconds")
    a = p.parse_args()
    if a.workload == "trainer":
        return trainer_main(p, a)
    a.steps = a.steps or 700
    a.modes = a.modes or ",".join(m.name for m in MODES)
    by_name = {m.name: m for m in MODES}
    unknown = [n for n in a.modes.split(",") if n not in by_name]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(by_name)}")
    modes = [by_name[n] for n in a.modes.split(",")]
    if a.report is not None:
        out = a.report.resolve()
        results = [collect(m, out / _folder(m)) for m in modes if (out / _folder(m)).exists()]
    else:
        out = (a.out or REPO / "runs" / "goodput" / time.strftime("%Y%m%d-%H%M%S")).resolve()
        out.mkdir(parents=True, exist_ok=False)
        print(f"[goodput] building the code→docstring pairs and the tokenizer in {out / 'data'}", flush=True)
        prepare_data(out / "data")
        trace = issue_trace(a.steps, a.back, a.notice, a.settle)
        results = [run_mode(m, out / _folder(m), a.steps, out / "data", trace, a.timeout) for m in modes]
    text = table(results, a.steps)
    (out / "goodput.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"\n{a.steps} steps × {GLOBAL_BATCH} samples, 2 nodes; trace: kill at step {a.steps // 4}, "
          f"back {a.back:.0f} s later; term at step {a.steps * 6 // 10}, back {a.back:.0f} s later\n")  # fmt: skip
    print(text)
    live = next((r for r in results if r.mode == "live"), None)
    base = next((r for r in results if r.mode == "uninterrupted"), None)
    short = [r for r in results if r.mode != "uninterrupted" and r.fired < len(EVENT_LABELS)]
    if short:
        print("\n" + unfinished_trace(short, base, a.steps))
    if live is not None:
        print(f"\nlive: {live.rolled_back} step(s) rolled back by regroup agreement (events.jsonl)")
        print("\n".join(live_targets(live, base, a.steps)))
    return 0 if all(r.ok for r in results) else 1


def trainer_main(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--workload trainer``: examples/hf/run_clm.py in bench/goodput_trainer.py's modes."""
    steps = a.steps or 2000
    a.step_sleep = goodput_trainer.STEP_SLEEP if a.step_sleep is None else a.step_sleep
    by_name = {m.name: m for m in goodput_trainer.MODES}
    names = (a.modes or ",".join(by_name)).split(",")
    if unknown := [n for n in names if n not in by_name]:
        p.error(f"unknown modes {unknown} for --workload trainer; choose from {', '.join(by_name)}")
    modes = [by_name[n] for n in names]
    if a.report is not None:
        out = a.report.resolve()
        if (out / "settings.json").exists():  # what the run used
            settings = json.loads((out / "settings.json").read_text())
            steps, a.step_sleep = a.steps or int(settings["steps"]), float(settings["step_sleep"])
        results = [goodput_trainer.collect(m, out / m.name, steps) for m in modes if (out / m.name).exists()]
    else:
        out = (a.out or REPO / "runs" / "goodput-trainer" / time.strftime("%Y%m%d-%H%M%S")).resolve()
        out.mkdir(parents=True, exist_ok=False)
        (out / "settings.json").write_text(json.dumps({"steps": steps, "step_sleep": a.step_sleep}))
        assets = (a.assets or out / "assets").resolve()
        print(f"[goodput] building the tiny GPT-2, tokenizer and text in {assets}", flush=True)
        make_assets(assets)
        trace = issue_trace(steps, a.back, a.notice, a.settle)
        results = [
            goodput_trainer.run_mode(m, out / m.name, steps, assets, trace, a.timeout, a.step_sleep, free_port())
            for m in modes
        ]
    print(f"\nrun_clm.py, {steps} steps × {goodput_trainer.GLOBAL_BATCH} samples, 2 nodes"
          f"{f', {a.step_sleep:g} s sleep per step' if a.step_sleep else ''}; trace: kill at step {steps // 4}, "
          f"back {a.back:.0f} s later; term at step {steps * 6 // 10}, back {a.back:.0f} s later\n")  # fmt: skip
    goodput_trainer.report(results, out, len(EVENT_LABELS))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
