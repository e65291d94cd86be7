"""The image the launch specs name: the Dockerfile that builds it, and its one install list, tools/install.sh,
which ./dev setup runs too (CI cannot run Docker: these tests read the files instead; hadolint and install.sh run for
real in tests/integration/test_launch_image_tools.py)."""

from __future__ import annotations

import re
import shlex

import pytest
from support.launch_checks import REPO, dockerignored, in_image

from elastrain.errors import LaunchSpecError
from elastrain.platforms import image
from elastrain.platforms.install import Install, bucket_package, job_extras

INSTALL = "tools/install.sh"


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.partition("=")[::2] for word, rest in _instructions() if word == "ARG")


def test_the_dockerfile_runs_the_one_install_list() -> None:
    runs = [rest for word, rest in _instructions() if word == "RUN"]
    assert len(runs) == 1, f"the image installs with {INSTALL} only: {runs}"
    words = shlex.split(runs[0])
    env = dict(w.partition("=")[::2] for w in words[: words.index(INSTALL)])
    assert words[words.index(INSTALL) :] == [INSTALL, image.VENV, "${EXTRAS}"]
    assert env == {"TORCH_INDEX": image.TORCH_INDEX.format(variant="${VARIANT}")}
    assert "pip" not in (REPO / "Dockerfile").read_text()  # nothing installed beside the list
    assert _args() == {"VARIANT": "cpu", "EXTRAS": ",".join(image.EXTRAS)}
    env_lines = " ".join(rest for word, rest in _instructions() if word == "ENV")
    assert f"PATH={image.VENV}/bin:$PATH" in env_lines
    assert ("WORKDIR", image.WORKDIR) in _instructions()
    assert ("COPY", ". .") in _instructions()  # the checkout, in WORKDIR, minus .dockerignore


def test_dev_setup_runs_the_same_list_and_reinstalls_when_it_changes() -> None:
    dev = (REPO / "dev").read_text()
    setup = dev[dev.index("setup() {") : dev.index("\n}\n", dev.index("setup() {"))]
    calls = [line.strip() for line in setup.splitlines() if line.strip().startswith(INSTALL)]
    assert calls == [f'{INSTALL} "$VENV" dev,deepspeed'], calls
    assert "pip install" not in setup and "-m pip" not in setup
    stamp = next(line for line in setup.splitlines() if "sha256sum" in line)
    assert all(name in stamp for name in ("pyproject.toml", "constraints.txt", INSTALL))


def test_the_tag_is_defined_once_and_named_by_the_dockerfile() -> None:
    text = (REPO / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(image.VERSION)}"$', pyproject, re.M)
    assert f'org.opencontainers.image.version="{image.VERSION}"' in text
    assert f'org.opencontainers.image.ref.name="{image.REPOSITORY}:{image.VERSION}-${{VARIANT}}"' in text
    for variant in image.VARIANTS:
        build_arg = "" if variant == "cpu" else f"--build-arg VARIANT={variant} "
        assert f"docker build {build_arg}-t {image.image(variant)} ." in text
    assert image.CPU_IMAGE == "ghcr.io/elastrain/elastrain:0.1.0-cpu"
    assert image.GPU_IMAGE == "ghcr.io/elastrain/elastrain:0.1.0-cu128"
    assert (image.default_image(False), image.default_image(True)) == (image.CPU_IMAGE, image.GPU_IMAGE)
    with pytest.raises(LaunchSpecError, match="variant"):
        image.image("rocm")


def test_the_image_holds_what_the_specs_run() -> None:
    for path in ("examples/t5/train.py", "examples/t5/data.py", "examples/t5/model.py", "elastrain/__init__.py",
                 "elastrain/platforms/kubernetes/schemas/kubeflow-trainer-trainjob.json", "pyproject.toml",
                 "README.md", "constraints.txt", INSTALL):  # fmt: skip
        assert in_image(path), f"{path} is not copied into the image"
    for path in (".venv/bin/python", ".git", "runs/t5", "elastrain/__pycache__/x.pyc", ".tools", "x.egg-info"):
        assert dockerignored(path), f"{path} would be copied into the image"


def test_install_commands_round_trip() -> None:
    cuda = Install(extras=("t5", "etcd"), requirements=("s3fs",), variant="cu128")
    assert cuda.command() == "TORCH_INDEX=https://download.pytorch.org/whl/cu128 tools/install.sh .venv t5,etcd s3fs"
    assert Install.parse(cuda.command()) == cuda
    assert Install.parse("TORCH_INDEX=https://download.pytorch.org/whl/cpu bash ./tools/install.sh v ''") == Install(
        venv="v"
    )
    assert cuda.python == ".venv/bin/python"
    for bad in ("pip install -e .", "tools/install.sh .venv t5", "TORCH_INDEX=https://x tools/install.sh .venv t5"):
        with pytest.raises(LaunchSpecError):
            Install.parse(bad)
    with pytest.raises(LaunchSpecError, match="extras"):
        Install(extras=("t5 etcd",))
    assert job_extras(("t5",), "etcd-v3") == ("t5", "etcd") and job_extras(("etcd",), "etcd-v3") == ("etcd",)
    assert (bucket_package("s3://b/p"), bucket_package("gs://b"), bucket_package("/shared/ckpt")) == (
        "s3fs",
        "gcsfs",
        None,
    )
