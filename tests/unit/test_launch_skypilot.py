"""SkyPilot: the managed-job task as data, against the kept SkyPilot schema, and the entrypoint's mapping of
SKYPILOT_* variables to elastrain-run."""

from __future__ import annotations

import copy
import os
import shlex
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args

from elastrain.errors import LaunchSpecError
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default
from elastrain.platforms.install import Install
from elastrain.platforms.render import examples_dir, from_yaml, stale_files, to_yaml
from elastrain.platforms.skypilot import example_specs as examples
from elastrain.platforms.skypilot import schema
from elastrain.platforms.skypilot.__main__ import main as sky_main
from elastrain.platforms.skypilot.entrypoint import _parser, elastrain_argv, read_skypilot_env
from elastrain.platforms.skypilot.entrypoint import main as entry_main
from elastrain.platforms.skypilot.spec import SkyPilotJobParams, default_setup, run_argv, task, warnings

pytest.importorskip("jsonschema")

BASE = SkyPilotJobParams(
    name="t5", script=("train.py", "--lr", "0.1"), checkpoint_url="s3://bkt/ckpt", max_nodes=4, infra=("aws", "gcp")
)
SKY_ENV = {
    "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8\n10.0.0.9\n10.0.0.10\n",
    "SKYPILOT_NUM_NODES": "4",
    "SKYPILOT_NODE_RANK": "2",
    "SKYPILOT_TASK_ID": "sky-managed-2026-11-23-10-00-00-000000_t5_3-0",
}


def test_task_fields() -> None:
    t = task(BASE)
    assert (t["name"], t["num_nodes"]) == ("t5", 4)
    assert t["resources"]["use_spot"] is True
    assert t["resources"]["any_of"] == [{"infra": "aws"}, {"infra": "gcp"}]
    assert t["resources"]["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0}
    assert t["setup"] == "TORCH_INDEX=https://download.pytorch.org/whl/cpu tools/install.sh .venv '' s3fs\n"
    assert t["run"].startswith(".venv/bin/python -m elastrain.platforms.skypilot.entrypoint")
    assert shlex.split(t["run"].replace("\\\n", " ")) == run_argv(BASE)
    assert all(isinstance(v, str) for v in t["envs"].values())
    one = task(SkyPilotJobParams(**{**BASE.__dict__, "infra": ("k8s",)}))
    assert one["resources"]["infra"] == "k8s" and "any_of" not in one["resources"]


_CPU = "TORCH_INDEX=https://download.pytorch.org/whl/cpu tools/install.sh"
_CUDA = "TORCH_INDEX=https://download.pytorch.org/whl/cu128 tools/install.sh"


@pytest.mark.parametrize(
    ("change", "setup"),
    [
        ({"checkpoint_url": "s3://b/p"}, f"{_CPU} .venv '' s3fs"),
        ({"checkpoint_url": "gs://b/p", "extras": ("t5",)}, f"{_CPU} .venv t5 gcsfs"),
        (
            {"checkpoint_url": "az://c/p", "accelerators": "L4:1", "rdzv_backend": "etcd-v3", "rdzv_endpoint": "e:1"},
            f"{_CUDA} .venv etcd adlfs",
        ),
    ],
)
def test_default_setup_runs_the_one_install_list(change: dict, setup: str) -> None:
    """tools/install.sh, as ./dev setup and the Dockerfile run it: the script's extras, the rendezvous backend's,
    the bucket's filesystem, and torch's CUDA build on GPU nodes."""
    p = SkyPilotJobParams(**{**BASE.__dict__, **change})
    assert default_setup(p) == setup
    assert Install.parse(setup) == p.install
    assert run_argv(p)[0] == ".venv/bin/python"
    own = SkyPilotJobParams(**{**BASE.__dict__, **change, "setup": "pip install -e ."})
    assert task(own)["setup"] == "pip install -e .\n" and run_argv(own)[0] == "python"


def test_tasks_and_examples_validate_against_the_kept_schema() -> None:
    kept = schema.kept()
    assert kept["release"].startswith("skypilot ") and "sky/utils/schemas.py" in kept["source"]
    schema.validate(task(BASE))
    schema.validate(task(SkyPilotJobParams(**{**BASE.__dict__, "cpus": "8+", "accelerators": "A100:8"})))
    assert stale_files(examples.rendered(), examples_dir(examples.PLATFORM)) == [], (
        "run: python -m elastrain.platforms.skypilot examples --write"
    )
    for text in examples.rendered().values():
        (doc,) = from_yaml(text)
        schema.validate(doc)
    assert from_yaml(to_yaml([task(BASE)])) == [task(BASE)]


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("resources", "use_spots"), True, "use_spots"),
        (("num_nodes",), "4", "num_nodes"),
        (("resources", "job_recovery", "max_restarts_on_errors"), -1, "max_restarts_on_errors"),
        (("resources", "any_of"), [{"infra": "mars"}], "any_of/0"),
        (("resources", "any_of"), [{"cloud": "AWS", "regions": "x"}], "any_of/0"),
        (("envs",), {"1BAD": "x"}, "envs"),
        (("file_mounts",), {"/ckpt": {"source": "s3://b", "mode": "SOMETIMES"}}, "file_mounts"),
        (("runs",), "x", "runs"),
    ],
)
def test_schema_catches_mistakes(path: tuple[str, ...], value: object, where: str) -> None:
    doc = copy.deepcopy(task(BASE))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(LaunchSpecError, match=where):
        schema.validate(doc)


def test_case_insensitive_enum_like_skypilot() -> None:
    doc = copy.deepcopy(task(BASE))
    doc["file_mounts"] = {"/ckpt": {"source": "s3://b", "mode": "mount"}}
    doc["resources"]["any_of"] = [{"cloud": "AWS"}]
    schema.validate(doc)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"name": "has space"}, "name"),
        ({"checkpoint_url": ""}, "checkpoint_url"),
        ({"min_nodes": 5}, "min_nodes"),
        ({"recovery_strategy": "HOPE"}, "recovery_strategy"),
        ({"rdzv_backend": "etcd-v3"}, "rdzv_endpoint"),
        ({"env": (("A B", "1"),)}, "env"),
        ({"preemption_watchers": "oracle"}, "preemption_watchers"),
        ({"extras": ("t5 t6",)}, "extras"),
        ({"file_mounts": (("data", "runs/data"),)}, "file_mounts"),
    ],
)
def test_bad_parameters_name_what_to_change(change: dict, names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        SkyPilotJobParams(**{**BASE.__dict__, **change})


def test_warnings() -> None:
    assert any("head node" in w for w in warnings(BASE))
    local = SkyPilotJobParams(**{**BASE.__dict__, "checkpoint_url": "/tmp/ckpt"})
    assert any("bucket" in w for w in warnings(local))


def test_cli_renders_a_checked_task(capsys: pytest.CaptureFixture[str]) -> None:
    rc = sky_main(["render", "--name", "j", "--checkpoint-url", "gs://b", "--infra", "gcp", "--", "t.py", "--x"])
    out, err = capsys.readouterr()
    assert rc == 0 and "warning:" in err
    (doc,) = from_yaml(out)
    assert doc["resources"]["infra"] == "gcp" and doc["run"].rstrip().endswith("-- t.py --x")
    assert sky_main(["render", "--name", "j", "--checkpoint-url", "gs://b", "--infra", "mars", "--", "t.py"]) == 2
    assert "infra" in capsys.readouterr().err


# -- the entrypoint ---------------------------------------------------------------------------------


def test_read_skypilot_env() -> None:
    node = read_skypilot_env(SKY_ENV)
    assert (node.master_addr, node.node_rank, node.node_count, node.run_id) == (
        "10.0.0.7",
        2,
        4,
        SKY_ENV["SKYPILOT_TASK_ID"],
    )
    single = read_skypilot_env({"SKYPILOT_NODE_IPS": "1.2.3.4", "SKYPILOT_TASK_ID": "t"})
    assert (single.master_addr, single.node_rank, single.node_count) == ("1.2.3.4", 0, 1)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, "SKYPILOT_NODE_IPS"),
        ({**SKY_ENV, "SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES"),
        ({**SKY_ENV, "SKYPILOT_NODE_RANK": "4"}, "rank"),
        ({**SKY_ENV, "SKYPILOT_NODE_RANK": "two"}, "SKYPILOT_NODE_RANK"),
        ({k: v for k, v in SKY_ENV.items() if k != "SKYPILOT_TASK_ID"}, "SKYPILOT_TASK_ID"),
    ],
)
def test_read_skypilot_env_rejects_nonsense(env: dict[str, str], names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        read_skypilot_env(env)


def test_the_rendered_run_reaches_elastrain_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name in ["PET_NNODES", "PET_RDZV_ENDPOINT", "PET_NPROC_PER_NODE"]:
        monkeypatch.delenv(name, raising=False)
    run = run_argv(BASE)
    entry = _parser().parse_args(run[3:])
    argv = elastrain_argv(read_skypilot_env(SKY_ENV), entry)
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv, {})
    options = options_from_args(args)
    config, _cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.run_id) == (1, 4, SKY_ENV["SKYPILOT_TASK_ID"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "10.0.0.7:29400")
    assert options.checkpoint_dir == "s3://bkt/ckpt/t5"
    assert options.preemption_watchers == "auto"  # cloud VMs: watch the spot notices
    assert cmd_args[-3:] == ["train.py", "--lr", "0.1"]


def test_entrypoint_dry_run_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry_main(["--checkpoint-dir", "s3://b/c", "--dry-run", "--", "train.py"], environ=SKY_ENV) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[1:3] == ["-m", "elastrain"] and cmd[cmd.index("--nnodes") + 1] == "1:4"
    assert entry_main(["--checkpoint-dir", "s3://b/c", "--dry-run", "--", "t.py"], environ={}) == 2
    assert "SKYPILOT_NODE_IPS" in capsys.readouterr().err


def test_the_shipped_task_finds_its_workdir_script_imports_and_data_from_the_repository_root() -> None:
    """launch/skypilot/t5-elastic.yaml as `sky jobs launch launch/skypilot/t5-elastic.yaml` from the repository
    root reads it: SkyPilot resolves workdir and local file_mounts sources against the directory it runs in
    (sky/task.py: os.path.abspath), uploads the workdir, and runs setup and run in the uploaded copy."""
    from support.launch_checks import REPO, check_script, script_of

    launch_dir = REPO  # where launch/README.md and the file's header say to run it
    command = examples.LAUNCH
    text = (REPO / command.split()[-1]).read_text()
    assert command in text and examples.PREPARE in text
    (doc,) = from_yaml(text)
    workdir = Path(os.path.abspath(launch_dir / os.path.expanduser(doc["workdir"])))
    assert workdir == REPO, f"workdir {doc['workdir']!r} from {launch_dir} is {workdir}, not the repository root"
    install = Install.parse(doc["setup"].strip())
    assert (workdir / "tools" / "install.sh").is_file()
    run = shlex.split(doc["run"].replace("\\\n", " "))
    assert run[:3] == [install.python, "-m", "elastrain.platforms.skypilot.entrypoint"]
    script_args = run[run.index("--") + 1 :]
    i = script_of(script_args)
    check_script(workdir / script_args[i], script_args[i + 1 :], install.extras, install.requirements)
    # The data every node reads: built by the documented command into the mount's source, copied to each node.
    ((target, source),) = doc["file_mounts"].items()
    assert script_args[script_args.index("--data-dir") + 1] == target
    assert source == examples.DATA and f'"{source}"' in examples.PREPARE
    assert not Path(source).is_absolute()  # resolved against the launch directory, like the workdir
