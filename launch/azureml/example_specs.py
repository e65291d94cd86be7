"""The rendered examples in ``launch/azureml/examples/`` and their parameters (CI checks they are current)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from launch.azureml.spec import AzureMLJobParams, command_job, compute_cluster, warnings
from launch.render import to_yaml

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
_HEADER = "Rendered by `python -m launch.azureml examples --write`; do not edit by hand."

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
    notes = "\n".join(textwrap.fill(w, 96, initial_indent="- ", subsequent_indent="  ") for w in warnings(T5))
    job_header = _HEADER + "\nSubmit: az ml job create --file job.yaml" + (f"\nWarnings:\n{notes}" if notes else "")
    return {
        "compute.yaml": to_yaml(
            [compute_cluster(T5)], header=_HEADER + "\nCreate: az ml compute create --file compute.yaml"
        ),
        "job.yaml": to_yaml([command_job(T5)], header=job_header),
    }


def stale() -> list[str]:
    return [
        str(EXAMPLES_DIR / f)
        for f, text in rendered().items()
        if not (EXAMPLES_DIR / f).is_file() or (EXAMPLES_DIR / f).read_text() != text
    ]


def write() -> list[str]:
    EXAMPLES_DIR.mkdir(parents=True, exist_ok=True)
    for f, text in rendered().items():
        (EXAMPLES_DIR / f).write_text(text)
    return [str(EXAMPLES_DIR / f) for f in rendered()]
