"""The Slurm batch script run by bash with stand-ins for srun and scontrol: syntax, SIGTERM, exit status, CPUs."""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path

from support.processes import kill_tree

from elastrain.platforms.slurm.spec import SlurmJobParams, sbatch_script, srun_argv

BASE = SlurmJobParams(name="t5", script=("train.py", "--lr", "0.1"), checkpoint_dir="/shared/ckpt/t5", max_nodes=4)


def test_the_step_runs_one_entrypoint_per_node() -> None:
    script = sbatch_script(BASE)
    joined = script.replace("\\\n", " ")
    step = next(line for line in joined.splitlines() if line.startswith("srun "))
    argv = shlex.split(step.rstrip("&"))
    assert argv == srun_argv(BASE)
    assert argv[:4] == ["srun", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0"]
    assert argv[4:7] == [".venv/bin/python", "-m", "elastrain.platforms.slurm.entrypoint"]
    assert argv[argv.index("--checkpoint-dir") + 1] == "/shared/ckpt/t5"
    assert argv[argv.index("--") :] == ["--", "--save-timeout", "110", "train.py", "--lr", "0.1"]
    # The script itself reads only SLURM_JOB_ID; the entrypoint reads the rest on each node.
    assert set(re.findall(r"\$\{?(SLURM_[A-Z_]+)", script)) == {"SLURM_JOB_ID"}
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)
    # With --cpus-per-task, the step asks for them again: Slurm >= 22.05 does not pass them from sbatch to srun.
    cpus = SlurmJobParams(**{**BASE.__dict__, "cpus_per_node": 8})
    step = next(line for line in sbatch_script(cpus).splitlines() if line.startswith("srun "))
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK}"' in step
    assert "--cpus-per-task=${SLURM_CPUS_PER_TASK}" in srun_argv(cpus)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_script(
    tmp_path: Path, srun_body: str, params: SlurmJobParams = BASE, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    # Stand-ins for Slurm's commands (Slurm is not installed here): they record what the script asks of them.
    _fake(bin_dir, "srun", f'echo "srun $*" >> {log}\n{srun_body}')
    _fake(bin_dir, "scontrol", f'echo "scontrol $*" >> {log}\n')
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(params))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", **(env or {})}
    proc = subprocess.Popen(["bash", str(script)], env=env, text=True, stderr=subprocess.PIPE)
    return proc, log


def test_sigterm_checkpoints_the_step_then_requeues(tmp_path: Path) -> None:
    # The step answers SIGTERM like srun relaying it to the agents: it leaves after a moment.
    proc, log = _run_script(
        tmp_path,
        f"sleep 30 & s=$!\ntrap 'echo step-got-TERM >> {tmp_path}/calls.log; kill $s; exit 143' TERM\n"
        f"touch {tmp_path}/step-ready\nwait\n",
    )
    try:
        deadline = time.monotonic() + 20
        # Both traps are set once the step says it is ready (the script's own is set before srun starts).
        while not (tmp_path / "step-ready").exists():
            assert time.monotonic() < deadline, "the step did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    finally:
        kill_tree(proc.pid)  # the script and the fake step, by PID, if they are still there
        proc.wait(timeout=10)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("srun --ntasks-per-node=1")
    assert lines[1:] == ["step-got-TERM", "scontrol requeue 4242"]
    assert proc.returncode == 0 and "requeueing" in err


def test_the_script_exits_with_the_step_status(tmp_path: Path) -> None:
    proc, log = _run_script(tmp_path, "exit 3\n")
    try:
        proc.communicate(timeout=20)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    assert proc.returncode == 3
    assert "scontrol" not in log.read_text()


def test_the_step_gets_the_jobs_cpus_per_task(tmp_path: Path) -> None:
    """What srun receives when sbatch set SLURM_CPUS_PER_TASK (from #SBATCH --cpus-per-task=32)."""
    params = SlurmJobParams(**{**BASE.__dict__, "cpus_per_node": 32})
    proc, log = _run_script(tmp_path, "exit 0\n", params, {"SLURM_CPUS_PER_TASK": "32"})
    try:
        proc.communicate(timeout=20)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    assert proc.returncode == 0
    assert log.read_text().split()[:4] == ["srun", "--ntasks-per-node=1", "--cpus-per-task=32", "--no-kill"]
