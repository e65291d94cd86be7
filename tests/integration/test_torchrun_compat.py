"""torchrun compatibility: the same tiny script under torchrun and under elastrain-run.

Each scenario launches tests/workers/probe_env.py with both launchers and compares what the workers
were told (torch's variables, argv, how they were started) and how the job ended.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, free_port, reaped, run, spawn, torchrun_cmd, wait_for

pytestmark = pytest.mark.slow

PROBE = REPO / "tests" / "workers" / "probe_env.py"
SCRIPTS = REPO / "tests" / "workers"
LAUNCHERS = {"torchrun": torchrun_cmd, "elastrain": elastrain_cmd}
# Values that legitimately differ between two runs (ports, ids, paths) or between the two launchers'
# rendezvous handlers (elastrain never shares the agent store with workers: pytorch#135712; a node of a
# loopback rendezvous, --standalone's, advertises 127.0.0.1 where torchrun advertises the FQDN, and its
# workers' gloo/NCCL listen on loopback: see elastrain.binding).
VOLATILE = {
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
}  # fmt: skip


def starts(probe_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(probe_dir.glob("start-*.json"))]


def stable_env(records: list[dict]) -> list[dict]:
    rows = [{k: v for k, v in r["env"].items() if k not in VOLATILE} for r in records]
    return sorted(rows, key=lambda r: (r["RANK"], r.get("TORCHELASTIC_RESTART_COUNT")))


def launch_both(tmp_path: Path, args: list[str], env: dict[str, str] | None = None, timeout: float = 90):
    """Run ``args`` under both launchers at once; ``{tmp}`` in an argument is each run's own directory."""

    def one(name: str) -> tuple[subprocess.CompletedProcess[str], list[dict], Path]:
        probe_dir = tmp_path / name
        probe_dir.mkdir(parents=True)
        full_env = {"PROBE_DIR": str(probe_dir), **(env or {})}
        proc = run(LAUNCHERS[name](*[a.replace("{tmp}", str(probe_dir)) for a in args]), timeout=timeout, env=full_env)
        return proc, starts(probe_dir), probe_dir

    with ThreadPoolExecutor(max_workers=len(LAUNCHERS)) as pool:
        futures = {name: pool.submit(one, name) for name in LAUNCHERS}
        return {name: f.result() for name, f in futures.items()}


def test_standalone_nproc_same_env(tmp_path: Path) -> None:
    res = launch_both(tmp_path, ["--standalone", "--nproc-per-node", "2", str(PROBE), "--flag", "x"])
    (tr, tr_starts, _), (el, el_starts, _) = res["torchrun"], res["elastrain"]
    assert tr.returncode == 0, tr.stderr
    assert el.returncode == 0, el.stderr
    assert stable_env(tr_starts) == stable_env(el_starts)
    assert [r["argv"] for r in el_starts] == [["--flag", "x"]] * 2
    assert {r["env"]["WORLD_SIZE"] for r in el_starts} == {"2"}
    assert {r["env"]["MASTER_ADDR"] for r in el_starts} == {"127.0.0.1"}  # --standalone listens on loopback only
    # elastrain adds its own contract beside torch's.
    assert {r["elastrain"]["ELASTRAIN_START_REASON"] for r in el_starts} == {"first_start"}
    assert "PROBE rank=0" in el.stdout and "PROBE rank=1" in el.stdout


def test_pet_variables(tmp_path: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1", "PET_ROLE": "trainer"}
    res = launch_both(tmp_path, [str(PROBE)], env=env)
    (tr, tr_starts, _), (el, el_starts, _) = res["torchrun"], res["elastrain"]
    assert tr.returncode == 0 and el.returncode == 0, el.stderr
    assert stable_env(tr_starts) == stable_env(el_starts)
    assert {r["env"]["ROLE_NAME"] for r in el_starts} == {"trainer"}
    assert len(el_starts) == 2


def test_module_no_python_and_run_path(tmp_path: Path) -> None:
    cases = {
        "module": ["--standalone", "--nproc-per-node", "1", "-m", "probe_env", "a"],
        "no_python": ["--standalone", "--nproc-per-node", "1", "--no-python", sys.executable, str(PROBE), "a"],
        "run_path": ["--standalone", "--nproc-per-node", "1", "--run-path", str(PROBE), "a"],
    }
    for case, args in cases.items():
        res = launch_both(tmp_path / case, args, env={"PYTHONPATH": str(SCRIPTS)})
        (tr, tr_starts, _), (el, el_starts, _) = res["torchrun"], res["elastrain"]
        assert tr.returncode == 0, (case, tr.stderr[-2000:])
        assert el.returncode == 0, (case, el.stderr[-2000:])
        assert [r["argv"] for r in el_starts] == [r["argv"] for r in tr_starts], case
        assert [r["module"] for r in el_starts] == [r["module"] for r in tr_starts], case
        assert stable_env(tr_starts) == stable_env(el_starts), case


def _log_files(log_dir: Path, name: str) -> list[Path]:
    return sorted(log_dir.glob(f"*/attempt_0/*/{name}"))


def test_redirects_tee_log_dir_and_ranks_filter(tmp_path: Path) -> None:
    for mode in ("redirects", "tee"):
        res = launch_both(
            tmp_path / mode,
            [
                "--standalone",
                "--nproc-per-node",
                "2",
                "--log-dir",
                "{tmp}/logs",
                f"--{mode}",
                "3",
                "--local-ranks-filter",
                "1",
                str(PROBE),
            ],
        )
        for name, (proc, _, probe_dir) in res.items():
            assert proc.returncode == 0, (name, proc.stderr[-2000:])
            files = _log_files(probe_dir / "logs", "stdout.log")
            assert len(files) == 2, (name, mode, list((probe_dir / "logs").rglob("*")))
            assert any("PROBE rank=0" in f.read_text() for f in files)
            assert any("PROBE rank=1" in f.read_text() for f in files)
        shown = {name: ("PROBE rank=0" in p.stdout, "PROBE rank=1" in p.stdout) for name, (p, _, _) in res.items()}
        # Same console behaviour for both launchers (tee shows only the filtered rank; redirects show none).
        assert shown["elastrain"] == shown["torchrun"], (mode, shown)
        if mode == "tee":
            assert shown["elastrain"] == (False, True)


def test_failing_worker_restarted_once_then_root_cause(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(PROBE)]
    res = {}
    for name, cmd in LAUNCHERS.items():
        d = tmp_path / name
        d.mkdir()
        err_file = d / "error.json"
        proc = run(
            cmd(*args),
            timeout=120,
            env={"PROBE_DIR": str(d), "PROBE_FAIL_RANK": "1", "TORCHELASTIC_ERROR_FILE": str(err_file)},
        )
        res[name] = (proc, starts(d), err_file)
    for name, (proc, recs, err_file) in res.items():
        assert proc.returncode != 0, name
        # Two ranks, each started twice: the first start and one restart.
        assert sorted(int(r["env"]["RANK"]) for r in recs) == [0, 0, 1, 1], name
        assert re.search(r"rank\s*:\s*1\b", proc.stderr), (name, proc.stderr[-3000:])
        assert err_file.exists(), name
        assert "probe failure on purpose at rank 1" in err_file.read_text(), name
    el_recs = res["elastrain"][1]
    reasons = sorted(r["elastrain"]["ELASTRAIN_START_REASON"] for r in el_recs)
    assert reasons == ["failure", "failure", "first_start", "first_start"]


def test_two_agents_nnodes_1_2(tmp_path: Path) -> None:
    for name, cmd in LAUNCHERS.items():
        d = tmp_path / name
        d.mkdir()
        port = free_port()
        args = [
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"compat-{name}",
            str(PROBE),
        ]
        env = {"PROBE_DIR": str(d)}
        a = spawn(cmd(*args), d / "node0.log", env=env)
        b = spawn(cmd(*args), d / "node1.log", env=env)
        with reaped(a, b):
            assert a.wait(timeout=120) == 0, (d / "node0.log").read_text()[-3000:]
            assert b.wait(timeout=120) == 0, (d / "node1.log").read_text()[-3000:]
        recs = starts(d)
        assert sorted(int(r["env"]["RANK"]) for r in recs) == [0, 1], name
        assert {r["env"]["WORLD_SIZE"] for r in recs} == {"2"}, name
        assert sorted(r["env"]["GROUP_RANK"] for r in recs) == ["0", "1"], name


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_two_static_nodes_given_one_node_rank_get_one_line_naming_the_flag(tmp_path: Path) -> None:
    """``--nnodes 2`` without ``--rdzv-backend`` is torch's static rendezvous: each node needs its own
    ``--node-rank``. Two nodes left at the default rank 0 both host its store; the second one's port is taken.
    torchrun prints torch's traceback; elastrain-run said nothing useful and retried the round 20 times."""
    port = free_port()
    cmd = elastrain_cmd(
        "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
        str(PROBE), str(tmp_path / "probe"),
    )  # fmt: skip
    first = spawn(cmd, tmp_path / "first.log", cwd=tmp_path)
    with reaped(first):
        wait_for(lambda: _listens(port), 60, what="node 0's store")
        second = run(cmd, timeout=120, cwd=tmp_path)
    assert second.returncode == 2, second.stderr[-4000:]
    lines = [line for line in second.stderr.splitlines() if line.startswith("elastrain-run: error:")]
    assert len(lines) == 1 and "--node-rank" in lines[0] and "--rdzv-backend c10d" in lines[0], second.stderr[-4000:]
    assert "rendezvous_incomplete" not in second.stderr and "Traceback" not in second.stderr, second.stderr[-4000:]
