"""Slurm: the host-list expander, the sbatch script as data, and the entrypoint's mapping of SLURM_* variables to
elastrain-run (the script run by bash, its SIGTERM trap included: tests/integration/test_launch_slurm_script.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args

from elastrain.errors import LaunchSpecError
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default
from elastrain.platforms.install import Install
from elastrain.platforms.render import examples_dir, stale_files
from elastrain.platforms.slurm import example_specs as examples
from elastrain.platforms.slurm.__main__ import main as slurm_main
from elastrain.platforms.slurm.entrypoint import _parser, elastrain_argv, read_slurm_env
from elastrain.platforms.slurm.entrypoint import main as entry_main
from elastrain.platforms.slurm.hostlist import expand_hostlist, first_host
from elastrain.platforms.slurm.spec import SlurmJobParams, sbatch_directives, sbatch_script, srun_argv, warnings

BASE = SlurmJobParams(name="t5", script=("train.py", "--lr", "0.1"), checkpoint_dir="/shared/ckpt/t5", max_nodes=4)
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_RESTART_COUNT": "1",
    "SLURM_PROCID": "2",
}


# -- host lists -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("n[1,3-4]-ib", ["n1-ib", "n3-ib", "n4-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b,c", ["a", "b", "c"]),
        ("x[5]", ["x5"]),
        ("  n[1-2]  ", ["n1", "n2"]),
        ("host-1.cluster,host-2.cluster", ["host-1.cluster", "host-2.cluster"]),
        ("[1-2]", ["1", "2"]),
        # Slurm splits host lists on whitespace as well as commas.
        ("n1 n2", ["n1", "n2"]),
        ("n[1-2] gpu5", ["n1", "n2", "gpu5"]),
        ("a, b", ["a", "b"]),
        ("a ,b", ["a", "b"]),
        ("a\tb\nc", ["a", "b", "c"]),
        ("n[1, 3] x", ["n1", "n3", "x"]),  # inside brackets, whitespace is not a separator
        ("  r[1-2]n1   r3n[1-2] ", ["r1n1", "r2n1", "r3n1", "r3n2"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize(
    "text",
    ["", "n[1-", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]", "a,,b", "n[1-2000000]", "n[]", ",", "a, ,b", ",a", "a,", " "],
)
def test_expand_hostlist_rejects_nonsense(text: str) -> None:
    with pytest.raises(LaunchSpecError, match="host list"):
        expand_hostlist(text)


# -- the sbatch script ------------------------------------------------------------------------------


def _directives(script: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH ") :].partition("=")
            out[key] = value or None
    return out


def test_sbatch_directives() -> None:
    script = sbatch_script(BASE)
    d = _directives(script)
    assert d == dict(sbatch_directives(BASE))
    assert d["--nodes"] == "1-4" and d["--ntasks-per-node"] == "1"
    assert "--requeue" in d and "--no-kill" in d and d["--signal"] == "B:TERM@120"
    # sbatch reads directives only before the first command.
    first_command = next(i for i, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH"))
    fixed = SlurmJobParams(**{**BASE.__dict__, "min_nodes": 4, "gpus_per_node": 8, "partition": "spot"})
    assert dict(sbatch_directives(fixed))["--nodes"] == "4"
    assert dict(sbatch_directives(fixed))["--gpus-per-node"] == "8"


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"name": "has space"}, "name"),
        ({"min_nodes": 5}, "min_nodes"),
        ({"nproc_per_node": "many"}, "nproc_per_node"),
        ({"time_limit": "soon"}, "time_limit"),
        ({"grace_period_s": 5}, "grace_period_s"),
        ({"rdzv_backend": "etcd-v3"}, "rdzv_endpoint"),
        ({"rdzv_backend": "static"}, "rdzv_backend"),
        ({"checkpoint_dir": " "}, "checkpoint_dir"),
        ({"env": (("1BAD", "x"),)}, "env"),
        ({"preemption_watchers": "oracle"}, "preemption_watchers"),
        ({"extras": ("t 5",)}, "extras"),
    ],
)
def test_bad_parameters_name_what_to_change(change: dict, names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        SlurmJobParams(**{**BASE.__dict__, **change})


def test_examples_are_current_and_the_cli_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert stale_files(examples.rendered(), examples_dir(examples.PLATFORM)) == [], (
        "run: python -m elastrain.platforms.slurm examples --write"
    )
    assert any("first node" in w for w in warnings(BASE))
    rc = slurm_main(["render", "--name", "j", "--checkpoint-dir", "/c", "--max-nodes", "3", "--", "t.py"])
    out, err = capsys.readouterr()
    assert rc == 0 and "#SBATCH --nodes=1-3" in out and "warning:" in err
    assert slurm_main(["render", "--name", "j", "--checkpoint-dir", "/c", "--min-nodes", "0", "--", "t.py"]) == 2


# -- the entrypoint ---------------------------------------------------------------------------------


def test_read_slurm_env() -> None:
    node = read_slurm_env(SLURM_ENV)
    assert (node.master_addr, node.master_port, node.node_rank, node.node_count, node.run_id) == (
        "gpu07",
        29400,
        2,
        4,
        "slurm-4242",
    )
    assert node.restart_count == 1
    legacy = read_slurm_env({"SLURM_JOBID": "7", "SLURM_NODELIST": "a[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "0"})
    assert (legacy.master_addr, legacy.node_count, legacy.run_id) == ("a1", 2, "slurm-7")
    array = read_slurm_env({**SLURM_ENV, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"})
    assert array.run_id == "slurm-4240_2"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, "SLURM_JOB_NODELIST"),
        ({**SLURM_ENV, "SLURM_NODEID": "4"}, "rank"),
        ({**SLURM_ENV, "SLURM_JOB_NUM_NODES": "four"}, "SLURM_JOB_NUM_NODES"),
        ({k: v for k, v in SLURM_ENV.items() if k != "SLURM_NODEID"}, "SLURM_NODEID"),
        ({k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_ID"}, "SLURM_JOB_ID"),
        ({**SLURM_ENV, "SLURM_JOB_NODELIST": "gpu[07-"}, "host list"),
    ],
)
def test_read_slurm_env_rejects_nonsense(env: dict[str, str], names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        read_slurm_env(env)


def test_the_rendered_step_reaches_elastrain_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What srun runs on node 2, through the entrypoint's mapping, into elastrain-run's own parser."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name in ["PET_NNODES", "PET_RDZV_ENDPOINT", "PET_NPROC_PER_NODE"]:
        monkeypatch.delenv(name, raising=False)
    step = srun_argv(BASE)
    entry = _parser().parse_args(step[step.index("elastrain.platforms.slurm.entrypoint") + 1 :])
    argv = elastrain_argv(read_slurm_env(SLURM_ENV), entry)
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv, {})
    options = options_from_args(args)
    config, _cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.run_id) == (1, 4, "slurm-4242")
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "gpu07:29400")
    assert options.checkpoint_dir == "/shared/ckpt/t5"
    assert options.preemption_watchers == "none"
    assert cmd_args[-3:] == ["train.py", "--lr", "0.1"]


def test_entrypoint_dry_run_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry_main(["--checkpoint-dir", "/c", "--dry-run", "--", "train.py"], environ=SLURM_ENV) == 0
    out, err = capsys.readouterr()
    cmd = shlex.split(out)
    assert cmd[1:3] == ["-m", "elastrain"] and cmd[cmd.index("--rdzv-id") + 1] == "slurm-4242"
    assert "restart_count=1" in err
    assert entry_main(["--checkpoint-dir", "/c", "--dry-run", "--", "t.py"], environ={}) == 2
    assert "SLURM_JOB_NODELIST" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --checkpoint-dir is required: no default folder is shared
        entry_main(["--dry-run", "--", "t.py"], environ=SLURM_ENV)


def test_the_shipped_script_finds_its_environment_script_and_imports_from_the_submit_directory() -> None:
    """launch/slurm/t5-elastic.sbatch as `sbatch launch/slurm/t5-elastic.sbatch` from the repository root runs it:
    in the submit directory, with the environment its header's install command makes there."""
    from support.launch_checks import REPO, check_script, script_of

    text = (REPO / examples.SUBMIT.split()[-1]).read_text()
    submit_dir = REPO
    header = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("# ")]
    assert any(line.endswith(examples.SUBMIT) and "repository root" in line for line in header)
    install = Install.parse(next(line for line in header if "tools/install.sh" in line))
    assert (submit_dir / "tools" / "install.sh").is_file()
    joined = text.replace("\\\n", " ")
    step = shlex.split(next(line for line in joined.splitlines() if line.startswith("srun ")).rstrip("&"))
    python = step[step.index("-m") - 1]
    assert python == install.python and not Path(python).is_absolute()  # the submit directory's .venv
    script_args = step[step.index("--") + 1 :]
    i = script_of(script_args)
    check_script(submit_dir / script_args[i], script_args[i + 1 :], install.extras, install.requirements)
    assert install.variant == "cu128"  # the nodes have GPUs
    # Checkpoints and the script's output (the data rank 0 builds for the others) on the shared filesystem.
    shared = Path(step[step.index("--checkpoint-dir") + 1]).parents[1]
    assert Path(script_args[script_args.index("--output-dir") + 1]).is_relative_to(shared)


def test_the_requeue_conditions_are_said_where_a_user_reads_them() -> None:
    """Time limit (--signal=B:TERM), preemption only with PreemptMode=REQUEUE or send_user_signal, and not under
    PreemptMode=CANCEL: in the script's own comments and in launch/README.md."""
    from support.launch_checks import REPO

    script = sbatch_script(BASE)
    for text in (script, (REPO / "launch" / "README.md").read_text()):
        for condition in ("PreemptMode=REQUEUE", "send_user_signal", "PreemptMode=CANCEL"):
            assert condition in text
    assert "requeued on preemption" not in (REPO / "launch" / "README.md").read_text()
