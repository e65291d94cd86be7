"""The whole package keeps the shape issue 23 gave it: modules of a few hundred lines, classes of one job.

Static reading only (``ast``): no module is imported, no process or server started. The rendezvous package's own
finer rules (a thin handler, no private access across objects) are in ``test_rendezvous_shape.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "elastrain"
MODULE_LINES = 450
CLASS_LINES = 275
"""About 250 (issue 23), with room for a docstring: a class past this holds two jobs."""
LONG_BY_DESIGN = {PACKAGE / "rendezvous" / "state.py"}
"""The pure rendezvous state machine: one transition table that reads top to bottom."""


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in modules()
        if p not in LONG_BY_DESIGN and (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines (split them by job): {long}"


def test_no_class_is_over_about_250_lines() -> None:
    long = {
        f"{p.relative_to(PACKAGE)}:{node.name}": span
        for p in modules()
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p)))
        if isinstance(node, ast.ClassDef) and (span := (node.end_lineno or node.lineno) - node.lineno + 1) > CLASS_LINES
    }
    assert not long, f"classes over {CLASS_LINES} lines (two jobs in one class?): {long}"
