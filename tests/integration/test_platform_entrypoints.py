"""The Slurm and SkyPilot entrypoints for real: two "nodes" on this machine, each started the way the platform
starts it (its variables, the rendered command), exec elastrain-run, form one world of two and run a worker; and the
step the SkyPilot example asks for before launching, run as its header writes it."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from support.processes import PYTHON, REPO, free_port, reaped, spawn, worker_env

from elastrain.platforms.render import from_yaml
from elastrain.platforms.skypilot import example_specs as sky_examples
from elastrain.platforms.skypilot.spec import SkyPilotJobParams, run_argv
from elastrain.platforms.slurm.spec import SlurmJobParams, srun_argv

pytestmark = pytest.mark.slow

WORKER = """\
import json, os, sys
keys = ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR")
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
"""


def _two_nodes(tmp_path: Path, entry: list[str], node_env: list[dict[str, str]]) -> list[dict[str, str]]:
    """Start ``entry`` once per node with that node's variables; node 0 hosts the c10d store."""
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    for rank, env in enumerate(node_env):
        # On one machine both nodes resolve to 127.0.0.1; say which one hosts the store.
        host = f"--rdzv-conf=is_host={'true' if rank == 0 else 'false'},last_call_timeout=30"
        # entry ends with "-- script [args]": insert elastrain-run's own flag after the separator.
        sep = entry.index("--")
        cmd = [*entry[: sep + 1], host, *entry[sep + 1 :], str(out)]
        procs.append(spawn(cmd, tmp_path / f"node{rank}.log", env={**env, "TORCH_CPP_LOG_LEVEL": "ERROR"}))
    with reaped(*procs):
        for rank, proc in enumerate(procs):
            assert proc.wait(timeout=180) == 0, (tmp_path / f"node{rank}.log").read_text()[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(len(node_env))]


def test_slurm_entrypoint_forms_one_world_from_slurm_variables(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port = free_port()
    p = SlurmJobParams(
        name="t", script=(str(script),), checkpoint_dir=str(tmp_path / "ckpt"), max_nodes=2, python=PYTHON
    )
    step = srun_argv(p)
    entry = step[step.index(PYTHON) :]
    entry[entry.index("--rdzv-port") + 1] = str(port)
    base = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NUM_NODES": "2"}
    seen = _two_nodes(tmp_path, entry, [{**base, "SLURM_NODEID": str(i)} for i in range(2)])
    assert {s["RANK"] for s in seen} == {"0", "1"}
    assert all(s["WORLD_SIZE"] == "2" and s["TORCHELASTIC_RUN_ID"] == "slurm-4242" for s in seen)


def test_skypilot_entrypoint_forms_one_world_from_skypilot_variables(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port = free_port()
    p = SkyPilotJobParams(
        name="t",
        script=(str(script),),
        checkpoint_url=str(tmp_path / "ckpt"),
        max_nodes=2,
        rdzv_endpoint=None,
        preemption_watchers="none",
    )
    entry = [PYTHON, *run_argv(p)[1:]]
    entry[entry.index("--") : entry.index("--")] = ["--rdzv-port", str(port)]
    base = {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_TASK_ID": "sky-t-1"}
    seen = _two_nodes(tmp_path, entry, [{**base, "SKYPILOT_NODE_RANK": str(i)} for i in range(2)])
    assert {s["RANK"] for s in seen} == {"0", "1"}
    assert all(s["WORLD_SIZE"] == "2" and s["TORCHELASTIC_RUN_ID"] == "sky-t-1" for s in seen)


def test_the_skypilot_example_prepares_the_data_every_node_reads(tmp_path: Path) -> None:
    """The header's first command, from a copy of the repository root, builds what the task copies to every node:
    the pairs and the tokenizer train.py reads from --data-dir instead of waiting for another node to build them."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    text = (REPO / sky_examples.LAUNCH.split()[-1]).read_text()
    assert sky_examples.PREPARE in text
    argv = shlex.split(sky_examples.PREPARE)
    assert argv[0] == "python"
    done = subprocess.run(
        [PYTHON, *argv[1:]], cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (doc,) = from_yaml(text)
    ((_target, source),) = doc["file_mounts"].items()
    assert {p.name for p in (tmp_path / source).iterdir()} >= {"pairs.json", "tokenizer.json"}
