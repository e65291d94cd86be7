"""``bench/goodput.py --workload trainer``: the Trainer causal-LM script (examples/hf/run_clm.py, unchanged)
under the same trace as the T5 example, four ways.

- ``uninterrupted``: ``elastrain-run`` with its defaults, no events (the reference of every ratio);
- ``default``: ``elastrain-run`` with no flag beyond the torchrun-style ones and ``--checkpoint-dir`` (live
  regroup, the Trainer integration);
- ``restart``: ``--live false`` (every change restarts every worker, which resume from the newest committed
  ``checkpoint-N``);
- ``torchrun``: plain ``torchrun``, same flags, ``--max-restarts 100``: the script's own ``get_last_checkpoint``
  resume and the Trainer's skip-ahead.

Per mode, from the sample ledger every rank writes (bench/support/hf/ledger.py: the script imports it when
``LEDGER_DIR`` is set; the bench reads it from outside) and the Trainer's own ``trainer_state.json``: the
longest stalls (gaps between step completions), the steps computed twice (a step completed by more than one
world), the train time (first to last step) against the uninterrupted run's, the final training loss (the
last ``loss`` of the log history) against the uninterrupted run's, and whether the committed steps hold every
sample once per epoch (a global batch of 8 each).

Paced: unpaced, 2,000 steps (the issue's run) train in ~40 s on this 2-core box, and the trace needs ~100 s of
training after its first event (a return's cold start, the 30 s ``--settle``, the notice, the second return):
the job ended with 2 of its 4 events fired. So every step of every mode, the uninterrupted one included,
sleeps ``--step-sleep`` seconds (default 0.05; the ledger's pace file), which lands the whole trace; the
times then measure the pace as much as the launcher. When the job still ends before the trace does, the
bench says so under the table; ``--step-sleep 0`` runs unpaced.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.support.trainer_ledger import Ledger, LedgerProgress, check_every_sample_once, longest_stalls
from bench.support.trainer_workload import PER_DEVICE_BATCH, clm_script, final_loss, train_samples, trainer_env
from elastrain.chaos import ChaosHarness, Trace, elastrain_node_command
from elastrain.log import parse_event_line

NODES = 2
STEP_SLEEP = 0.05
"""Seconds of sleep per step by default: unpaced, the job ends before the trace does (the module's docstring)."""
GLOBAL_BATCH = NODES * PER_DEVICE_BATCH


@dataclass(frozen=True)
class TrainerMode:
    name: str
    launcher_args: tuple[str, ...] = ()
    torchrun: bool = False
    events: bool = True


MODES = (
    TrainerMode("uninterrupted", events=False),
    TrainerMode("default"),
    TrainerMode("restart", ("--live", "false")),
    TrainerMode("torchrun", torchrun=True),
)


@dataclass
class TrainerResult:
    mode: str
    ok: bool
    fired: int = 0
    elapsed_s: float = 0.0
    last_step: int = 0
    stalls: list[float] = field(default_factory=list)
    redone: int | None = None
    train_s: float | None = None
    loss: float | None = None
    loss_step: int | None = None
    exact: bool | None = None
    exact_detail: str = ""
    worker_starts: int | None = None


def node_command(mode: TrainerMode, script: Sequence[str], port: int, run_id: str, checkpoints: Path) -> list[str]:
    if mode.torchrun:
        cmd = elastrain_node_command(script, NODES, port, run_id, ["--monitor-interval=0.1"])
        return [sys.executable, "-m", "torch.distributed.run", *cmd[3:]]  # cmd[:3]: python -m elastrain
    return elastrain_node_command(script, NODES, port, run_id, [*mode.launcher_args, f"--checkpoint-dir={checkpoints}"])


def run_mode(
    mode: TrainerMode, out: Path, steps: int, assets: Path, trace: Trace, timeout_s: float, step_sleep: float, port: int
) -> TrainerResult:
    out.mkdir(parents=True)
    script = clm_script(assets, out / "model", steps)
    env = trainer_env(out / "ledger", out.parent / "hf-cache", step_sleep)
    if mode.torchrun:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a returning node hangs without it (FACTS)
    run_id = f"goodput-trainer-{out.name}-{port}"
    harness = ChaosHarness(
        trace if mode.events else Trace(nodes=NODES),
        lambda _: node_command(mode, script, port, run_id, out / "checkpoints"),
        out / "chaos",
        env=env,
        progress=LedgerProgress(out / "ledger"),
        host_port=port,
    )
    print(f"[goodput] trainer {mode.name}: {steps} steps; logs in {out / 'chaos'}", flush=True)
    chaos = harness.run(timeout_s=timeout_s, stall_s=240.0)
    print(f"[goodput] trainer {mode.name}: {'done' if chaos.succeeded else 'FAILED'} in {chaos.elapsed_s:.0f} s")
    return collect(mode, out, steps)


def collect(mode: TrainerMode, out: Path, steps: int) -> TrainerResult:
    """The figures of one finished mode, from what its run left in ``out``."""
    timeline_file = out / "chaos" / "timeline.json"
    timeline = json.loads(timeline_file.read_text()) if timeline_file.exists() else {}
    done = timeline.get("result") or {}
    ledger = Ledger.read(out / "ledger")
    loss_step, loss = final_loss(out / "model")
    r = TrainerResult(mode.name, bool(done.get("succeeded")) and ledger.last_step() == steps)
    r.fired = sum(1 for e in timeline.get("events", []) if e.get("action") == "fired")
    r.elapsed_s = round(float(done.get("elapsed_s", 0.0)), 1)
    r.last_step, r.loss, r.loss_step = ledger.last_step(), loss, loss_step
    times = ledger.step_times()
    if times:
        r.stalls = longest_stalls(times)
        r.train_s = round(times[-1] - times[0], 1)
        r.redone = len(ledger.redone())
        check = check_every_sample_once(ledger, steps, GLOBAL_BATCH, train_samples(out / "model"))
        r.exact, r.exact_detail = check.ok, "; ".join(check.violations[:3]) or check.detail
    logs = sorted((out / "chaos").glob("node-*.log"))
    r.worker_starts = worker_starts(logs) if logs and not mode.torchrun else None
    return r


def worker_starts(logs: Sequence[Path]) -> int:
    """Worker processes the elastrain agents started (the pids of their ``workers_started`` lines)."""
    pids: set[str] = set()
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            event = parse_event_line(line)
            if event is not None and event.get("event") == "workers_started":
                pids.update(p for p in event.get("pids", "").split(",") if p)
    return len(pids)


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: Sequence[TrainerResult]) -> str:
    base = next((r for r in results if r.mode == "uninterrupted" and r.ok), None)
    head = ["mode", "longest stalls s", "steps computed twice", "train s", "× train", "final loss (step)",
            "Δ loss", "every sample once per epoch", "worker starts"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in results:
        ratio = r.train_s / base.train_s if base and base.train_s and r.train_s else None
        delta = 100 * (r.loss / base.loss - 1) if base and base.loss and r.loss is not None else None
        cells = [
            r.mode + ("" if r.ok else f" (FAILED at step {r.last_step})"),
            ", ".join(map(str, r.stalls)) or "none ≥ 1 s",
            "-" if r.redone is None else str(r.redone),
            _f(r.train_s),
            _f(ratio, "{:.2f}x"),
            f"{_f(r.loss, '{:.4f}')} ({r.loss_step})" if r.loss is not None else "-",
            _f(delta, "{:+.2f}%"),
            "-" if r.exact is None else ("yes" if r.exact else f"NO: {r.exact_detail}"),
            "-" if r.worker_starts is None else str(r.worker_starts),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def targets(default: TrainerResult, base: TrainerResult | None) -> list[str]:
    """Issue 24's "done when" for the Trainer script in the default mode, each with what was measured."""

    def line(ok: bool, what: str, got: str) -> str:
        return f"  [{'PASS' if ok else 'FAIL'}] {what}: {got}"

    ratio = default.train_s / base.train_s if base and base.train_s and default.train_s else None
    delta = abs(default.loss / base.loss - 1) if base and base.loss and default.loss is not None else None
    return [
        "issue 24 targets, Trainer script, default mode:",
        line(default.ok, "reaches max_steps", f"step {default.last_step}"),
        line(default.redone is not None and default.redone <= 1, "at most 1 step computed twice", str(default.redone)),
        line(delta is not None and delta <= 0.03, "final loss within 3%", _f(delta and 100 * delta, "{:.2f}%")),
        line(ratio is not None and ratio <= 1.3, "train wall time <= 1.3x uninterrupted", _f(ratio, "{:.2f}x")),
        line(bool(default.exact), "every sample once per epoch", default.exact_detail),
    ]


def report(results: Sequence[TrainerResult], out: Path, trace_events: int) -> None:
    (out / "goodput.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(table(results))
    short = [r for r in results if r.mode != "uninterrupted" and r.fired < trace_events]
    if short:
        modes = ", ".join(f"{r.mode} ({r.fired} of {trace_events})" for r in short)
        print(f"\nthe trace did not finish before the job ended in: {modes}; a larger --steps or --step-sleep lands it")
    default = next((r for r in results if r.mode == "default"), None)
    if default is not None:
        print("\n" + "\n".join(targets(default, next((r for r in results if r.mode == "uninterrupted"), None))))
