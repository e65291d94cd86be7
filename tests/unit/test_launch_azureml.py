"""The AzureML compute and command-job specs as data, and the entrypoint's mapping of AzureML's variables."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args

from elastrain.errors import LaunchSpecError
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default
from elastrain.platforms import image
from elastrain.platforms.azureml import example_specs as examples
from elastrain.platforms.azureml.__main__ import main as aml_main
from elastrain.platforms.azureml.entrypoint import _parser, elastrain_argv, read_azureml_env, worker_environ
from elastrain.platforms.azureml.entrypoint import main as entry_main
from elastrain.platforms.azureml.spec import (
    AzureMLJobParams,
    check_command_job,
    check_compute,
    command_job,
    compute_cluster,
    entrypoint_command,
    environment_definition,
    warnings,
)
from elastrain.platforms.image import GPU_IMAGE
from elastrain.platforms.render import examples_dir, from_yaml, stale_files, to_yaml

BASE = AzureMLJobParams(script=("train.py", "--lr", "0.1"), compute="lowpri", min_nodes=2, max_nodes=4)
AML_ENV = {
    "MASTER_ADDR": "10.0.0.4",
    "MASTER_PORT": "6105",
    "NODE_RANK": "1",
    "WORLD_SIZE": "4",
    "RANK": "1",
    "LOCAL_RANK": "0",
    "AZUREML_NODE_COUNT": "4",
    "AZUREML_RUN_ID": "quiet_lamp_x1",
}


def test_command_job_fields() -> None:
    job = command_job(BASE)
    check_command_job(job)
    assert job["type"] == "command" and job["compute"] == "azureml:lowpri"
    assert job["resources"] == {"instance_count": 4}
    assert job["distribution"] == {"type": "pytorch", "process_count_per_instance": 1}
    assert job["outputs"]["checkpoints"] == {"type": "uri_folder", "mode": "rw_mount"}
    assert "--checkpoint-dir ${{outputs.checkpoints}}" in job["command"]
    assert job["command"].endswith("-- train.py --lr 0.1")
    assert all(isinstance(v, str) for v in job["environment_variables"].values())
    assert job["environment"] == {"image": GPU_IMAGE}  # inline, the Dockerfile's CUDA build by default
    named = command_job(AzureMLJobParams(**{**BASE.__dict__, "environment": "file:environment.yml"}))
    assert named["environment"] == "file:environment.yml"
    assert environment_definition(BASE)["image"] == GPU_IMAGE


def test_compute_is_low_priority_with_a_node_range() -> None:
    compute = compute_cluster(BASE)
    check_compute(compute)
    assert (compute["tier"], compute["min_instances"], compute["max_instances"]) == ("low_priority", 0, 4)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("type", "sweep", "type"),
        ("distribution", {"type": "mpi", "process_count_per_instance": 1}, "pytorch"),
        ("distribution", {"type": "pytorch", "process_count_per_instance": 4}, "process_count_per_instance"),
        ("resources", {"instance_count": 0}, "instance_count"),
        ("resources", {"instance_count": "4"}, "instance_count"),
        ("compute", "lowpri", "compute"),
        ("environment", "elastrain:1", "environment"),
        ("outputs", {}, "outputs has no 'checkpoints'"),
        ("outputs", {"checkpoints": {"type": "folder"}}, "type"),
        ("environment_variables", {"N": 1}, "environment_variables"),
        ("nodes", 4, "unknown keys"),
    ],
)
def test_check_command_job_catches_mistakes(key: str, value: object, message: str) -> None:
    job = copy.deepcopy(command_job(BASE))
    job[key] = value
    with pytest.raises(LaunchSpecError, match=message):
        check_command_job(job)


def test_check_compute_catches_mistakes() -> None:
    for key, value in (("tier", "spot"), ("min_instances", 5), ("type", "kubernetes"), ("name", "1bad")):
        compute = {**compute_cluster(BASE), key: value}
        with pytest.raises(LaunchSpecError, match=key if key != "min_instances" else "min_instances"):
            check_compute(compute)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"script": ()}, "script"),
        ({"min_nodes": 5}, "min_nodes"),
        ({"rdzv_backend": "etcd-v3"}, "rdzv_endpoint"),
        ({"rdzv_backend": "static"}, "rdzv_backend"),
        ({"compute": "x"}, "compute"),
        ({"preemption_watchers": "oracle"}, "preemption_watchers"),
        ({"environment": "elastrain:1"}, "environment"),
        ({"image": " "}, "image"),
    ],
)
def test_bad_parameters_name_what_to_change(change: dict, names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        AzureMLJobParams(**{**BASE.__dict__, **change})


def test_warns_about_the_c10d_store_on_a_low_priority_node() -> None:
    assert any("MASTER_ADDR" in w for w in warnings(BASE))
    etcd = AzureMLJobParams(**{**BASE.__dict__, "rdzv_backend": "etcd-v3", "rdzv_endpoint": "10.1.0.5:2379"})
    assert not warnings(etcd)
    assert "--rdzv-endpoint 10.1.0.5:2379" in entrypoint_command(etcd)


def test_yaml_round_trip_and_examples_are_current() -> None:
    docs = [compute_cluster(BASE), command_job(BASE)]
    assert from_yaml(to_yaml(docs)) == docs
    assert stale_files(examples.rendered(), examples_dir(examples.PLATFORM)) == [], (
        "run: python -m elastrain.platforms.azureml examples --write"
    )
    rendered = {name: from_yaml(text)[0] for name, text in examples.rendered().items()}
    check_compute(rendered["compute.yaml"])
    check_command_job(rendered["job.yaml"])
    assert rendered["environment.yml"]["image"] == GPU_IMAGE


def test_cli_renders_both_documents(capsys: pytest.CaptureFixture[str]) -> None:
    assert aml_main(["render", "--compute", "lowpri", "--max-nodes", "3", "--", "train.py"]) == 0
    out, err = capsys.readouterr()
    compute, job = from_yaml(out)
    assert compute["max_instances"] == 3 and job["resources"]["instance_count"] == 3
    assert "warning:" in err


# -- the entrypoint ------------------------------------------------------------------------------


def test_read_azureml_env_pytorch_distribution() -> None:
    node = read_azureml_env(AML_ENV)
    assert (node.master_addr, node.master_port, node.node_rank, node.node_count, node.run_id) == (
        "10.0.0.4",
        6105,
        1,
        4,
        "quiet_lamp_x1",
    )


def test_read_azureml_env_mpi_and_local_fallbacks() -> None:
    mpi = read_azureml_env(
        {"AZ_BATCH_MASTER_NODE": "10.0.0.5:6000", "AZ_BATCHAI_TASK_INDEX": "2", "AZUREML_NODE_COUNT": "3"}
    )
    assert (mpi.master_addr, mpi.master_port, mpi.node_rank, mpi.node_count) == ("10.0.0.5", 6000, 2, 3)
    single = read_azureml_env({"AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.6"})
    assert (single.master_addr, single.master_port, single.node_count) == ("10.0.0.6", 29400, 1)
    local = read_azureml_env({})
    assert (local.master_addr, local.node_count, local.run_id) == ("127.0.0.1", 1, "azureml-local")


@pytest.mark.parametrize(
    "env", [{"NODE_RANK": "x"}, {"NODE_RANK": "4", "AZUREML_NODE_COUNT": "4"}, {"AZUREML_NODE_COUNT": "four"}]
)
def test_read_azureml_env_rejects_nonsense(env: dict[str, str]) -> None:
    with pytest.raises(LaunchSpecError):
        read_azureml_env(env)


def test_entrypoint_flags_parse_with_elastrain_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name in [*AML_ENV, "PET_NNODES", "PET_RDZV_ENDPOINT"]:
        monkeypatch.delenv(name, raising=False)
    entry = _parser().parse_args(
        ["--min-nodes", "2", "--checkpoint-dir", "/mnt/out/ckpt", "--", "train.py", "--lr", "1"]
    )
    argv = elastrain_argv(read_azureml_env(AML_ENV), entry)
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv, {})
    options = options_from_args(args)
    config, _cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.run_id) == (2, 4, "quiet_lamp_x1")
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "10.0.0.4:6105")
    assert options.checkpoint_dir == "/mnt/out/ckpt"
    assert options.preemption_watchers == "azure"  # on an AzureML node
    assert cmd_args[-3:] == ["train.py", "--lr", "1"]


def test_entrypoint_user_flags_after_the_separator_win() -> None:
    entry = _parser().parse_args(["--", "--max-restarts", "9", "--preemption-watchers", "none", "train.py"])
    argv = elastrain_argv(read_azureml_env(AML_ENV), entry)
    args = build_parser().parse_args(argv)
    assert (args.max_restarts, args.preemption_watchers, args.training_script) == (9, "none", "train.py")


def test_entrypoint_removes_per_process_variables() -> None:
    env = worker_environ({**AML_ENV, "PATH": "/bin"})
    assert env == {"AZUREML_NODE_COUNT": "4", "AZUREML_RUN_ID": "quiet_lamp_x1", "PATH": "/bin"}


def test_entrypoint_dry_run_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry_main(["--dry-run", "--", "train.py"], environ=AML_ENV) == 0
    out, _ = capsys.readouterr()
    cmd = shlex.split(out)
    assert cmd[1:3] == ["-m", "elastrain"] and "--rdzv-id" in cmd and cmd[-1] == "train.py"
    assert entry_main(["--dry-run"], environ=AML_ENV) == 2
    assert entry_main(["--min-nodes", "5", "--dry-run", "--", "t.py"], environ=AML_ENV) == 2
    assert "--min-nodes" in capsys.readouterr().err


def test_the_azure_sdk_accepts_the_rendered_specs(tmp_path: Path) -> None:
    """Only where the optional extra is installed (elastrain[azure]); the SDK loads specs offline."""
    ml = pytest.importorskip("azure.ai.ml")
    for name, text in examples.rendered().items():
        (tmp_path / name).write_text(text)
    job = ml.load_job(tmp_path / "job.yaml")
    assert job._validate().passed
    assert (job.resources.instance_count, list(job.outputs)) == (4, ["checkpoints"])
    assert ml.load_compute(tmp_path / "compute.yaml").tier == "low_priority"
    inline = tmp_path / "inline.yaml"
    inline.write_text(to_yaml([command_job(BASE)]))
    assert ml.load_job(inline).environment.image == GPU_IMAGE


def test_the_shipped_job_finds_its_code_environment_script_and_imports() -> None:
    """launch/azureml/job.yaml as `az ml job create --file launch/azureml/job.yaml` reads it: relative paths
    resolve against the file's folder; the command runs in the uploaded code folder, in the environment's image."""
    from support.launch_checks import REPO, check_script

    ml = pytest.importorskip("azure.ai.ml")
    folder = REPO / "launch" / "azureml"
    job = ml.load_job(folder / "job.yaml")
    assert job._validate().passed
    code = (folder / job.code).resolve()
    assert code == REPO, f"code: {job.code} uploads {code}, not the repository root"
    # The environment file the job names, found beside it, is the Dockerfile's CUDA build.
    assert job.environment.image == GPU_IMAGE
    env = ml.load_environment(folder / "environment.yml", params_override=[{"name": "elastrain"}])
    assert env.image == GPU_IMAGE
    # What the command runs, in the code folder: the script, with what the image installs.
    command = shlex.split(job.command)
    script_args = command[command.index("--") + 1 :]
    check_script(code / script_args[0], script_args[1:], image.EXTRAS)
    # The script's output folder is the mounted output too: the other nodes read the data rank 0 builds there.
    output_dir = script_args[script_args.index("--output-dir") + 1]
    assert output_dir.startswith("${{outputs.checkpoints}}/")
    for name in ("compute.yaml", "job.yaml", "environment.yml"):
        assert f"--file launch/azureml/{name}" in (folder / name).read_text()
