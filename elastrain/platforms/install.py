"""The command that installs elastrain where a job runs: ``tools/install.sh``, the repository's one install list.

``./dev setup`` and the ``Dockerfile`` run ``tools/install.sh VENV EXTRAS [REQUIREMENT...]``; a platform that
installs on its own nodes (SkyPilot's ``setup``, a Slurm cluster's shared checkout) runs the same script, written by
:meth:`Install.command` and read back by :meth:`Install.parse` (the tests check what a rendered spec installs
against what its script imports, :mod:`elastrain.platforms.needs`). The script runs from the repository root,
which is the working directory of every spec that uses it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from elastrain.errors import LaunchSpecError
from elastrain.platforms.image import VARIANTS, torch_index

SCRIPT = "tools/install.sh"
# An extra name, as pip normalises them (PEP 685); the rest is passed to pip as requirements.
_EXTRA = re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
# fsspec's package for each bucket scheme a checkpoint URL may use.
FSSPEC_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "r2": "s3fs"}
# elastrain's extra that a rendezvous backend needs.
BACKEND_EXTRAS = {"etcd-v3": "etcd"}


@dataclass(frozen=True)
class Install:
    """``TORCH_INDEX=<variant's index> tools/install.sh VENV EXTRAS REQUIREMENT...``."""

    venv: str = ".venv"
    extras: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    variant: str = "cpu"
    """torch's build: ``cpu`` or a CUDA one (``cu128``), from :data:`elastrain.platforms.image.VARIANTS`."""

    def __post_init__(self) -> None:
        if not self.venv.strip():
            raise LaunchSpecError("install venv: give the folder of the virtual environment (.venv)")
        for extra in self.extras:
            if not _EXTRA.match(extra):
                raise LaunchSpecError(f"install extras: {extra!r} is not an extra name (t5, etcd...)")
        if self.variant not in VARIANTS:
            raise LaunchSpecError(f"install variant {self.variant!r}: choose one of {', '.join(VARIANTS)}")

    @property
    def python(self) -> str:
        """The interpreter the job runs, inside the environment."""
        return f"{self.venv.rstrip('/')}/bin/python"

    def command(self) -> str:
        argv = [SCRIPT, self.venv, ",".join(self.extras), *self.requirements]
        return f"TORCH_INDEX={torch_index(self.variant)} {shlex.join(argv)}"

    @classmethod
    def parse(cls, command: str) -> Install:
        """The install a shell line asks for; raises :class:`LaunchSpecError` if it does not run the script."""
        words = shlex.split(command)
        env: dict[str, str] = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[:1] == ["bash"]:
            words.pop(0)
        if not words or words[0].removeprefix("./") != SCRIPT or len(words) < 3:
            raise LaunchSpecError(f"{command!r} does not run {SCRIPT} VENV EXTRAS [REQUIREMENT...]")
        variant = next((v for v in VARIANTS if env.get("TORCH_INDEX") == torch_index(v)), None)
        if variant is None:
            raise LaunchSpecError(f"{command!r}: TORCH_INDEX must be one of {[torch_index(v) for v in VARIANTS]}")
        extras = tuple(e for e in words[2].split(",") if e)
        return cls(venv=words[1], extras=extras, requirements=tuple(words[3:]), variant=variant)


def job_extras(extras: tuple[str, ...], rdzv_backend: str) -> tuple[str, ...]:
    """The script's extras plus the one the rendezvous backend needs, in order, without duplicates."""
    needed = BACKEND_EXTRAS.get(rdzv_backend)
    return tuple(dict.fromkeys([*extras, *([needed] if needed else [])]))


def bucket_package(url: str) -> str | None:
    """fsspec's package for a bucket URL (``s3://`` → s3fs), None for a local path or an unknown scheme."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return FSSPEC_PACKAGES.get(scheme)
