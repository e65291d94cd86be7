"""The package as users get it: ``python -m build`` makes a wheel and an sdist, and the wheel, installed into a
fresh venv, gives working CLIs, its kept schemas, and no top-level ``launch`` package.

The fresh venv reuses this interpreter's installed dependencies (torch, jsonschema...) through a ``.pth``
line, so nothing is downloaded; elastrain itself comes only from the wheel (the test runs outside the
checkout, without PYTHONPATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from support.processes import REPO

pytestmark = pytest.mark.slow
pytest.importorskip("build")


def _copy_sources(dest: Path) -> None:
    """The files git would ship (tracked and not ignored), so builds never write into the checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        ignore = shutil.ignore_patterns(".git", ".venv", "*cache*", "runs", "build", "dist", "*.egg-info")
        shutil.copytree(REPO, dest, ignore=ignore)
        return
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("PET_", "ELASTRAIN_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("package")
    src = root / "src"
    _copy_sources(src)
    # --no-isolation: build with this interpreter's setuptools, offline.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(root / "dist"), str(src)], cwd=root)
    return root / "dist"


@pytest.fixture(scope="module")
def venv(dist: Path) -> Path:
    env_dir = dist.parent / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=dist.parent)
    python = env_dir / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=dist.parent)
    # The dependencies already installed here, after the venv's own site-packages.
    (Path(site.stdout.strip()) / "_elastrain_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist.glob("*.whl")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    _run(pip, cwd=dist.parent)
    return env_dir


def test_build_makes_a_wheel_and_an_sdist_without_a_launch_package(dist: Path) -> None:
    (wheel,) = dist.glob("elastrain-*.whl")
    (sdist,) = dist.glob("elastrain-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"elastrain", wheel.name.split("-py")[0] + ".dist-info"}
    for schema in (
        "elastrain/platforms/kubernetes/schemas/kubeflow-trainer-trainjob.json",
        "elastrain/platforms/kubernetes/schemas/kubeflow-trainer-clustertrainingruntime.json",
        "elastrain/platforms/skypilot/schemas/skypilot-task.json",
    ):
        assert schema in names
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("skypilot/schemas/skypilot-task.json") for n in tar.getnames())
        assert not any("/launch/" in n for n in tar.getnames())


def test_the_installed_wheel_runs_its_clis(venv: Path, tmp_path: Path) -> None:
    bin_dir = venv / "bin"
    python = str(bin_dir / "python")
    where = _run([python, "-c", "import elastrain; print(elastrain.__file__)"], cwd=tmp_path).stdout
    assert where.startswith(str(venv)), f"elastrain came from {where}, not the wheel"
    assert subprocess.run([python, "-c", "import launch"], cwd=tmp_path, env=_clean_env(), timeout=60).returncode != 0
    assert "--nnodes" in _run([str(bin_dir / "elastrain-run"), "--help"], cwd=tmp_path).stdout
    assert "--nnodes" in _run([python, "-m", "elastrain", "--help"], cwd=tmp_path).stdout
    _run([str(bin_dir / "elastrain-chaos"), "--help"], cwd=tmp_path)
    for module in (
        "kubernetes",
        "azureml",
        "azureml.entrypoint",
        "skypilot",
        "skypilot.entrypoint",
        "slurm",
        "slurm.entrypoint",
    ):
        assert "usage:" in _run([python, "-m", f"elastrain.platforms.{module}", "--help"], cwd=tmp_path).stdout
    # The kept schemas are package data: rendering with validation works from the wheel.
    tj = [python, "-m", "elastrain.platforms.kubernetes", "trainjob", "--name", "t", "--image", "i", "--validate"]
    assert "kind: TrainJob" in _run([*tj, "--", "train.py"], cwd=tmp_path).stdout
    sky = [python, "-m", "elastrain.platforms.skypilot", "render", "--name", "t", "--checkpoint-url", "s3://b/c"]
    assert "num_nodes: 2" in _run([*sky, "--", "train.py"], cwd=tmp_path).stdout
    slurm = [python, "-m", "elastrain.platforms.slurm", "render", "--name", "t", "--checkpoint-dir", "/c"]
    assert "#SBATCH --requeue" in _run([*slurm, "--", "train.py"], cwd=tmp_path).stdout
