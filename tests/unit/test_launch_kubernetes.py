"""The Kubernetes manifests, checked as data and against schemas, and the PET_* variables they lead to."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args

from elastrain.errors import LaunchSpecError
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default
from elastrain.platforms import image
from elastrain.platforms.image import default_image
from elastrain.platforms.kubernetes import example_specs as examples
from elastrain.platforms.kubernetes import schema
from elastrain.platforms.kubernetes.__main__ import main as k8s_main
from elastrain.platforms.kubernetes.spec import (
    DEFAULT_STORAGE_CLASS,
    PyTorchJobParams,
    etcd_manifests,
    kubeflow_pet_env,
    manifests,
    pytorchjob,
    warnings,
)
from elastrain.platforms.render import examples_dir, from_yaml, stale_files, to_yaml

BASE = PyTorchJobParams(name="t5", image="img:1", script=("train.py", "--steps", "10"), min_nodes=2, max_nodes=4)
REPO = Path(__file__).resolve().parents[2]


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
        "maxRestarts": 3,
    }
    # The v1.7+ field; the operator's webhook warns that elasticPolicy.nProcPerNode is deprecated.
    assert job["spec"]["nprocPerNode"] == "1"
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
    # A default class is usually single-writer: a ReadWriteMany claim on it stays Pending. Name one.
    assert claim["spec"]["storageClassName"] == DEFAULT_STORAGE_CLASS == "standard-rwx"
    azure = PyTorchJobParams(**{**BASE.__dict__, "storage_class": "azurefile-csi"})
    assert manifests(azure)[0]["spec"]["storageClassName"] == "azurefile-csi"
    assert manifests(PyTorchJobParams(**{**BASE.__dict__, "storage_class": ""}))[0]["spec"]["storageClassName"] == ""
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
        ({"storage_class": "Not A Class"}, "storage_class"),
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


@pytest.mark.parametrize(
    ("spec_fields", "elastic_fields", "nproc"),
    [
        ({"nprocPerNode": "4"}, {}, "4"),
        ({}, {"nProcPerNode": 2}, "2"),  # the deprecated field, where only it is set
        ({}, {}, "auto"),  # the operator's defaulter
    ],
)
def test_processes_per_node_follow_the_v1_9_operator(spec_fields: dict, elastic_fields: dict, nproc: str) -> None:
    job = copy.deepcopy(pytorchjob(BASE))
    del job["spec"]["nprocPerNode"]
    job["spec"].update(spec_fields)
    job["spec"]["elasticPolicy"].update(elastic_fields)
    assert kubeflow_pet_env(job)["PET_NPROC_PER_NODE"] == nproc


def _shipped() -> dict[str, list[dict]]:
    folder = REPO / "launch" / "kubernetes"
    return {path.name: from_yaml(path.read_text()) for path in sorted(folder.glob("*.yaml"))}


def test_every_kubernetes_file_passes_the_strict_validators_of_1_30_to_1_37() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    assert tuple(f"1.{m}" for m in range(30, 38)) == schema.KUBERNETES_VERSIONS
    for version in schema.KUBERNETES_VERSIONS:  # kubernetes-validate carries each one's schemas
        kv.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, version, strict=True)
    shipped = _shipped()
    assert set(shipped) == set(examples.rendered())
    for name, docs in shipped.items():
        try:
            schema.validate(docs)  # every version, and the Trainer CRDs for the v2 kinds
        except LaunchSpecError as exc:
            pytest.fail(f"launch/kubernetes/{name}: {exc}")


def test_the_validators_catch_what_only_some_versions_require() -> None:
    pytest.importorskip("kubernetes_validate")
    from elastrain.platforms.kubernetes.kubeflow_trainer import TrainJobParams, cluster_training_runtime

    runtime = cluster_training_runtime(TrainJobParams(name="t5", script=("train.py",)))
    job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    del job["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["status"]
    schema.validate_trainer(runtime)  # the v2.3.0 CRD inlines a newer JobSpec, where status is optional
    with pytest.raises(LaunchSpecError, match=r"status.*Kubernetes 1\.30"):
        schema.validate([runtime])


def _pods(docs: list[dict]) -> list[tuple[str, dict, str]]:
    """(job name, the pod template its nodes run, its rendezvous backend) for each job in a file."""
    from elastrain.platforms.kubernetes.kubeflow_trainer import effective_pod_template

    runtimes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterTrainingRuntime"}
    out = []
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            template = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
            out.append((doc["metadata"]["name"], template, doc["spec"]["elasticPolicy"]["rdzvBackend"]))
        elif doc["kind"] == "TrainJob":
            runtime = runtimes[doc["spec"]["runtimeRef"]["name"]]
            args = doc["spec"]["trainer"]["args"]
            backend = args[args.index("--rdzv-backend") + 1]
            out.append((doc["metadata"]["name"], effective_pod_template(doc, runtime), backend))
    return out


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_each_job_finds_its_image_script_imports_and_shared_folders() -> None:
    """What a pod of each shipped job needs: the default image of its kind (CUDA for GPUs), the script in the
    image's checkout with everything it imports installed, and its checkpoint and output folders on the job's
    own ReadWriteMany claim (the other nodes read the data rank 0 writes there)."""
    from support.launch_checks import check_image_script

    for fname, docs in _shipped().items():
        claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
        for job_name, template, backend in _pods(docs):
            pod = template["spec"]
            container = pod["containers"][0]
            gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            assert container["image"] == default_image(gpus > 0), f"{fname}: {job_name}"
            args = container["args"]
            check_image_script(args)
            assert backend in ("c10d", "etcd-v3")
            if backend == "etcd-v3":  # python3-etcd3, elastrain's etcd extra
                assert "etcd" in image.EXTRAS
            volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])}
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            claim_names = {volumes[m["name"]] for m in container["volumeMounts"]}
            assert claim_names == {f"{job_name}-checkpoints"}, f"{fname}: {job_name} mounts {claim_names}"
            for claim in claim_names:
                spec = claims[claim]["spec"]
                assert spec["accessModes"] == ["ReadWriteMany"] and spec["storageClassName"] == DEFAULT_STORAGE_CLASS
            for flag in ("--checkpoint-dir", "--output-dir"):
                folder = args[args.index(flag) + 1]
                assert _under(folder, mounts), f"{fname}: {job_name}: {flag} {folder} is not on the claim"


def test_no_two_files_define_the_same_object_and_each_claim_is_one_jobs() -> None:
    """Applying every file leaves each one's objects as it wrote them: no name is declared twice (a TrainJob's
    claim used to be fixed inside the shared runtime, so both TrainJob files declared it with different labels)."""
    seen: dict[tuple[str, str, str], str] = {}
    for fname, docs in _shipped().items():
        users: dict[str, list[str]] = {}
        for doc in docs:
            key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            assert key not in seen, f"{key} is in both {seen[key]} and {fname}"
            seen[key] = fname
        for job_name, template, _ in _pods(docs):
            for volume in template["spec"].get("volumes", []):
                users.setdefault(volume["persistentVolumeClaim"]["claimName"], []).append(job_name)
        claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
        assert all(len(users.get(c, [])) == 1 for c in claims), f"{fname}: {users}"
        assert claims or fname == examples.ETCD_FILE
    runtimes = [k for k in seen if k[0] == "ClusterTrainingRuntime"]
    assert len(runtimes) == 2


def test_the_default_image_is_the_dockerfile_build() -> None:
    assert PyTorchJobParams(name="t", script=("t.py",)).container_image == image.CPU_IMAGE
    assert PyTorchJobParams(name="t", script=("t.py",), gpus=1).container_image == image.GPU_IMAGE
    assert PyTorchJobParams(name="t", script=("t.py",), image="mine:1").container_image == "mine:1"


def test_header_says_how_to_apply_from_the_repository_root() -> None:
    for name, text in examples.rendered().items():
        command = f"kubectl apply -f launch/kubernetes/{name}"
        assert command in text and (REPO / command.split()[-1]).is_file()
