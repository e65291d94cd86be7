"""The rendered example in ``launch/skypilot/`` and its parameters (CI checks it is current)."""

from __future__ import annotations

from elastrain.platforms.render import to_yaml, warnings_block
from elastrain.platforms.skypilot.spec import SkyPilotJobParams, task, warnings

PLATFORM = "skypilot"

T5 = SkyPilotJobParams(
    name="t5-elastic",
    script=("examples/t5/train.py", "--steps", "2000"),
    checkpoint_url="s3://my-bucket/elastrain",
    min_nodes=1,
    max_nodes=4,
    accelerators="L4:1",
    infra=("aws", "gcp"),
)


def rendered() -> dict[str, str]:
    header = (
        "Rendered by `python -m elastrain.platforms.skypilot examples --write`; do not edit by hand.\n"
        "Launch: sky jobs launch t5-elastic.yaml" + warnings_block(warnings(T5))
    )
    return {"t5-elastic.yaml": to_yaml([task(T5)], header=header)}
