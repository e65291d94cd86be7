"""The rendered example in ``launch/slurm/`` and its parameters (CI checks it is current)."""

from __future__ import annotations

from elastrain.platforms.render import warnings_block
from elastrain.platforms.slurm.spec import SlurmJobParams, sbatch_script, warnings

PLATFORM = "slurm"
SUBMIT = "sbatch launch/slurm/t5-elastic.sbatch"

T5 = SlurmJobParams(
    name="t5-elastic",
    # The script's data, tokenizer and metrics go to the shared filesystem too: rank 0 builds the data once and
    # the other nodes read it, so it must be where every node sees it.
    script=("examples/t5/train.py", "--max-steps", "2000", "--output-dir", "/shared/runs/t5-elastic"),
    checkpoint_dir="/shared/checkpoints/t5-elastic",
    extras=("t5",),
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
        f"Submit from the repository root (the job runs in the submit directory): {SUBMIT}"
        + warnings_block(warnings(T5))
    )
    return {"t5-elastic.sbatch": sbatch_script(T5, header=header)}
