"""What a launch spec's training script needs: the modules it imports (read with preload's reader), the
distributions an install gives, and the flags the script takes."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.launch_checks import REPO

from elastrain.errors import LaunchSpecError
from elastrain.platforms import needs

T5 = REPO / "examples" / "t5" / "train.py"


def test_script_imports_follow_the_scripts_own_modules(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import os, json\n"
        "from typing import TYPE_CHECKING\n"
        "import torch.distributed as dist\n"
        "from helpers import thing\n"
        "if TYPE_CHECKING:\n    import pandas\n"
        "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def later():\n    import scipy\n"
    )
    (tmp_path / "helpers.py").write_text("import numpy as np\nfrom pkg import x\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import transformers\nimport train\n")
    # stdlib left out; TYPE_CHECKING and function bodies are not run at import; local modules are followed.
    assert needs.script_imports(tmp_path / "train.py") == ["torch", "yaml", "numpy", "transformers"]


def test_the_t5_example_needs_the_t5_extra() -> None:
    assert needs.script_imports(T5) == ["torch", "transformers", "elastrain"]
    # What `pip install -e . s3fs` gave the SkyPilot nodes: transformers was missing.
    assert needs.missing_imports(T5, (), ["s3fs"]) == ["transformers (transformers)"]
    assert needs.missing_imports(T5, ("t5",)) == []


def test_installed_by_follows_requirements_and_extras() -> None:
    base = needs.installed_by(())
    assert {"elastrain", "torch", "numpy", "pyyaml"} <= base and "transformers" not in base
    t5 = needs.installed_by(("t5",))
    assert {"transformers", "tokenizers", "huggingface-hub"} <= t5  # and what transformers requires in turn
    assert "python3-etcd3" in needs.installed_by(("etcd",))
    assert "s3fs" in needs.installed_by((), ["s3fs==2026.9.0"])
    assert "not-installed-anywhere" in needs.installed_by((), ["not-installed-anywhere"])
    with pytest.raises(LaunchSpecError, match="requirement"):
        needs.installed_by((), ["not a requirement!"])


def test_missing_imports_name_the_module_and_its_distribution(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import yaml\nimport etcd3\nimport no_such_module_here\n")
    assert needs.missing_imports(script, ()) == ["etcd3 (python3-etcd3)", "no_such_module_here (not installed here)"]
    assert needs.missing_imports(script, ("etcd",)) == ["no_such_module_here (not installed here)"]


def test_unknown_options_read_the_scripts_parser() -> None:
    assert {"--max-steps", "--output-dir", "--data-dir"} <= needs.script_options(T5)
    # The flag every launch file gave the T5 example before: train.py has --max-steps, not --steps.
    assert needs.unknown_options(T5, ["--steps", "2000"]) == ["--steps"]
    assert needs.unknown_options(T5, ["--max-steps=2000", "--lr", "-1e-3", "--", "--not-mine"]) == []


def test_unreadable_scripts_say_so(tmp_path: Path) -> None:
    with pytest.raises(LaunchSpecError, match="cannot read"):
        needs.script_imports(tmp_path / "missing.py")
    (tmp_path / "bad.py").write_text("import (\n")
    with pytest.raises(LaunchSpecError, match="does not parse"):
        needs.script_imports(tmp_path / "bad.py")
