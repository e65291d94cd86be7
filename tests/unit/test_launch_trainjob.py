"""Kubeflow Trainer v2: the TrainJob and ClusterTrainingRuntime as data, against the kept CRD schemas, and the
PET_* variables the v2 torch plugin gives a pod, through elastrain-run's own parser."""

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
from elastrain.platforms.kubernetes.kubeflow_trainer import (
    TrainJobParams,
    cluster_training_runtime,
    container_argv,
    effective_pod_template,
    expand_kubelet_vars,
    manifests,
    node_env,
    trainer_pet_env,
    trainjob,
    warnings,
)
from elastrain.platforms.render import from_yaml

jsonschema = pytest.importorskip("jsonschema")

BASE = TrainJobParams(name="t5", image="img:1", script=("train.py", "--steps", "10"), min_nodes=2, max_nodes=4)


def _node_job(runtime: dict) -> dict:
    return runtime["spec"]["template"]["spec"]["replicatedJobs"][0]


def test_runtime_is_a_jobset_the_torch_plugin_recognises() -> None:
    rt = cluster_training_runtime(BASE)
    assert (rt["apiVersion"], rt["kind"]) == ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime")
    assert rt["spec"]["mlPolicy"] == {"numNodes": 4, "torch": {}}
    assert rt["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 3}
    job = _node_job(rt)
    assert job["name"] == "node"
    assert job["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    spec = job["template"]["spec"]
    # status: required by the JobSpec of Kubernetes <= 1.34 (strict client-side validators refuse it without).
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert pod["terminationGracePeriodSeconds"] == 90
    assert pod["containers"][0]["name"] == "node"
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]  # each job brings its own claim
    assert "t5" not in str(rt)  # shared by jobs: nothing of one job in it


def test_trainjob_refers_to_the_runtime_and_runs_elastrain_run() -> None:
    tj = trainjob(BASE)
    assert tj["spec"]["runtimeRef"] == {
        "name": "elastrain-torch",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = tj["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["command"]) == (4, 1, ["elastrain-run"])
    assert trainer["image"] == "img:1"
    assert trainer["args"][:6] == [
        "--nnodes",
        "2:4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
    ]
    assert trainer["args"][-3:] == ["train.py", "--steps", "10"]
    claim = manifests(BASE)[1]
    assert [d["kind"] for d in manifests(BASE)] == ["ClusterTrainingRuntime", "PersistentVolumeClaim", "TrainJob"]
    assert (claim["metadata"]["name"], claim["metadata"]["namespace"]) == ("t5-checkpoints", "default")


def test_the_trainjob_mounts_its_own_claim_through_a_runtime_patch() -> None:
    tj, rt = trainjob(BASE), cluster_training_runtime(BASE)
    (patch,) = tj["spec"]["runtimePatches"]
    assert "/" in patch["manager"]  # a domain-prefixed path, as the Trainer's webhook requires
    (node_patch,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node_patch["name"] == "node"
    pod = effective_pod_template(tj, rt)["spec"]
    assert pod["volumes"] == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "t5-checkpoints"}}]
    (node,) = pod["containers"]
    assert node["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/checkpoints"}]
    assert (node["image"], node["command"], node["args"]) == ("img:1", ["elastrain-run"], tj["spec"]["trainer"]["args"])
    other = TrainJobParams(**{**BASE.__dict__, "name": "t6"})
    assert effective_pod_template(trainjob(other), rt)["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "t6-checkpoints"
    }
    none = TrainJobParams(**{**BASE.__dict__, "checkpoint_claim": ""})
    assert "runtimePatches" not in trainjob(none)
    assert "volumes" not in effective_pod_template(trainjob(none), rt)["spec"]


def test_the_v2_pet_variables_reach_elastrain_run_as_an_elastic_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = TrainJobParams(**{**BASE.__dict__, "nproc_per_node": 2, "max_restarts": 5})
    tj, rt = trainjob(p), cluster_training_runtime(p)
    assert trainer_pet_env(tj, rt, 3) == {
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": "t5-node-0-0.t5",
        "PET_MASTER_PORT": "29500",
    }
    for k, v in node_env(tj, rt, 3).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    argv = container_argv(tj, rt, 3)
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv)
    # --nnodes MIN:MAX on the command line wins over the plugin's fixed PET_NNODES.
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_backend, args.rdzv_id) == (
        "2:4",
        "t5-node-0-0.t5:29500",
        "c10d",
        "t5",
    )
    assert options_from_args(args).checkpoint_dir == "/checkpoints/t5"
    config, _cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.run_id) == (2, 4, 2, "t5")
    assert config.max_restarts == 5
    assert cmd_args[-3:] == ["train.py", "--steps", "10"]


def test_etcd_v3_endpoint_is_not_a_pod() -> None:
    p = TrainJobParams(**{**BASE.__dict__, "rdzv_backend": "etcd-v3", "rdzv_endpoint": "etcd.infra.svc:2379"})
    argv = container_argv(trainjob(p), cluster_training_runtime(p), 0)
    assert argv[argv.index("--rdzv-endpoint") + 1] == "etcd.infra.svc:2379"
    assert not any("c10d" in w for w in warnings(p))
    assert any("t5-node-0-0" in w for w in warnings(BASE))


@pytest.mark.parametrize(
    ("resources", "nproc"),
    [
        ({}, "1"),
        ({"requests": {"cpu": "4"}}, "4"),
        ({"requests": {"cpu": "1500m"}}, "2"),  # Quantity.Value() rounds up
        ({"limits": {"cpu": "3"}}, "3"),
        ({"limits": {"nvidia.com/gpu": 2}}, "auto"),  # torchrun counts the GPUs
    ],
)
def test_auto_processes_per_node_follow_the_plugin(resources: dict, nproc: str) -> None:
    tj = copy.deepcopy(trainjob(BASE))
    del tj["spec"]["trainer"]["numProcPerNode"]
    tj["spec"]["trainer"]["resourcesPerNode"] = resources
    assert trainer_pet_env(tj, cluster_training_runtime(BASE), 0)["PET_NPROC_PER_NODE"] == nproc


def test_node_count_falls_back_to_the_runtime_and_index_is_checked() -> None:
    tj = copy.deepcopy(trainjob(BASE))
    del tj["spec"]["trainer"]["numNodes"]
    rt = cluster_training_runtime(TrainJobParams(**{**BASE.__dict__, "max_nodes": 6}))
    assert trainer_pet_env(tj, rt, 5)["PET_NNODES"] == "6"
    with pytest.raises(LaunchSpecError, match="completion_index"):
        trainer_pet_env(tj, rt, 6)


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("$(A):$(B)", "host:29500"),
        ("$$(A)", "$(A)"),  # $$ escapes
        ("$(MISSING)", "$(MISSING)"),  # unknown stays as written
        ("x$(A)y", "xhosty"),
        ("$A", "$A"),
    ],
)
def test_kubelet_expansion(arg: str, expanded: str) -> None:
    assert expand_kubelet_vars([arg], {"A": "host", "B": "29500"}) == [expanded]


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"rdzv_backend": "etcd-v2", "rdzv_endpoint": "e:2379"}, "rdzv_backend"),
        ({"rdzv_endpoint": "somewhere:1"}, "rdzv_endpoint"),
        ({"runtime_name": "Bad_Runtime"}, "runtime_name"),
        ({"pod_restarts": -1}, "pod_restarts"),
        ({"min_nodes": 5}, "min_nodes"),
    ],
)
def test_bad_parameters_name_what_to_change(change: dict, names: str) -> None:
    with pytest.raises(LaunchSpecError, match=names):
        TrainJobParams(**{**BASE.__dict__, **change})


def test_kept_schemas_say_where_they_come_from() -> None:
    for kind in schema.TRAINER_SCHEMAS:
        kept = schema.trainer_schema(kind)
        assert kept["release"].startswith("v2.") and kept["source"].startswith("https://github.com/kubeflow/trainer/")
        assert kept["openAPIV3Schema"]["properties"]["kind"]["type"] == "string"
        jsonschema.Draft7Validator.check_schema(kept["openAPIV3Schema"])


def test_rendered_objects_validate_against_the_crd_schemas() -> None:
    schema.validate([cluster_training_runtime(BASE), trainjob(BASE)])
    p = TrainJobParams(**{**BASE.__dict__, "gpus": 2, "cpu": "500m", "memory": "8Gi", "env": (("A", "1"),)})
    schema.validate([cluster_training_runtime(p), trainjob(p)])
    for name, text in examples.rendered().items():
        if name.startswith("trainjob"):
            for doc in from_yaml(text):
                if doc["kind"] != "PersistentVolumeClaim":
                    schema.validate_trainer(doc)


def _set(doc: dict, path: tuple[str | int, ...], value: object) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


_POD = ("spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec")


@pytest.mark.parametrize(
    ("kind", "path", "value", "where"),
    [
        ("TrainJob", ("spec", "trainer", "numNode"), 3, "numNode"),
        ("TrainJob", ("spec", "trainer", "numNodes"), "4", "numNodes"),
        ("TrainJob", ("spec", "runtimeRef"), {"kind": "ClusterTrainingRuntime"}, "name"),
        ("TrainJob", ("spec", "trainer", "args"), ["x"] * 200, "args"),
        ("TrainJob", ("metadata", "name"), "Not_A_Label", "metadata/name"),
        ("ClusterTrainingRuntime", (*_POD, "terminationGracePeriod"), 30, "terminationGracePeriod"),
        ("ClusterTrainingRuntime", (*_POD, "containers", 0, "command"), "elastrain-run", "command"),
        (
            "ClusterTrainingRuntime",
            ("spec", "template", "spec", "failurePolicy", "restartStrategy"),
            "Sometimes",
            "restartStrategy",
        ),
        ("ClusterTrainingRuntime", ("apiVersion",), "kubeflow.org/v1", "apiVersion"),
    ],
)
def test_schema_catches_mistakes(kind: str, path: tuple, value: object, where: str) -> None:
    doc = trainjob(BASE) if kind == "TrainJob" else cluster_training_runtime(BASE)
    with pytest.raises(LaunchSpecError, match=where):
        schema.validate([_set(doc, path, value)])


def test_strict_schema_closes_objects_but_not_preserved_ones() -> None:
    s = schema.strict_schema(
        {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "string"}}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}},
                "m": {"type": "object", "additionalProperties": {"type": "string"}},
                "l": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "integer"}}}},
            },
        }
    )
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["free"]
    assert s["properties"]["m"]["additionalProperties"] == {"type": "string"}
    assert s["properties"]["l"]["items"]["additionalProperties"] is False


def test_crd_schema_takes_one_version_without_descriptions() -> None:
    root = {"description": "d", "type": "object", "properties": {"a": {"description": "d", "type": "string"}}}
    crd = {
        "metadata": {"name": "x.example.com"},
        "spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": root}}]},
    }
    assert schema.crd_schema(crd, "v1") == {"type": "object", "properties": {"a": {"type": "string"}}}
    with pytest.raises(LaunchSpecError, match="v2"):
        schema.crd_schema(crd, "v2")


def test_cli_renders_validates_and_prints_the_pod_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = k8s_main(["trainjob", "--name", "job", "--image", "img", "--max-nodes", "3", "--validate", "--", "train.py"])
    out, err = capsys.readouterr()
    assert rc == 0 and "warning:" in err
    assert [d["kind"] for d in from_yaml(out)] == ["ClusterTrainingRuntime", "PersistentVolumeClaim", "TrainJob"]
    (tmp_path / "job.yaml").write_text(out)
    assert k8s_main(["env", str(tmp_path / "job.yaml")]) == 0
    env_out = capsys.readouterr().out
    assert "PET_MASTER_ADDR=job-node-0-0.job" in env_out and "--rdzv-endpoint job-node-0-0.job:29500" in env_out
    assert k8s_main(["trainjob", "--name", "job", "--image", "img", "--rdzv-backend", "etcd-v2", "--", "t.py"]) == 2
