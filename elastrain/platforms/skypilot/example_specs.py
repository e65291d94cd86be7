"""The rendered example in ``launch/skypilot/`` and its parameters (CI checks it is current)."""

from __future__ import annotations

from elastrain.platforms.render import to_yaml, warnings_block
from elastrain.platforms.skypilot.spec import SkyPilotJobParams, task, warnings

PLATFORM = "skypilot"
LAUNCH = "sky jobs launch launch/skypilot/t5-elastic.yaml"
DATA = "runs/t5-data"
# The T5 example's data and tokenizer, built once where you launch from and copied to every node: rank 0 would
# build them on its own node's disk, where the other nodes cannot read them. (With torch, tokenizers and
# transformers installed: ./dev setup, or tools/install.sh .venv t5.)
PREPARE = f"""python -c 'import sys; sys.path.insert(0, "examples/t5"); import data; data.prepare("{DATA}")'"""

T5 = SkyPilotJobParams(
    name="t5-elastic",
    script=("examples/t5/train.py", "--max-steps", "2000", "--data-dir", "/t5-data"),
    extras=("t5",),
    checkpoint_url="s3://my-bucket/elastrain",
    min_nodes=1,
    max_nodes=4,
    accelerators="L4:1",
    infra=("aws", "gcp"),
    file_mounts=(("/t5-data", DATA),),
)


def rendered() -> dict[str, str]:
    header = (
        "Rendered by `python -m elastrain.platforms.skypilot examples --write`; do not edit by hand.\n"
        "From the repository root (the workdir, ., is the directory sky runs in, uploaded to every node):\n"
        f"  {PREPARE}\n"
        f"  {LAUNCH}" + warnings_block(warnings(T5))
    )
    return {"t5-elastic.yaml": to_yaml([task(T5)], header=header)}
