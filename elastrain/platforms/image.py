"""The container image the launch specs run, built by the repository's ``Dockerfile``: its name is defined here only.

    docker build -t ghcr.io/elastrain/elastrain:0.1.0-cpu .                              # CPU torch (default)
    docker build --build-arg VARIANT=cu128 -t ghcr.io/elastrain/elastrain:0.1.0-cu128 .  # CUDA 12.8 torch

The image holds the source checkout in :data:`WORKDIR` (so ``examples/t5/train.py`` resolves there, as it does
from the repository root) and a virtual environment in :data:`VENV`, first on ``PATH``, with elastrain and the
extras :data:`EXTRAS`, installed by ``tools/install.sh``: the same install list ``./dev setup`` runs. Builders
that run containers (Kubernetes, AzureML) take the image as a parameter with :func:`default_image` as default: the
CUDA build where the job asks for GPUs, the CPU build otherwise. The tests check the Dockerfile against these
names, since CI cannot build it.
"""

from __future__ import annotations

from elastrain.errors import LaunchSpecError

REPOSITORY = "ghcr.io/elastrain/elastrain"
VERSION = "0.1.0"
"""elastrain's version (``pyproject.toml``): the image of release X is tagged X-VARIANT."""
VARIANTS = ("cpu", "cu128")
"""torch builds the Dockerfile's ``VARIANT`` argument chooses: ``download.pytorch.org/whl/<variant>``."""
GPU_VARIANT = "cu128"
TORCH_INDEX = "https://download.pytorch.org/whl/{variant}"
WORKDIR = "/opt/elastrain"
VENV = "/opt/venv"
EXTRAS = ("t5", "etcd")
"""elastrain's extras in the image: the T5 example's packages, and etcd for ``--rdzv-backend etcd-v3``."""


def image(variant: str = "cpu") -> str:
    """The tag the Dockerfile's build with ``--build-arg VARIANT=variant`` gets."""
    if variant not in VARIANTS:
        raise LaunchSpecError(f"image variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    return f"{REPOSITORY}:{VERSION}-{variant}"


def torch_index(variant: str) -> str:
    """Where the ``variant`` build of torch comes from."""
    if variant not in VARIANTS:
        raise LaunchSpecError(f"torch variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    return TORCH_INDEX.format(variant=variant)


def default_image(gpus: bool) -> str:
    """The image a spec names unless told otherwise: the CUDA build for GPU nodes, else the CPU build."""
    return image(GPU_VARIANT if gpus else "cpu")


CPU_IMAGE = image("cpu")
GPU_IMAGE = image(GPU_VARIANT)
