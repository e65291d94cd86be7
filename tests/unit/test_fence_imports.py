"""The fence sits between the rendezvous and the checkpoints: both import it, neither imports the other through it.

Read from the source (no imports): the launcher's rendezvous reads the fence without loading the checkpoint package
(and with it torch.distributed.checkpoint), so that package needs no lazily imported names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elastrain

PACKAGE = Path(elastrain.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module that ``path`` imports, at any depth of the file (functions too), as absolute names."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_the_fence_and_the_rendezvous_import_nothing_from_the_checkpoint_package() -> None:
    sources = [
        PACKAGE / "fence.py",
        PACKAGE / "fence_moves.py",
        PACKAGE / "storage.py",
        *sorted((PACKAGE / "rendezvous").rglob("*.py")),
    ]
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(m for m in imported_modules(p) if m.startswith("elastrain.checkpoint"))
        for p in sources
    }
    assert {p: m for p, m in offenders.items() if m} == {}


def test_the_checkpoint_package_imports_its_names_plainly() -> None:
    tree = ast.parse((PACKAGE / "checkpoint" / "__init__.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "__getattr__" not in defined
    top_level = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"Checkpointer", "RestoreInfo", "SaveResult", "SaveSchedule"} <= top_level
