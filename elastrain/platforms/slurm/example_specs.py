"""The rendered example in ``launch/slurm/`` and its parameters (CI checks it is current)."""

from __future__ import annotations

from elastrain.platforms.render import warnings_block
from elastrain.platforms.slurm.spec import SlurmJobParams, sbatch_script, warnings

PLATFORM = "slurm"

T5 = SlurmJobParams(
    name="t5-elastic",
    script=("examples/t5/train.py", "--steps", "2000"),
    checkpoint_dir="/shared/checkpoints/t5-elastic",
    min_nodes=1,
    max_nodes=4,
    nproc_per_node="gpu",
    gpus_per_node=4,
    cpus_per_node=32,
    time_limit="12:00:00",
    partition="spot",
    env=(("OMP_NUM_THREADS", "1"),),
)


def rendered() -> dict[str, str]:
    header = (
        "Rendered by `python -m elastrain.platforms.slurm examples --write`; do not edit by hand.\n"
        "Submit: sbatch t5-elastic.sbatch" + warnings_block(warnings(T5))
    )
    return {"t5-elastic.sbatch": sbatch_script(T5, header=header)}
