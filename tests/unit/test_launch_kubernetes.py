"""The Kubernetes manifests, checked as data and against schemas, and the PET_* variables they lead to."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args

from elastrain.errors import LaunchSpecError
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default
from elastrain.platforms.kubernetes import example_specs as examples
from elastrain.platforms.kubernetes import schema
from elastrain.platforms.kubernetes.__main__ import main as k8s_main
from elastrain.platforms.kubernetes.spec import (
    PyTorchJobParams,
    etcd_manifests,
    kubeflow_pet_env,
    manifests,
    pytorchjob,
    warnings,
)
from elastrain.platforms.render import examples_dir, from_yaml, stale_files, to_yaml

BASE = PyTorchJobParams(name="t5", image="img:1", script=("train.py", "--steps", "10"), min_nodes=2, max_nodes=4)


def _container(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def test_pytorchjob_fields() -> None:
    job = pytorchjob(BASE)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "t5")
    ep = job["spec"]["elasticPolicy"]
    assert ep == {
        "minReplicas": 2,
        "maxReplicas": 4,
        "rdzvBackend": "c10d",
        "rdzvHost": "t5-worker-0",
        "rdzvPort": 29400,
        "rdzvId": "t5",
        "nProcPerNode": 1,
        "maxRestarts": 3,
    }
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: no special master
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    pod = worker["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 90
    c = _container(job)
    assert c["name"] == "pytorch" and c["ports"][0]["name"] == "pytorchjob-port"  # what the operator looks for
    assert c["command"] == ["elastrain-run"]
    assert c["args"][-3:] == ["train.py", "--steps", "10"]
    assert c["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/checkpoints"}]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "t5-checkpoints"


def test_manifests_include_a_shared_checkpoint_claim() -> None:
    claim, job = manifests(BASE)
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "t5-checkpoints"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert job["kind"] == "PyTorchJob"
    no_create = PyTorchJobParams(**{**BASE.__dict__, "create_claim": False, "checkpoint_claim": "shared"})
    (job_only,) = manifests(no_create)
    assert job_only["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][0][
        "persistentVolumeClaim"
    ] == {"claimName": "shared"}


def test_every_pet_variable_kubeflow_injects_reaches_elastrain_run_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = pytorchjob(PyTorchJobParams(**{**BASE.__dict__, "nproc_per_node": 2, "max_restarts": 5}))
    env = kubeflow_pet_env(job)
    assert env == {
        "PET_RDZV_ENDPOINT": "t5-worker-0:29400",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "2:4",
        "PET_MAX_RESTARTS": "5",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ID": "t5",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    argv = _container(job)["args"]
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv)
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_backend, args.rdzv_id) == (
        "2:4",
        "t5-worker-0:29400",
        "c10d",
        "t5",
    )
    assert (args.max_restarts, str(args.nproc_per_node)) == (5, "2")
    options = options_from_args(args)
    assert options.checkpoint_dir == "/checkpoints/t5"
    assert options.preemption_watchers == "auto"
    config, _cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.run_id) == (2, 4, 2, "t5")
    assert config.max_restarts == 5
    assert cmd_args[-3:] == ["train.py", "--steps", "10"]


def test_kubeflow_default_endpoint_model() -> None:
    job = copy.deepcopy(pytorchjob(BASE))
    del job["spec"]["elasticPolicy"]["rdzvHost"], job["spec"]["elasticPolicy"]["rdzvPort"]
    # Without rdzvHost/rdzvPort the operator uses <job>-worker-0 and the container's pytorchjob-port.
    assert kubeflow_pet_env(job)["PET_RDZV_ENDPOINT"] == "t5-worker-0:29400"


def test_etcd_v3_puts_the_rendezvous_outside_the_job() -> None:
    p = PyTorchJobParams(**{**BASE.__dict__, "rdzv_backend": "etcd-v3", "rdzv_endpoint": "etcd.infra.svc:2379"})
    env = kubeflow_pet_env(pytorchjob(p))
    assert (env["PET_RDZV_BACKEND"], env["PET_RDZV_ENDPOINT"]) == ("etcd-v3", "etcd.infra.svc:2379")
    assert not any("c10d" in w for w in warnings(p))


def test_warns_when_the_rendezvous_host_is_a_preemptible_worker() -> None:
    notes = warnings(BASE)
    assert any("t5-worker-0" in w and "etcd-v3" in w for w in notes)
    explicit = PyTorchJobParams(**{**BASE.__dict__, "rdzv_endpoint": "t5-worker-2:29400"})
    assert any("t5-worker-2" in w for w in warnings(explicit))
    assert any("checkpoint" in w for w in warnings(PyTorchJobParams(**{**BASE.__dict__, "checkpoint_claim": ""})))
    assert any("grace" in w for w in warnings(PyTorchJobParams(**{**BASE.__dict__, "grace_period_s": 5})))


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"name": "T5_Job"}, "name"),
        ({"name": "x" * 60}, "name"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"rdzv_backend": "zookeeper"}, "rdzv_backend"),
        ({"rdzv_backend": "etcd-v3"}, "rdzv_endpoint"),
        ({"rdzv_endpoint": "nohost"}, "rdzv_endpoint"),
        ({"script": ()}, "script"),
        ({"image": " "}, "image"),
        ({"memory": "lots"}, "memory"),
        ({"preemption_watchers": "oracle"}, "preemption_watchers"),
        ({"checkpoint_mount": "ckpt"}, "checkpoint_mount"),
    ],
)
def test_bad_parameters_name_what_to_change(change: dict, names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        PyTorchJobParams(**{**BASE.__dict__, **change})


def test_manifests_validate_against_the_schemas() -> None:
    pytest.importorskip("kubernetes_validate")
    schema.validate(manifests(BASE))
    schema.validate(etcd_manifests())
    p = PyTorchJobParams(**{**BASE.__dict__, "gpus": 2, "cpu": "500m", "memory": "8Gi", "env": (("A", "1"),)})
    schema.validate(manifests(p))


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("spec", "elasticPolicy", "minReplica"), 1, "elasticPolicy"),
        (("spec", "elasticPolicy", "maxReplicas"), "4", "maxReplicas"),
        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes", "restartPolicy"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "terminationGracePeriod"), 30, "template"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers"), [{"image": "x"}], "template"),
    ],
)
def test_schema_catches_mistakes(path: tuple[str, ...], value: object, where: str) -> None:
    pytest.importorskip("kubernetes_validate")
    job = copy.deepcopy(pytorchjob(BASE))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(LaunchSpecError, match=where):
        schema.validate([job])


def test_yaml_round_trip_and_rendered_examples_are_current() -> None:
    docs = manifests(BASE)
    assert from_yaml(to_yaml(docs)) == docs
    assert stale_files(examples.rendered(), examples_dir(examples.PLATFORM)) == [], (
        "run: python -m elastrain.platforms.kubernetes examples --write"
    )
    pytest.importorskip("kubernetes_validate")
    for text in examples.rendered().values():
        schema.validate(from_yaml(text))


def test_cli_renders_yaml_and_warns(capsys: pytest.CaptureFixture[str]) -> None:
    rc = k8s_main(["render", "--name", "job", "--image", "img", "--max-nodes", "3", "--", "train.py", "--x", "1"])
    out, err = capsys.readouterr()
    assert rc == 0
    kinds = [d["kind"] for d in from_yaml(out)]
    assert kinds == ["PersistentVolumeClaim", "PyTorchJob"]
    assert "warning:" in err and "job-worker-0" in err
    assert k8s_main(["render", "--name", "Bad_Name", "--image", "img", "--", "t.py"]) == 2
    assert "name" in capsys.readouterr().err
