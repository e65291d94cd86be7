"""AzureML: a low-priority command job running elastrain (``python -m elastrain.platforms.azureml``)."""

from elastrain.platforms.azureml.spec import (
    AzureMLJobParams,
    check_command_job,
    check_compute,
    command_job,
    compute_cluster,
    environment_definition,
    warnings,
)

__all__ = [
    "AzureMLJobParams",
    "check_command_job",
    "check_compute",
    "command_job",
    "compute_cluster",
    "environment_definition",
    "warnings",
]
