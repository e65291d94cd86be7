"""The rendered examples in ``launch/azureml/`` and their parameters (CI checks they are current)."""

from __future__ import annotations

from elastrain.platforms.azureml.spec import (
    CHECKPOINT_OUTPUT,
    AzureMLJobParams,
    command_job,
    compute_cluster,
    environment_definition,
    warnings,
)
from elastrain.platforms.render import to_yaml, warnings_block

PLATFORM = "azureml"
_HEADER = "Rendered by `python -m elastrain.platforms.azureml examples --write`; do not edit by hand."
ENVIRONMENT_FILE = "environment.yml"

T5 = AzureMLJobParams(
    # The script's data, tokenizer and metrics go to the mounted output too: rank 0 builds the data once and the
    # other nodes read it, so it must be on storage every node mounts.
    script=(
        "examples/t5/train.py",
        "--max-steps",
        "2000",
        "--output-dir",
        f"${{{{outputs.{CHECKPOINT_OUTPUT}}}}}/t5-output",
    ),
    compute="lowpri-t4",
    experiment_name="elastrain-t5",
    code="../..",  # relative to this folder: the repository root, where examples/t5/train.py is
    environment=f"file:{ENVIRONMENT_FILE}",
    min_nodes=1,
    max_nodes=4,
    nproc_per_node=1,
)

COMMANDS = {
    "compute.yaml": "From the repository root: az ml compute create --file launch/azureml/compute.yaml",
    "job.yaml": "From the repository root: az ml job create --file launch/azureml/job.yaml",
    ENVIRONMENT_FILE: (
        "job.yaml names this file (environment: file:environment.yml): `az ml job create` reads it from here.\n"
        "To register it under a name as well: az ml environment create --file launch/azureml/environment.yml "
        "--name elastrain"
    ),
}


def rendered() -> dict[str, str]:
    def header(fname: str, notes: list[str] | None = None) -> str:
        return f"{_HEADER}\n{COMMANDS[fname]}" + warnings_block(notes or [])

    return {
        "compute.yaml": to_yaml([compute_cluster(T5)], header=header("compute.yaml")),
        ENVIRONMENT_FILE: to_yaml([environment_definition(T5)], header=header(ENVIRONMENT_FILE)),
        "job.yaml": to_yaml([command_job(T5)], header=header("job.yaml", warnings(T5))),
    }
