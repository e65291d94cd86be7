"""AzureML: a low-priority command job running elastrain (``python -m launch.azureml``), and its entrypoint."""

from launch.azureml.spec import (
    AzureMLJobParams,
    check_command_job,
    check_compute,
    command_job,
    compute_cluster,
    warnings,
)

__all__ = ["AzureMLJobParams", "check_command_job", "check_compute", "command_job", "compute_cluster", "warnings"]
