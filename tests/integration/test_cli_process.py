"""elastrain-run's argument errors in a real process: exit code 2, one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__))  # any existing file: the arguments are refused before it runs


def test_bad_input_exit_code_and_no_traceback_in_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain", "--nnodes=3:2", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("elastrain-run: error: --nnodes")
