"""The rendered examples in ``launch/azureml/`` and their parameters (CI checks they are current)."""

from __future__ import annotations

from elastrain.platforms.azureml.spec import AzureMLJobParams, command_job, compute_cluster, warnings
from elastrain.platforms.render import to_yaml, warnings_block

PLATFORM = "azureml"
_HEADER = "Rendered by `python -m elastrain.platforms.azureml examples --write`; do not edit by hand."

T5 = AzureMLJobParams(
    script=("examples/t5/train.py", "--steps", "2000"),
    compute="lowpri-nc6",
    experiment_name="elastrain-t5",
    min_nodes=1,
    max_nodes=4,
    nproc_per_node=1,
    vm_size="Standard_NC6s_v3",
)


def rendered() -> dict[str, str]:
    job_header = _HEADER + "\nSubmit: az ml job create --file job.yaml" + warnings_block(warnings(T5))
    return {
        "compute.yaml": to_yaml(
            [compute_cluster(T5)], header=_HEADER + "\nCreate: az ml compute create --file compute.yaml"
        ),
        "job.yaml": to_yaml([command_job(T5)], header=job_header),
    }
