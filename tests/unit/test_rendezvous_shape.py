"""The rendezvous package keeps the shape issue 23 gave it: small modules, classes of one job, a thin handler.

Static reading only (``ast``): no module is imported, no process or server started.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "elastrain" / "rendezvous"
PURE_STATE_MACHINE = PACKAGE / "state.py"  # may stay long: it reads top to bottom


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_rendezvous_module_is_over_450_lines() -> None:
    long = {p.name: n for p in modules() if p != PURE_STATE_MACHINE and (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over ~450 lines: {long}"


def test_the_handler_is_a_facade_of_about_300_lines() -> None:
    lines = len((PACKAGE / "handler.py").read_text().splitlines())
    assert lines <= 330, f"rendezvous/handler.py has {lines} lines: it composes the parts, it does not hold them"


def test_no_rendezvous_class_is_over_250_lines() -> None:
    long = {
        f"{p.name}:{node.name}": span
        for p in modules()
        for node in ast.walk(tree(p))
        if isinstance(node, ast.ClassDef) and (span := (node.end_lineno or node.lineno) - node.lineno + 1) > 250
    }
    assert not long, f"classes over ~250 lines (two jobs in one class?): {long}"


def test_no_module_reaches_into_another_objects_private_attributes() -> None:
    reached = [
        f"{p.name}:{node.lineno}: {ast.unparse(node)}"
        for p in modules()
        for node in ast.walk(tree(p))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super")
    ]
    assert not reached, f"private access across objects: {reached}"


def test_the_handler_declares_every_member_of_the_membership_protocol() -> None:
    def members(path: Path, cls: str) -> set[str]:
        body = next(n for n in tree(path).body if isinstance(n, ast.ClassDef) and n.name == cls).body
        return {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    wanted = members(PACKAGE / "api.py", "Membership")
    assert wanted, "api.py's Membership Protocol has no members?"
    missing = wanted - members(PACKAGE / "handler.py", "ElastrainRendezvousHandler")
    assert not missing, f"ElastrainRendezvousHandler lacks Membership members: {sorted(missing)}"
